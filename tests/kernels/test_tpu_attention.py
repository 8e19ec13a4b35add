"""Splash attention (tfm.kernels.tpu_attention) against the reference maths, run here in Pallas
interpret mode: values and q/k/v gradients at every real query, for the masks it builds per
block (causal, local window, packed segments, padding), GQA, lengths that are not whole blocks,
cross-attention, float32 and bfloat16; then whole models, cached decoding, and the TPU program
it lowers to (a Mosaic kernel, no [batch, heads, T, T] array)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    assert_cached_decoding_matches_full_pass,
    assert_model_matches_reference,
    case_segments,
    dense_mask,
    kernel_operands,
    lowered_lm_grad,
    random_inputs,
    segments,
)
from tiny_model import TINY, TINY_LM

from tfm import kernels
from tfm.kernels.call import AttentionStructure
from tfm.nn import attention as reference
from tfm.nn.config import ModelConfig

CASES = {
    # name: (q_len, kv_len, heads, kv_heads, causal, window, segments, dtype)
    "causal_gqa_f32": (128, 128, 4, 2, True, None, "none", "float32"),
    "causal_padded_unaligned": (100, 100, 4, 4, True, None, "padding", "float32"),
    "causal_packed_bf16": (256, 256, 4, 2, True, None, "packed", "bfloat16"),
    "causal_window_packed": (150, 150, 2, 1, True, 9, "packed", "float32"),
    "bidirectional_window_padded": (130, 130, 4, 2, False, 6, "padding", "float32"),
    "bidirectional_padded_bf16": (64, 64, 4, 4, False, None, "padding", "bfloat16"),
    "cross_padded": (70, 150, 4, 2, False, None, "cross", "float32"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_splash_equals_the_reference_forward_and_backward(case):
    q_len, kv_len, heads, kv_heads, causal, window, segment_kind, dtype = CASES[case]
    rng = np.random.default_rng(1)
    batch = 2
    query, key, value = random_inputs(rng, q_len, kv_len, heads, kv_heads, dtype, batch)
    query_segments, key_segments = case_segments(segment_kind, batch, q_len, kv_len)
    structure = AttentionStructure(causal, window, query_segments, key_segments)
    mask = dense_mask(structure, q_len, kv_len)
    real = np.ones((batch, q_len), bool) if query_segments is None or segment_kind == "cross" \
        else np.asarray(query_segments) > 0
    probe = jnp.asarray(rng.normal(size=query.shape), jnp.float32) * real[:, :, None, None]

    def loss(backend, query, key, value):
        out = kernels.attention(query, key, value, backend=backend, mask=mask, causal=causal,
                                structure=structure)
        return jnp.sum(out.astype(jnp.float32) * probe), out

    grad = jax.jit(jax.value_and_grad(loss, (1, 2, 3), has_aux=True), static_argnums=0)
    (want, want_out), want_grads = grad("reference", query, key, value)
    (got, got_out), got_grads = grad("splash", query, key, value)
    tolerance = 2e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(got_out, np.float32)[real],
                               np.asarray(want_out, np.float32)[real], atol=tolerance)
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        scale = float(jnp.abs(w.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=tolerance * max(scale, 1.0), err_msg=name)


def test_a_wrong_structure_gives_different_values():
    """The kernel reads the structure, not the dense mask: describing a causal mask as
    bidirectional changes the output (so the equality above is not vacuous)."""
    rng = np.random.default_rng(2)
    query, key, value = (jnp.asarray(rng.normal(size=(1, 128, 2, 16)), jnp.float32)
                         for _ in "qkv")
    mask = reference.causal_mask(jnp.arange(128)[None], jnp.arange(128)[None])
    right = kernels.attention(query, key, value, backend="splash", mask=mask,
                              structure=AttentionStructure(causal=True))
    wrong = kernels.attention(query, key, value, backend="splash", mask=mask,
                              structure=AttentionStructure(causal=False))
    want = kernels.attention(query, key, value, backend="reference", mask=mask)
    np.testing.assert_allclose(right, want, atol=2e-5)
    assert float(jnp.abs(wrong - want).max()) > 0.1


def _model_config(backend: str, **changes) -> ModelConfig:
    return ModelConfig(**{**TINY, "position_scheme": "rope", "max_len": 256,
                          "attention_backend": backend, **changes})


@pytest.mark.parametrize("mode", ["lm", "seq2seq"])
def test_models_with_splash_equal_the_reference(mode):
    """Logits at real tokens and every parameter gradient: a packed LM with a local window,
    an encoder-decoder with padded source and target."""
    changes = dict(num_encoder_layers=0, local_window=11) if mode == "lm" else {}
    assert_model_matches_reference(
        "splash", mode, lambda backend: _model_config(backend, **changes))


def test_cached_decoding_with_splash_equals_the_full_pass():
    """The full pass runs splash; cached steps (few queries against the cache) the reference."""
    assert_cached_decoding_matches_full_pass(_model_config("splash", num_encoder_layers=0))


def _lowered_lm_grad(backend: str, length: int, platform: str = "tpu") -> str:
    config = _model_config(backend, num_encoder_layers=0, dtype="bfloat16")
    return lowered_lm_grad(config, length, platform)


def test_the_tpu_program_is_a_mosaic_kernel_without_score_arrays():
    """Lowered for TPU (no libtpu needed), the train gradient calls the Mosaic kernel and holds
    no [.., T, T] array; the reference's program does (so the check can fail)."""
    length = 256
    square = re.compile(rf"x{length}x{length}x")
    splash_text = _lowered_lm_grad("splash", length)
    assert "tpu_custom_call" in splash_text
    assert not square.search(splash_text)
    assert square.search(_lowered_lm_grad("reference", length))
    assert "tpu_custom_call" not in _lowered_lm_grad("splash", length, "cpu")  # interpreted


@pytest.mark.parametrize("changes, read, refused", [
    ({}, {"2x4x4x256", "2x2x4x256"}, {"2x4x256x4", "2x2x256x4"}),  # 4 wide: [b, h, hd, T]
    (dict(d_model=256, num_heads=2, num_kv_heads=2, d_ff=64),  # 128 wide: [b, h, T, hd]
     {"2x2x256x128"}, {"2x2x128x256"}),
])
def test_heads_narrower_than_a_lane_tile_reach_the_kernel_sequence_minor(changes, read, refused):
    """TPU pads an array's last axis to 128 lanes: a 4-wide query, key and value go to every
    kernel call (the forward pass and both backward kernels) as [b, heads, head_dim, T], never
    [.., T, 4]; 128-wide heads stay head-minor. (Query [2, 4 heads, ..], key and value
    [2, 2 kv heads, ..]; the output's gradient stays [b, heads, T, head_dim], so the tiny
    model's refused query type is not checked.)"""
    config = _model_config("splash", num_encoder_layers=0, dtype="bfloat16", **changes)
    operands = kernel_operands(lowered_lm_grad(config, 256, "tpu"), "tpu_custom_call")
    assert {f"tensor<{shape}xbf16>" for shape in read} <= operands, operands
    kv_refused = {f"tensor<{shape}xbf16>" for shape in refused} - {"tensor<2x4x256x4xbf16>"}
    assert not kv_refused & operands, operands


def test_under_a_mesh_each_device_runs_its_rows_and_heads():
    """With a data x tensor mesh set, the kernel runs under shard_map (batch over data, heads
    over tensor, as the logical rules say): same values and gradients as the reference."""
    from tfm.parallel import sharding

    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, jax.devices()[:4])
    rng = np.random.default_rng(6)
    query = jnp.asarray(rng.normal(size=(4, 128, 4, 16)), jnp.float32)
    key, value = (jnp.asarray(rng.normal(size=(4, 128, 2, 16)), jnp.float32) for _ in "kv")
    ids = jnp.asarray(np.concatenate([segments("packed", 2, 128)] * 2))
    structure = AttentionStructure(True, None, ids, ids)
    mask = dense_mask(structure, 128, 128)
    real = np.asarray(ids) > 0
    probe = jnp.asarray(rng.normal(size=query.shape), jnp.float32) * real[:, :, None, None]

    def loss(backend, query, key, value):
        out = kernels.attention(query, key, value, backend=backend, mask=mask,
                                structure=structure)
        return jnp.sum(out * probe)

    want, want_grads = jax.value_and_grad(functools.partial(loss, "reference"), (0, 1, 2))(
        query, key, value)
    with sharding.sharding_context(mesh):
        grad = jax.jit(jax.value_and_grad(functools.partial(loss, "splash"), (0, 1, 2)))
        traced = grad.trace(query, key, value)
        got, got_grads = grad(query, key, value)
    assert "shard_map" in str(traced.jaxpr)
    np.testing.assert_allclose(got, want, rtol=2e-5)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, err_msg=name)


def test_under_a_mesh_a_batch_the_mesh_does_not_divide_stays_whole():
    """Parameter initialisation traces one row under the training mesh: the kernel keeps
    that dimension whole instead of failing shard_map's divisibility check."""
    from tfm.parallel import sharding

    mesh = sharding.make_mesh({"data": 4, "fsdp": 1, "tensor": 1}, jax.devices()[:4])
    query = jnp.asarray(np.random.default_rng(7).normal(size=(1, 128, 2, 16)), jnp.float32)
    structure = AttentionStructure(causal=True)
    want = kernels.attention(query, query, query, backend="reference",
                             mask=dense_mask(structure, 128, 128))
    with sharding.sharding_context(mesh):
        got = jax.jit(lambda q: kernels.attention(q, q, q, backend="splash",
                                                  structure=structure))(query)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_under_a_mesh_kv_heads_the_tensor_axis_cannot_split_stay_with_their_queries():
    """8 query heads over 4 tensor devices but 2 kv heads: splitting only the queries would
    pair each device's query heads with the wrong kv heads."""
    from tfm.parallel import sharding

    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "tensor": 4}, jax.devices()[:4])
    rng = np.random.default_rng(8)
    query = jnp.asarray(rng.normal(size=(1, 128, 8, 16)), jnp.float32)
    key, value = (jnp.asarray(rng.normal(size=(1, 128, 2, 16)), jnp.float32) for _ in "kv")
    structure = AttentionStructure(causal=True)
    want = kernels.attention(query, key, value, backend="reference",
                             mask=dense_mask(structure, 128, 128))
    with sharding.sharding_context(mesh):
        got = jax.jit(lambda q, k, v: kernels.attention(q, k, v, backend="splash",
                                                        structure=structure))(query, key, value)
    np.testing.assert_allclose(got, want, atol=2e-5)


def test_a_sharded_step_without_the_mesh_set_is_one_clear_error():
    """The user's own step: jax.jit(jax.value_and_grad(loss)) over a batch sharded with
    NamedSharding on 8 devices, attention_backend="auto" resolved for TPU (splash). Without the
    mesh set while tracing, the kernel would run unpartitioned (on TPU: "Mosaic kernels cannot
    be automatically partitioned", from inside Pallas): one error says what to add. Inside
    sharding_context the same step runs, each device its rows, with the reference's values."""
    import optax
    from jax.sharding import NamedSharding, PartitionSpec

    from tfm.kernels.per_device import MeshContextError
    from tfm.nn.models import DecoderLM
    from tfm.parallel import sharding

    config = ModelConfig(**{**TINY_LM, "num_decoder_layers": 1, "max_len": 256,
                            "position_scheme": "rope"}).for_platform("tpu")
    assert config.attention_backend == "splash"
    tokens = jnp.asarray(np.random.default_rng(9).integers(1, 13, (8, 129)), jnp.int32)
    params = DecoderLM(config).init(jax.random.key(0), tokens[:1, :-1])["params"]

    def loss(config, params, batch):
        logits = DecoderLM(config).apply({"params": params}, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    mesh = sharding.make_mesh({"data": 8, "fsdp": 1, "tensor": 1})
    batch = jax.device_put(tokens, NamedSharding(mesh, PartitionSpec("data")))
    step = jax.jit(jax.value_and_grad(functools.partial(loss, config)))
    with pytest.raises(MeshContextError, match=(
            r"^attention_backend='splash' runs a Pallas kernel on each device's share under "
            r"jax.shard_map, which needs the mesh set while tracing: its inputs live on 8 "
            r"devices \({'data': 8, 'fsdp': 1, 'context': 1, 'tensor': 1}\) but no mesh is set; "
            r"trace and call the jitted step inside "
            r"`with tfm.parallel.sharding.sharding_context\(mesh\):`"
            r".* or set attention_backend='reference'")):
        step(params, batch)
    with sharding.sharding_context(mesh):
        got, got_grads = step(params, batch)
    want, want_grads = jax.value_and_grad(functools.partial(
        loss, config.replace(attention_backend="reference")))(params, tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5)
