"""tfm/kernels/masks.py: the dense mask and bias a kernel writes out from a call's structure by
parts, against masks and biases written here entry by entry, and the kernels that read the
structure (the reference, the CPU blocks, splash and flex) against the reference fed the dense
mask and bias."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import random_inputs

from tfm import kernels
from tfm.kernels import masks, reference
from tfm.kernels.call import AttentionStructure, BlockBias, RelativeBias
from tfm.nn import positions as P


def _entries(mask: jax.Array | None, batch: int, q_len: int, kv_len: int) -> np.ndarray:
    mask = np.ones((1, 1, 1, 1), bool) if mask is None else np.asarray(mask)
    return np.broadcast_to(mask, (batch, 1, q_len, kv_len))


def test_each_part_of_the_mask():
    """Causal from a per-row offset, a window by positions, valid keys and segments, each
    alone and all together, entry by entry."""
    offset = np.array([0, 3])
    query_positions = np.array([[0, 1, 2], [3, 4, 6]])
    key_positions = np.array([[0, 1, 2, 3, 4, 5], [0, 1, 2, 4, 5, 6]])
    valid = np.array([[True] * 6, [False, True, True, True, True, False]])
    query_ids, key_ids = np.array([[1, 1, 2], [1, 1, 1]]), np.array([[1, 1, 2, 2, 2, 0]] * 2)
    parts = {
        "causal": (dict(causal=True, query_offset=jnp.asarray(offset)),
                   lambda b, i, j: j <= i + offset[b]),
        "window": (dict(window=1, query_positions=jnp.asarray(query_positions),
                        key_positions=jnp.asarray(key_positions)),
                   lambda b, i, j: abs(query_positions[b, i] - key_positions[b, j]) <= 1),
        "index_window": (dict(window=1), lambda b, i, j: abs(i - j) <= 1),
        "valid": (dict(key_valid=jnp.asarray(valid)), lambda b, i, j: valid[b, j]),
        "segments": (dict(query_segments=jnp.asarray(query_ids),
                          key_segments=jnp.asarray(key_ids)),
                     lambda b, i, j: query_ids[b, i] == key_ids[b, j]),
    }
    everything, all_want = {}, np.ones((2, 1, 3, 6), bool)
    for name, (fields, attends) in parts.items():
        want = np.array([[[[attends(b, i, j) for j in range(6)] for i in range(3)]]
                         for b in range(2)])
        got = masks.dense_mask(AttentionStructure(**fields), 3, 6)
        np.testing.assert_array_equal(_entries(got, 2, 3, 6), want, err_msg=name)
        if name != "index_window":
            everything = {**everything, **fields}
            all_want = all_want & want
    got = masks.dense_mask(AttentionStructure(**everything), 3, 6)
    np.testing.assert_array_equal(_entries(got, 2, 3, 6), all_want)
    assert masks.dense_mask(AttentionStructure(), 3, 6) is None


def test_the_biases_written_out():
    """A position bias by blocks (its dense form, else its block function on whole rows) plus
    Shaw's bias from the queries: the sum of the two, as the schemes compute them."""
    rng = np.random.default_rng(0)
    query = jnp.asarray(rng.normal(size=(2, 5, 4, 8)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    slopes = (jnp.asarray(P.alibi_slopes(4), jnp.float32)[:, None],)
    table = jnp.asarray(rng.normal(size=(7, 8)), jnp.float32)
    relative = RelativeBias(functools.partial(P.shaw_bias, max_distance=3), table, positions,
                            positions)
    alibi = P.alibi_bias(positions, positions, P.alibi_slopes(4))
    shaw = P.shaw_logit_bias(query, table, P.relative_indices(positions, positions, 3), 0.5)
    for dense in (None, P.alibi_dense_bias):
        by_blocks = BlockBias(P.alibi_block_bias, slopes, positions, positions, dense=dense)
        got = masks.dense_bias(AttentionStructure(bias=by_blocks, relative=relative), query, 0.5)
        np.testing.assert_allclose(got, alibi + shaw, atol=1e-5)
    assert masks.dense_bias(AttentionStructure(), query, 0.5) is None


@pytest.mark.parametrize("backend", ["cpu", "xla", "splash", "flex"])
def test_kernels_read_the_structure(backend):
    """Every backend given only the structure (causal over right-padded rows: row b has
    17 (b + 1) padding keys) equals the reference fed the dense mask, at every query: the
    fused kernels give invalid keys a segment no query has."""
    query, key, value = random_inputs(np.random.default_rng(2), 128, 128, 4, 2, "float32")
    valid = jnp.arange(128)[None] < 128 - 17 * (jnp.arange(2)[:, None] + 1)  # [2, 128]
    structure = AttentionStructure(causal=True, key_valid=valid)
    index = jnp.broadcast_to(jnp.arange(128), (2, 128))
    mask = reference.causal_mask(index, index) & reference.padding_mask(valid)
    want = reference.dot_product_attention(query, key, value, mask=mask)
    got = jax.jit(functools.partial(kernels.attention, backend=backend, structure=structure))(
        query, key, value)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_block_segments_pass_ids_that_mark_padding_as_they_are():
    """Packed rows (id 0 = padding) whose validity is their ids > 0: flagged, the blocked
    kernels get the one id array for queries and keys (padding keys keep segment 0, which
    only padding queries share); unflagged, padding keys get a segment no query has."""
    ids = jnp.asarray([[1, 1, 2, 2, 0, 0], [1, 2, 2, 2, 2, 0]], jnp.int32)
    structure = AttentionStructure(True, None, ids, ids, key_valid=ids > 0)
    query_ids, key_ids = masks.block_segments(structure, 6, -1)
    np.testing.assert_array_equal(query_ids, ids)
    np.testing.assert_array_equal(key_ids, jnp.where(ids > 0, ids, -1))
    query_ids, key_ids = masks.block_segments(structure.replace(segments_mark_padding=True), 6, -1)
    assert query_ids is ids and key_ids is ids
    # The dense mask does not read the flag: the reference's values stay as they were.
    np.testing.assert_array_equal(
        masks.dense_mask(structure, 6, 6),
        masks.dense_mask(structure.replace(segments_mark_padding=True), 6, 6))


@pytest.mark.parametrize("backend", ["splash", "flex"])
def test_fused_kernels_with_ids_that_mark_padding_equal_the_reference(backend):
    """Causal packed rows given as one id array (segments_mark_padding): the values at every
    real query equal the reference fed the dense mask (padding queries may differ)."""
    query, key, value = random_inputs(np.random.default_rng(4), 128, 128, 4, 2, "float32")
    ids = np.zeros((2, 128), np.int32)
    ids[0, :50], ids[0, 50:100], ids[1, :90], ids[1, 90:120] = 1, 2, 1, 3
    ids = jnp.asarray(ids)
    structure = AttentionStructure(True, None, ids, ids, key_valid=ids > 0,
                                   segments_mark_padding=True)
    want = reference.dot_product_attention(query, key, value,
                                           mask=masks.dense_mask(structure, 128, 128))
    got = jax.jit(functools.partial(kernels.attention, backend=backend, structure=structure))(
        query, key, value)
    real = np.asarray(ids) > 0
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], atol=2e-5)


def test_cached_decoding_offsets_reach_the_cpu_kernel():
    """Two new queries at per-row cache offsets against a cache with unfilled slots: the CPU
    kernel builds its mask from the offset and the filled slots."""
    query, key, value = random_inputs(np.random.default_rng(3), 2, 10, 4, 2, "float32")
    lengths = jnp.asarray([3, 7])
    structure = AttentionStructure(causal=True, query_offset=lengths,
                                   key_valid=jnp.arange(10)[None] < (lengths + 2)[:, None])
    want = reference.dot_product_attention(query, key, value,
                                           mask=masks.dense_mask(structure, 2, 10))
    got = kernels.attention(query, key, value, backend="cpu", structure=structure)
    np.testing.assert_allclose(got, want, atol=2e-6)
    lone = masks.dense_mask(AttentionStructure(causal=True), 2, 10)
    assert not np.allclose(want, reference.dot_product_attention(query, key, value, mask=lone))
