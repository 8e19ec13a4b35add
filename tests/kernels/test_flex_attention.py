"""Flex attention (tfm.kernels.flex_attention: the position bias and the mask computed per block
in a Pallas kernel) against the reference maths, run here in Pallas interpret mode: values and
every gradient (q, k, v, the T5 table, learned ALiBi slopes) with packing, padding, GQA,
windows, decoder-only and cross-attention, float32 and bfloat16; a per-row query offset;
whole models, cached decoding, a scheme added with only a block bias function, a mesh, and the
TPU program it lowers to."""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import (
    assert_cached_decoding_matches_full_pass,
    assert_model_matches_reference,
    block_bias,
    case_segments,
    dense_mask,
    kernel_operands,
    lowered_lm_grad,
    lowered_prefill,
    random_inputs,
    segments,
)
from tiny_model import TINY

from tfm import kernels
from tfm.kernels import flex_operands
from tfm.kernels.call import AttentionStructure, BlockBias
from tfm.kernels.reference import MODEL_AXES
from tfm.nn import attention, models
from tfm.nn import positions as P
from tfm.nn.config import ModelConfig


def _positions(ids: np.ndarray | None, batch: int, length: int) -> jax.Array:
    """Positions that restart at every packed segment (else 0..length-1)."""
    if ids is None:
        return jnp.broadcast_to(jnp.arange(length), (batch, length))
    starts = np.concatenate([np.ones((batch, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=1)
    index = np.broadcast_to(np.arange(length), (batch, length))
    return jnp.asarray(index - np.maximum.accumulate(np.where(starts, index, 0), axis=1))



CASES = {
    # name: (q_len, kv_len, heads, kv_heads, causal, window, segments, bias, dtype)
    "causal_gqa_t5_f32": (200, 200, 4, 2, True, None, "none", "t5", "float32"),
    "causal_packed_t5_bf16": (256, 256, 4, 2, True, None, "packed", "t5", "bfloat16"),
    "causal_window_packed_alibi": (150, 150, 2, 1, True, 9, "packed", "alibi", "float32"),
    "bidirectional_window_padded_t5": (130, 130, 4, 2, False, 20, "padding", "t5", "float32"),
    "bidirectional_padded_alibi_bf16": (300, 300, 4, 4, False, None, "padding", "alibi",
                                        "bfloat16"),
    "cross_padded_t5": (70, 260, 4, 2, False, None, "cross", "t5", "float32"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flex_equals_the_reference_forward_and_backward(case):
    _assert_case_matches_reference(case)


@pytest.mark.parametrize("case", ["causal_gqa_t5_f32", "bidirectional_padded_alibi_bf16"])
def test_heads_on_the_lanes_give_the_same_values(case, monkeypatch):
    """The kernel reading query, key and value as [.., T, head_dim] (Triton's layout, and
    Mosaic's for heads of whole 128-lane tiles), forced for these narrow heads: the cases
    above run them as [.., head_dim, T] in interpret mode, as Mosaic does."""
    monkeypatch.setattr(flex_operands, "sequence_minor", lambda compiler, head_dim: False)
    _assert_case_matches_reference(case)


def _assert_case_matches_reference(case: str) -> None:
    q_len, kv_len, heads, kv_heads, causal, window, segment_kind, bias_kind, dtype = CASES[case]
    rng = np.random.default_rng(1)
    batch = 2
    query, key, value = random_inputs(rng, q_len, kv_len, heads, kv_heads, dtype, batch)
    query_segments, key_segments = case_segments(segment_kind, batch, q_len, kv_len)
    packed = None if segment_kind != "packed" else np.asarray(query_segments)
    query_positions = _positions(packed, batch, q_len)
    key_positions = _positions(packed, batch, kv_len)
    function, params = block_bias(bias_kind, heads, causal, rng)
    mask = dense_mask(AttentionStructure(causal, window, query_segments, key_segments),
                      q_len, kv_len)
    real = np.ones((batch, q_len), bool) if query_segments is None or segment_kind == "cross" \
        else np.asarray(query_segments) > 0
    probe = jnp.asarray(rng.normal(size=query.shape), jnp.float32) * real[:, :, None, None]

    def loss(backend, query, key, value, params):
        by_blocks = BlockBias(function, params, query_positions, key_positions, learned=True)
        structure = AttentionStructure(causal, window, query_segments, key_segments, by_blocks)
        bias = P.dense_from_blocks(function, params, query_positions, key_positions)
        out = kernels.attention(query, key, value, backend=backend, bias=bias, mask=mask,
                                causal=causal, structure=structure)
        return jnp.sum(out.astype(jnp.float32) * probe), out

    grad = jax.jit(jax.value_and_grad(loss, (1, 2, 3, 4), has_aux=True), static_argnums=0)
    (want, want_out), want_grads = grad("reference", query, key, value, params)
    (got, got_out), got_grads = grad("flex", query, key, value, params)
    tolerance = 2e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(got_out, np.float32)[real],
                               np.asarray(want_out, np.float32)[real], atol=tolerance)
    np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    for name, g, w in zip(["q", "k", "v", "bias parameters"], jax.tree.leaves(got_grads),
                          jax.tree.leaves(want_grads), strict=True):
        scale = float(jnp.abs(w.astype(jnp.float32)).max())
        assert scale > 0, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=tolerance * max(scale, 1.0), err_msg=name)
    # The bias matters here (so the equality is not vacuous): without it the output moves.
    unbiased = kernels.attention(query, key, value, backend="reference", mask=mask)
    assert float(jnp.abs(unbiased.astype(jnp.float32) - want_out.astype(jnp.float32))[
        real].max()) > 0.05


def test_fixed_bias_parameters_get_no_gradient_and_a_query_without_keys_reads_nothing():
    """ALiBi's slopes are constants (learned=False: zero gradient, no work); a query whose
    segment has no key gets a zero output and zero gradient, as in the reference."""
    rng = np.random.default_rng(2)
    query, key, value = (jnp.asarray(rng.normal(size=(1, 128, 2, 16)), jnp.float32)
                         for _ in "qkv")
    positions = jnp.broadcast_to(jnp.arange(128), (1, 128))
    query_segments = jnp.asarray(np.r_[np.ones(100), np.full(28, 7)][None], jnp.int32)
    key_segments = jnp.asarray(np.r_[np.ones(100), np.zeros(28)][None], jnp.int32)
    slopes = (jnp.asarray(P.alibi_slopes(2))[:, None],)

    def out(query, slopes):
        structure = AttentionStructure(True, None, query_segments, key_segments, BlockBias(
            P.alibi_block_bias, slopes, positions, positions, learned=False))
        return kernels.attention(query, key, value, backend="flex", structure=structure)

    result = out(query, slopes)
    assert float(jnp.abs(result[:, 100:]).max()) == 0.0
    query_grad, slopes_grad = jax.grad(lambda q, s: jnp.sum(out(q, s)), (0, 1))(query, slopes)
    assert float(jnp.abs(query_grad[:, 100:]).max()) == 0.0
    assert float(jnp.abs(query_grad[:, :100]).max()) > 0
    assert float(jnp.abs(slopes_grad[0]).max()) == 0.0


def test_a_query_offset_places_each_rows_queries_among_the_keys():
    """attend_local with a per-row query offset (context parallelism's contiguous runs of
    queries): query i of row b is key index i + offset[b] (200 and 0) for the causal mask and
    a window of 150, 384 queries against 640 keys in 128-blocks, so the key blocks before and
    after each query block's reach, and the query blocks before and after each key block's,
    are skipped by the offset index; values and the gradients of q, k, v and learned ALiBi
    slopes equal the reference on the mask of those indices."""
    rng = np.random.default_rng(3)
    q_len, kv_len, heads, window, batch = 384, 640, 2, 150, 2
    offsets = jnp.asarray([200, 0], jnp.int32)
    query, key, value = random_inputs(rng, q_len, kv_len, heads, 1, "float32", batch)
    query_positions = offsets[:, None] + jnp.arange(q_len, dtype=jnp.int32)
    key_positions = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (batch, kv_len))
    function, params = block_bias("alibi", heads, True, rng)
    mask = attention.combine_masks(  # from the indices, with the reference's mask functions
        attention.causal_mask(query_positions, key_positions),
        attention.local_window_mask(query_positions, key_positions, window))
    probe = jnp.asarray(rng.normal(size=query.shape), jnp.float32)
    segments = (jnp.zeros((batch, q_len), jnp.int32), jnp.zeros((batch, kv_len), jnp.int32))

    def loss(use_flex, query, key, value, params):
        if use_flex:
            out = kernels.flex_attention.attend_local(
                query, key, value, (query_positions, key_positions, *segments), params,
                causal=True, window=window, scale=16**-0.5, function=function, learned=True,
                compiler="interpret", query_offset=offsets)
        else:
            bias = P.dense_from_blocks(function, params, query_positions, key_positions)
            out = kernels.attention(query, key, value, backend="reference", bias=bias,
                                    mask=mask)
        return jnp.sum(out * probe), out

    grad = jax.jit(jax.value_and_grad(loss, (1, 2, 3, 4), has_aux=True), static_argnums=0)
    (_, want), want_grads = grad(False, query, key, value, params)
    (_, got), got_grads = grad(True, query, key, value, params)
    np.testing.assert_allclose(got, want, atol=2e-5)
    for name, g, w in zip(["q", "k", "v", "slopes"], jax.tree.leaves(got_grads),
                          jax.tree.leaves(want_grads), strict=True):
        scale = float(jnp.abs(w).max())
        np.testing.assert_allclose(g / scale, w / scale, atol=2e-5, err_msg=name)


def _model_config(backend: str, **changes) -> ModelConfig:
    return ModelConfig(**{**TINY, "max_len": 256, "attention_backend": backend, **changes})


@pytest.mark.parametrize("mode,scheme", [("lm", "t5_bias"), ("seq2seq", "alibi"),
                                         ("seq2seq", "t5_bias")])
def test_models_with_flex_equal_the_reference(mode, scheme):
    """Logits at real tokens and every parameter gradient (the T5 tables' included): a packed
    LM with a local window and per-layer T5 tables, encoder-decoders with padded rows (the
    encoder's bias bidirectional, the decoder's causal)."""
    changes = dict(position_scheme=scheme)
    if mode == "lm":
        changes.update(num_encoder_layers=0, local_window=11, t5_shared_across_layers=False)
    paths = assert_model_matches_reference(
        "flex", mode, lambda backend: _model_config(backend, **changes))
    assert (scheme == "t5_bias") == any("t5_bias_table" in path for path in paths)


@pytest.mark.parametrize("window", [None, 5])
def test_cached_decoding_with_flex_equals_the_full_pass(window):
    """The full pass and a prefill that fills its cache run the kernel; cached steps (few
    queries against the cache) the reference, with the same T5 bias (and window)."""
    assert_cached_decoding_matches_full_pass(
        _model_config("flex", num_encoder_layers=0, position_scheme="t5_bias",
                      local_window=window))


def test_a_prefill_that_fills_its_cache_holds_no_square_array_on_tpu():
    """Lowered for TPU: a 256-token prefill into a cache of 256 slots calls the Pallas kernel
    and holds no [.., T, T] array (bias, mask or scores); into a cache with room to spare it
    reads the cache through the kernel too, with the rows' query offset (a chunk of at least
    one block: tests/decode/test_prefill.py), where the reference writes [T, slots] arrays (so
    the check can fail)."""
    length = 256
    square = re.compile(rf"x{length}x{length}x")
    changes = dict(num_encoder_layers=0, position_scheme="t5_bias", dtype="bfloat16",
                   max_len=2 * length)
    config = _model_config("flex", **changes)
    filled = lowered_prefill(config, length, length, "tpu")
    assert "tpu_custom_call" in filled and not square.search(filled)
    spare = re.compile(rf"x{length}x{length + 8}x")
    reading = lowered_prefill(config, length, length + 8, "tpu")
    assert not spare.search(reading)
    # It reads the cache's keys and values (264 slots, padded to 384) sequence-minor, the
    # order TPU's cache stores them in (tfm/kernels/tpu_cache.py).
    operands = kernel_operands(reading, "tpu_custom_call")
    assert "tensor<2x2x4x384xbf16>" in operands and "tensor<2x2x384x4xbf16>" not in operands
    reference = lowered_prefill(_model_config("reference", **changes), length, length + 8, "tpu")
    assert spare.search(reference)


def test_a_prefill_hands_the_kernel_its_keys_and_values_in_the_caches_order_on_tpu():
    """Lowered for TPU: TPU's cache stores narrow heads with their slots on the lanes, [batch,
    kv_heads, head_dim, slots], and a prefill that fills it hands flex (no gradient) its keys
    and values in that order, read back from the cache (CacheLayout.prefill_reads_back), so
    XLA can keep one array for the write and the kernel. Reading them head-minor [.., slots,
    head_dim] took a transposed copy per layer (its decode loop 1.81 -> 2.04 GB, v5e-8)."""
    length = 256
    config = _model_config("flex", num_encoder_layers=0, position_scheme="alibi",
                           dtype="bfloat16", max_len=length, cache_layout="tpu")
    filled = lowered_prefill(config, length, length, "tpu")
    stored = f"tensor<2x2x4x{length}xbf16>"  # [batch, kv_heads, head_dim, slots]
    signature = filled.split("func.func public @main(")[1].split(") -> (")[0]
    assert signature.count(stored) == 2 * config.num_decoder_layers, signature
    operands = kernel_operands(filled, "tpu_custom_call")
    assert stored in operands and f"tensor<2x2x{length}x4xbf16>" not in operands, operands


def _log_distance_block_bias(head_params, query_positions, key_positions):
    """-slope_h * log(1 + |k - q|): a scheme the kernel has never seen."""
    (slope,) = head_params
    distance = jnp.abs(key_positions - query_positions).astype(jnp.float32)
    return -slope * jnp.log1p(distance)


def _log_distance(config, bidirectional, param):
    slopes = param("log_distance_slope", (config.num_heads, 1), 1.0, ("heads", None))
    return _log_distance_block_bias, (slopes,)


def test_a_scheme_with_a_new_bias_is_one_block_function(monkeypatch):
    """Registering a scheme with only a block_bias hook gives it a dense bias for the
    reference (dense_from_blocks) and the fused kernel without a kernel change: both give the
    same logits and slope gradients, and the slopes change the logits."""
    entry = P.PositionScheme("log_distance", "bias", "learned log-distance slopes",
                             block_bias=_log_distance, logit_bias_kind="learned")
    monkeypatch.setitem(P.SCHEMES, "log_distance", entry)
    tokens = jnp.asarray(np.random.default_rng(5).integers(1, 13, (2, 130)), jnp.int32)
    model_for = lambda backend: models.DecoderLM(_model_config(
        backend, num_encoder_layers=0, position_scheme="log_distance"))
    params = {"params": nn.unbox(model_for("reference").init(jax.random.key(0), tokens)["params"])}
    slopes = params["params"]["decoder"]["position_bias"]["log_distance_slope"]
    assert slopes.shape == (TINY["num_heads"], 1)
    loss = lambda params, backend: jnp.sum(jnp.sin(model_for(backend).apply(params, tokens)))
    grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
    want, want_grads = grad(params, "reference")
    got, got_grads = grad(params, "flex")
    np.testing.assert_allclose(got, want, rtol=1e-5)
    slope_grad = lambda grads: grads["params"]["decoder"]["position_bias"]["log_distance_slope"]
    np.testing.assert_allclose(slope_grad(got_grads), slope_grad(want_grads), rtol=1e-4,
                               atol=1e-6)
    assert float(jnp.abs(slope_grad(want_grads)).max()) > 0


def _lowered_lm_grad(backend: str, length: int, scheme: str, platform: str) -> str:
    config = _model_config(backend, num_encoder_layers=0, dtype="bfloat16", max_len=length,
                           position_scheme=scheme)
    return lowered_lm_grad(config, length, platform)


@pytest.mark.parametrize("scheme,platform,kernel", [
    ("t5_bias", "tpu", "tpu_custom_call"), ("alibi", "tpu", "tpu_custom_call"),
    ("t5_bias", "cuda", "@__gpu$xla.gpu.triton"),
])
def test_the_accelerator_program_is_a_pallas_kernel_without_bias_or_score_arrays(
        scheme, platform, kernel):
    """Lowered for TPU (Mosaic) or a CUDA GPU (Triton), no device or plugin needed: the train
    gradient calls the kernels (forward, dq, dk/dv: in each of the 2 layers, or once in the
    shared body) and holds no [.., T, T] array (no bias, mask or scores); the reference's
    program does. The per-query log-sum-exp and delta are lane-dense rows [b, heads, 1, T],
    not [b, heads, T, 1] columns, whose one lane TPU tiles pad to 128."""
    length = 256
    square = re.compile(rf"x{length}x{length}x")
    flex_text = _lowered_lm_grad("flex", length, scheme, platform)
    assert flex_text.count(kernel) >= 3
    assert not square.search(flex_text)
    assert not re.search(rf"tensor<\d+x\d+x{length}x1xf32>", flex_text)
    assert re.search(rf"tensor<\d+x\d+x1x{length}xf32>", flex_text)
    assert square.search(_lowered_lm_grad("reference", length, scheme, platform))


@pytest.mark.parametrize("platform, changes, read, refused", [
    ("tpu", {}, {"2x4x4x256", "2x2x4x256"}, {"2x2x256x4"}),  # 4 wide: [b, h, hd, T]
    ("tpu", dict(d_model=256, num_heads=2, num_kv_heads=2, d_ff=64),  # 128 wide: [b, h, T, hd]
     {"2x2x256x128"}, {"2x2x128x256"}),
    ("cuda", {}, {"2x4x256x4", "2x2x256x4"}, {"2x2x4x256"}),  # Triton: [b, h, T, hd]
])
def test_heads_narrower_than_a_lane_tile_reach_the_tpu_kernel_sequence_minor(
        platform, changes, read, refused):
    """TPU pads an array's last axis to 128 lanes: in the train gradient lowered for TPU,
    every Mosaic call (forward, dq, dk/dv) reads a 4-wide query, key and value as
    [b, heads, head_dim, T], never [.., T, 4]; 128-wide heads and GPU's Triton calls keep the
    head on the lanes. (Query [2, 4 heads, ..], key and value [2, 2 kv heads, ..]; the
    output's gradient stays [b, heads, T, head_dim], so no query-shaped type is refused.)"""
    config = _model_config("flex", num_encoder_layers=0, dtype="bfloat16", max_len=256,
                           position_scheme="t5_bias", **changes)
    kernel = "tpu_custom_call" if platform == "tpu" else "@__gpu$xla.gpu.triton"
    operands = kernel_operands(lowered_lm_grad(config, 256, platform), kernel)
    assert {f"tensor<{shape}xbf16>" for shape in read} <= operands, operands
    assert not {f"tensor<{shape}xbf16>" for shape in refused} & operands, operands


def test_under_a_mesh_each_device_runs_its_rows_and_heads_with_their_bias_rows():
    """Data x tensor mesh: batch over data, heads (and their T5 table rows) over tensor;
    values and gradients, the table's included, equal the reference."""
    from tfm.parallel import sharding

    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, jax.devices()[:4])
    rng = np.random.default_rng(6)
    query = jnp.asarray(rng.normal(size=(4, 128, 4, 16)), jnp.float32)
    key, value = (jnp.asarray(rng.normal(size=(4, 128, 2, 16)), jnp.float32) for _ in "kv")
    ids = np.concatenate([segments("packed", 2, 128)] * 2)
    positions = _positions(ids, 4, 128)
    function, params = block_bias("t5", 4, True, rng)
    ids = jnp.asarray(ids)
    mask = dense_mask(AttentionStructure(True, None, ids, ids), 128, 128)
    real = np.asarray(ids) > 0
    probe = jnp.asarray(rng.normal(size=query.shape), jnp.float32) * real[:, :, None, None]

    def loss(backend, query, key, value, params):
        structure = AttentionStructure(True, None, ids, ids, BlockBias(
            function, params, positions, positions, learned=True))
        bias = P.dense_from_blocks(function, params, positions, positions)
        out = kernels.attention(query, key, value, backend=backend, bias=bias, mask=mask,
                                structure=structure)
        return jnp.sum(out * probe)

    want, want_grads = jax.value_and_grad(functools.partial(loss, "reference"), (0, 1, 2, 3))(
        query, key, value, params)
    with sharding.sharding_context(mesh):
        grad = jax.jit(jax.value_and_grad(functools.partial(loss, "flex"), (0, 1, 2, 3)))
        traced = grad.trace(query, key, value, params)
        got, got_grads = grad(query, key, value, params)
    assert "shard_map" in str(traced.jaxpr)
    np.testing.assert_allclose(got, want, rtol=2e-5)
    for name, g, w in zip(["q", "k", "v", "table"], jax.tree.leaves(got_grads),
                          jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, err_msg=name)


def test_a_prefill_chunk_reading_the_cache_runs_the_kernel_with_its_offset_under_a_mesh():
    """A chunk of 128 queries against a 320-slot KV cache (AttentionStructure.query_offset:
    rows at slots 192 and 64, the slots past each row's chunk unfilled, T5 bias from global
    positions) is flex's (per_device.chunk_of_cache), alone and under a data x tensor mesh (the
    offset split with the rows), with the reference's values; a decoding step's one query
    stays on the reference."""
    from tfm.kernels import flex_attention
    from tfm.parallel import sharding

    rng = np.random.default_rng(8)
    q_len, slots = 128, 320
    query, key, value = random_inputs(rng, q_len, slots, 4, 2, "float32", batch=4)
    offsets = jnp.asarray([192, 64, 192, 64], jnp.int32)
    key_positions = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (4, slots))
    function, params = block_bias("t5", 4, True, rng)
    structure = AttentionStructure(
        True, key_valid=key_positions < (offsets + q_len)[:, None], query_offset=offsets,
        bias=BlockBias(function, params, offsets[:, None] + jnp.arange(q_len), key_positions))
    def attend(backend, query):  # keys and values as the backend's cache stores them
        layout = kernels.BACKENDS[backend].cache
        order = [MODEL_AXES.index(axis) for axis in layout.key_axes], [
            MODEL_AXES.index(axis) for axis in layout.value_axes]
        return kernels.attention(query, key.transpose(order[0]), value.transpose(order[1]),
                                 backend=backend, structure=structure, cache_layout=True)

    call = kernels.AttentionCall(structure=structure, cache_layout=True)
    assert flex_attention.serves(call, q_len, slots) and not flex_attention.serves(call, 1, slots)
    assert kernels.BACKENDS["flex"].cache.key_axes != MODEL_AXES  # the kernel reads a copy
    want = attend("reference", query)
    np.testing.assert_allclose(attend("flex", query), want, atol=2e-5)
    mesh = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, jax.devices()[:4])
    with sharding.sharding_context(mesh):
        np.testing.assert_allclose(jax.jit(attend, static_argnums=0)("flex", query), want,
                                   atol=2e-5)


def test_sharded_inputs_without_the_mesh_set_are_one_clear_error():
    """Inputs on 8 devices, no mesh set while tracing: one error naming what to add, before
    any kernel is traced (tests/kernels/test_tpu_attention.py runs the whole step both ways)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from tfm.kernels.per_device import MeshContextError
    from tfm.parallel import sharding

    mesh = sharding.make_mesh({"data": 8, "fsdp": 1, "tensor": 1})
    query = jax.device_put(jnp.ones((8, 128, 2, 16), jnp.float32),
                           NamedSharding(mesh, PartitionSpec("data")))
    attend = jax.jit(lambda q: kernels.attention(q, q, q, backend="flex",
                                                 structure=AttentionStructure(causal=True)))
    with pytest.raises(MeshContextError, match=r"^attention_backend='flex' runs a Pallas kernel"
                       r".*sharding_context\(mesh\).* or set attention_backend='reference'"):
        attend(query)


def test_the_cost_estimate_counts_the_pairs_at_the_assumed_query_offset():
    # Context parallelism's offsets are traced: the estimate takes the devices' mean offset.
    # Without it, 8,192 causal queries at offset 0 against 131,072 keys counted 1/16 of the
    # work, and the compiled FLOPs of GPT-2 small at 131,072 tokens fell to a sixth of the
    # model's (a roofline MFU of 171%).
    from tfm.kernels import flex_attention as flex

    spec = functools.partial(
        flex._Spec, block_q=128, block_k=128, q_len=256, kv_len=1024, causal=True, window=None,
        scale=1.0, groups=1, function=None, learned=False, params_tree=None,
        precision=jax.lax.Precision.DEFAULT, compiler="mosaic", offset=True)
    assert spec().visible_pairs() == (1 + 2) * 128 * 128
    assert spec(cost_offset=512).visible_pairs() == (5 + 6) * 128 * 128
