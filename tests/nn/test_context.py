"""tfm/nn/context.py: the masks the model describes by parts, written out by the kernels'
tfm.kernels.masks.dense_mask, equal the dense masks the model built before (issue 45), each
written here as a loop over (row, query, key) from what the mask means."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TINY_LM

from tfm.kernels import masks
from tfm.nn.cache import init_cache
from tfm.nn.config import ModelConfig
from tfm.nn.context import (
    cached_inputs,
    full_pass_inputs,
    resolve_valid,
    self_attention_context,
    with_cross_attention,
)
from tfm.nn.layers import PositionBias


def _loop(shape: tuple[int, int, int], attends) -> np.ndarray:  # -> [batch, 1, q_len, kv_len]
    """The mask with attends(row, query, key) -> bool at each entry."""
    batch, q_len, kv_len = shape
    out = np.zeros((batch, 1, q_len, kv_len), bool)
    for b in range(batch):
        for i in range(q_len):
            for j in range(kv_len):
                out[b, 0, i, j] = attends(b, i, j)
    return out


def _written_out(structure, q_len: int, kv_len: int, batch: int) -> np.ndarray:
    mask = masks.dense_mask(structure, q_len, kv_len)  # None: every key
    mask = np.ones((1, 1, 1, 1), bool) if mask is None else np.asarray(mask)
    return np.broadcast_to(mask, (batch, 1, q_len, kv_len))


def _config(window: int | None = None) -> ModelConfig:
    return ModelConfig(**{**TINY_LM, "local_window": window})


LEFT_PADDED = np.array([[False, False, True, True, True, True, True, True],
                        [True, True, True, True, True, True, True, True]])
RIGHT_PADDED = np.array([[True, True, True, True, True, False, False, False],
                         [True, True, True, True, True, True, True, False]])
PACKED = np.array([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 2, 2, 2]])


def _packed_positions(ids: np.ndarray) -> np.ndarray:
    """Positions restarting at 0 in each segment (the data pipeline's packing)."""
    positions = np.zeros_like(ids)
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            positions[b, t] = positions[b, t - 1] + 1 if ids[b, t] == ids[b, t - 1] else 0
    return positions


@pytest.mark.parametrize("causal", [True, False], ids=["decoder", "encoder"])
@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("rows", ["plain", "left_padded", "right_padded", "packed"])
def test_a_full_pass_mask_by_parts_is_the_dense_mask(causal, window, rows):
    """Causal (decoder) or not (encoder), with or without a local window, over plain, padded
    and packed rows: query i sees key j iff j <= i (decoder), key j is real, both are in one
    segment, and their positions differ by at most the window."""
    tokens = jnp.ones((2, 8), jnp.int32)
    valid = segment_ids = positions = None
    if rows in ("left_padded", "right_padded"):
        valid = jnp.asarray(LEFT_PADDED if rows == "left_padded" else RIGHT_PADDED)
    if rows == "packed":
        segment_ids, positions = jnp.asarray(PACKED), jnp.asarray(_packed_positions(PACKED))
    from_segments = valid is None and segment_ids is not None
    valid = resolve_valid(tokens, valid, segment_ids)
    got_positions, structure = full_pass_inputs(_config(window), tokens, positions, valid,
                                                segment_ids, causal,
                                                valid_from_segments=from_segments)
    # Only packed rows whose validity is their ids > 0 let blocked kernels read the ids as
    # they are (tfm.kernels.masks.block_segments).
    assert structure.segments_mark_padding == (rows == "packed")
    real = np.ones((2, 8), bool) if valid is None else np.asarray(valid)
    ids = np.ones((2, 8), int) if segment_ids is None else PACKED
    # Positions count the real tokens before each one (left padding does not shift them).
    pos = np.cumsum(real, axis=1) - real if rows.endswith("padded") else np.arange(8)[None]
    pos = _packed_positions(PACKED) if rows == "packed" else np.broadcast_to(pos, (2, 8))
    np.testing.assert_array_equal(got_positions, pos)

    def attends(b, i, j):
        return ((not causal or j <= i) and real[b, j] and ids[b, i] == ids[b, j]
                and (window is None or abs(pos[b, i] - pos[b, j]) <= window))

    np.testing.assert_array_equal(_written_out(structure, 8, 8, 2), _loop((2, 8, 8), attends))


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("left_padded", [False, True])
def test_cached_decoding_mask_by_parts_is_the_dense_mask(window, left_padded):
    """New tokens at each row's write index against the cache's slots: query i (slot
    lengths[b] + i) sees slot j iff j <= lengths[b] + i, the slot is filled and holds a real
    token, and (window) their positions, counting real tokens, differ by at most the window."""
    config = _config(window)
    lengths = np.array([3, 5])
    cache_valid = np.ones((2, 10), bool)
    if left_padded:
        cache_valid[0, :2] = False  # row 0's prefill was left-padded by two tokens
    cache = init_cache(config, 2, 10).replace(lengths=jnp.asarray(lengths, jnp.int32),
                                               valid=jnp.asarray(cache_valid))
    tokens = jnp.ones((2, 2), jnp.int32)
    positions, key_positions, structure, new_valid = cached_inputs(config, cache, tokens, None,
                                                                   None)
    real = cache_valid.copy()  # the two new tokens are real
    key_pos = np.cumsum(real, axis=1) - real
    np.testing.assert_array_equal(new_valid, real)
    np.testing.assert_array_equal(key_positions, key_pos)
    np.testing.assert_array_equal(positions, [key_pos[b, lengths[b]: lengths[b] + 2]
                                              for b in range(2)])

    def attends(b, i, j):
        slot = lengths[b] + i
        return (j <= slot and j < lengths[b] + 2 and real[b, j]
                and (window is None or abs(key_pos[b, slot] - key_pos[b, j]) <= window))

    np.testing.assert_array_equal(_written_out(structure, 2, 10, 2), _loop((2, 2, 10), attends))


@pytest.mark.parametrize("packed", [False, True])
def test_cross_attention_mask_by_parts_is_the_dense_mask(packed):
    """Decoder queries against the encoder output: key j is a real source token and, packed,
    in the query's segment."""
    source_valid = jnp.asarray(RIGHT_PADDED)
    tokens = jnp.ones((2, 6), jnp.int32)
    _, structure = full_pass_inputs(_config(), tokens, None, None, None, True)
    ctx = self_attention_context(_config(), lambda q, k: None, jnp.zeros((2, 6), jnp.int32),
                                 jnp.zeros((2, 6), jnp.int32), structure, None)
    target_ids = np.array([[1, 1, 2, 2, 2, 0], [1, 1, 1, 2, 2, 2]])
    segments = (jnp.asarray(target_ids), jnp.asarray(PACKED)) if packed else (None, None)
    ctx = with_cross_attention(ctx, jnp.zeros((2, 8, 4)), source_valid, *segments)

    def attends(b, i, j):
        return RIGHT_PADDED[b, j] and (not packed or target_ids[b, i] == PACKED[b, j])

    np.testing.assert_array_equal(_written_out(ctx.cross_attention.structure, 6, 8, 2),
                                  _loop((2, 6, 8), attends))


def test_the_shared_position_bias_travels_by_parts():
    """A stack's shared T5 bias goes into the structure by blocks, and the kernels' dense form
    of it is the scheme's t5_bias table lookup."""
    from tfm.nn import positions as P

    config = ModelConfig(**{**TINY_LM, "position_scheme": "t5_bias"})
    tokens = jnp.ones((2, 8), jnp.int32)
    pos, structure = full_pass_inputs(config, tokens, None, None, None, True)
    bias_module = PositionBias(config, False)
    params = bias_module.init(__import__("jax").random.key(0), pos, pos)
    ctx = self_attention_context(config, lambda q, k: bias_module.apply(params, q, k), pos, pos,
                                 structure, None)
    by_blocks = ctx.self_attention.structure.bias
    table = params["params"]["t5_bias_table"]
    table = getattr(table, "value", table)  # unboxed from its logical axes
    want = P.t5_bias(table, pos, pos, bidirectional=False, num_buckets=config.t5_num_buckets,
                     max_distance=config.t5_max_distance)
    np.testing.assert_array_equal(masks.dense_bias(ctx.self_attention.structure, None, 1.0),
                                  want)
    np.testing.assert_allclose(P.dense_from_blocks(by_blocks.function, by_blocks.params, pos,
                                                   pos), want, atol=1e-6)
