"""The flex kernel's on-chip budget (tfm.kernels.flex_vmem) per chip, and its streamed path:
keys and values (and their rows) copied from HBM block by block when a head's whole keys would
not fit the chip's VMEM, forced here at small sizes with a zero budget and run in Pallas
interpret mode against the reference maths (values and the gradients of q, k, v and the bias
parameters), and lowered for TPU."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import block_bias, random_inputs

from tfm import kernels
from tfm.kernels import flex_attention, flex_operands, flex_vmem, hardware, per_device
from tfm.nn import attention
from tfm.nn import positions as P

MIB = 2**20


def test_the_budget_is_three_quarters_of_the_compiled_for_chips_vmem():
    # The v5p gives a kernel 64 MiB, half a v5e's: with the v5e's budget the GPT-2 medium
    # step at 131,072 tokens asked for 70 MiB and Mosaic refused it.
    assert flex_vmem.budget("mosaic", "TPU v5 lite") == 96 * MIB  # v5e
    assert flex_vmem.budget("mosaic", "TPU v5") == 48 * MIB  # v5p
    assert flex_vmem.budget("mosaic", "TPU v5p") == 48 * MIB
    assert flex_vmem.budget("mosaic", "TPU v6 lite") == 96 * MIB  # v6e
    assert flex_vmem.budget("mosaic", "TPU v4") == 12 * MIB
    assert flex_vmem.budget("mosaic", "TPU v9 unknown") == hardware.DEFAULT_VMEM_BYTES * 3 // 4
    assert flex_vmem.budget("interpret", "TPU v5") is None  # no on-chip limit off TPU
    assert flex_vmem.budget("triton", "NVIDIA H100 80GB HBM3") is None


def test_the_budget_follows_the_mesh_being_traced_for():
    mesh = jax.sharding.AbstractMesh((1,), ("data",), abstract_device=_abstract("TPU v5"))
    with jax.sharding.use_abstract_mesh(mesh):
        assert per_device.device_kind() == "TPU v5"
        assert flex_vmem.budget("mosaic") == 48 * MIB
    assert per_device.device_kind() == jax.devices()[0].device_kind


def _abstract(kind: str):
    from jax._src.mesh import AbstractDevice

    return AbstractDevice(device_kind=kind, num_cores=None, platform="tpu")


def test_whole_heads_stay_on_chip_while_they_fit_and_stream_after():
    v5e, v5p = flex_vmem.budget("mosaic", "TPU v5 lite"), flex_vmem.budget("mosaic", "TPU v5")
    bf16 = jnp.bfloat16
    assert flex_vmem.residency(v5e, 32768, 64, bf16) == "double"
    assert flex_vmem.residency(v5e, 131072, 64, bf16) == "single"  # 80 MiB + headroom of 96
    assert flex_vmem.residency(v5p, 32768, 64, bf16) == "double"  # 40 MiB of 48
    assert flex_vmem.residency(v5p, 65536, 64, bf16) == "single"
    assert flex_vmem.residency(v5p, 131072, 64, bf16) == "stream"
    assert flex_vmem.residency(None, 131072, 64, bf16) == "double"
    assert flex_vmem.call_limit(v5p, per_device.resident_bytes(131072, 64, bf16, 2)) == v5p
    assert flex_vmem.call_limit(v5e, 0) == 32 * MIB
    assert per_device.resident_bytes(131072, 64, bf16, 2, 1) == 131072 * 2 * (128 * 2 + 64)


# name: (q_len, kv_len, heads, kv_heads, causal, window, query offsets, bias, dtype)
CASES = {
    "causal_window_offset_gqa_alibi": (384, 640, 4, 2, True, 150, (200, 0), "alibi", "float32"),
    "causal_t5_bf16": (384, 384, 2, 1, True, None, None, "t5", "bfloat16"),
    "bidirectional_cross_padded_t5": (70, 300, 2, 2, False, None, None, "t5", "float32"),
}


def _pallas_calls(jaxpr) -> list:
    """The pallas_call equations of a jaxpr and of the jaxprs inside it, in order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            found.append(eqn)
            continue
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found.extend(_pallas_calls(inner))
    return found



@pytest.mark.parametrize("case, seq_minor", [(case, True) for case in CASES]
                         + [("causal_t5_bf16", False)])
def test_streamed_keys_give_the_references_values_and_gradients(case, seq_minor, monkeypatch):
    """Streamed blocks of [head_dim, T] (how Mosaic reads these narrow heads), and once of
    [T, head_dim] (its layout for heads of whole 128-lane tiles, forced here)."""
    if not seq_minor:
        monkeypatch.setattr(flex_operands, "sequence_minor", lambda compiler, head_dim: False)
    q_len, kv_len, heads, kv_heads, causal, window, offsets, bias, dtype = CASES[case]
    rng = np.random.default_rng(5)
    batch = 2
    query, key, value = random_inputs(rng, q_len, kv_len, heads, kv_heads, dtype, batch)
    offsets = None if offsets is None else jnp.asarray(offsets, jnp.int32)
    shift = jnp.zeros((batch,), jnp.int32) if offsets is None else offsets
    query_positions = shift[:, None] + jnp.arange(q_len, dtype=jnp.int32)
    key_positions = jnp.broadcast_to(jnp.arange(kv_len, dtype=jnp.int32), (batch, kv_len))
    key_real = np.arange(kv_len) < kv_len - 37  # padded keys: a segment no query has
    key_segments = jnp.asarray(np.where(key_real, 1, 0)[None].repeat(batch, 0), jnp.int32)
    query_segments = jnp.ones((batch, q_len), jnp.int32)
    function, params = block_bias(bias, heads, causal, rng)
    masks = [attention.segment_mask(query_segments, key_segments)]
    if causal:
        masks.append(attention.causal_mask(query_positions, key_positions))
    if window is not None:
        masks.append(attention.local_window_mask(query_positions, key_positions, window))
    mask = attention.combine_masks(*masks)
    probe = jnp.asarray(rng.normal(size=query.shape), jnp.float32)
    rows = (query_positions, key_positions, query_segments, key_segments)

    def flex(query, key, value, params, budget):
        return flex_attention.attend_local(
            query, key, value, rows, params, causal=causal, window=window,
            scale=16**-0.5, function=function, learned=True, compiler="interpret",
            query_offset=offsets, vmem_budget=budget)

    def loss(budget, query, key, value, params):
        if budget is None:
            bias_array = P.dense_from_blocks(function, params, query_positions, key_positions)
            out = kernels.attention(query, key, value, backend="reference", bias=bias_array,
                                    mask=mask, scale=16**-0.5)
        else:
            out = flex(query, key, value, params, budget)
        return jnp.sum(out.astype(jnp.float32) * probe), out

    grad = jax.jit(jax.value_and_grad(loss, (1, 2, 3, 4), has_aux=True), static_argnums=0)

    def kernels_of(budget):  # the jaxprs of the three kernels (forward, dq, dk/dv)
        program = jax.make_jaxpr(functools.partial(grad, budget))(query, key, value, params)
        return [str(eqn.params["jaxpr"]) for eqn in _pallas_calls(program.jaxpr)]

    # A zero budget streams every pass: each kernel copies its blocks by DMA.
    assert [("dma_start" in text) for text in kernels_of(0)] == [True] * 3
    assert [("dma_start" in text) for text in kernels_of(1 << 40)] == [False] * 3
    (_, want), want_grads = grad(None, query, key, value, params)
    (_, got), got_grads = grad(0, query, key, value, params)
    tolerance = 2e-5 if dtype == "float32" else 3e-2
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=tolerance)
    for name, g, w in zip(["q", "k", "v", "bias parameters"], jax.tree.leaves(got_grads),
                          jax.tree.leaves(want_grads), strict=True):
        scale = float(jnp.abs(w.astype(jnp.float32)).max())
        assert scale > 0, name
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                   atol=tolerance * max(scale, 1.0), err_msg=name)


@pytest.mark.parametrize("head_dim", [64, 128])  # read [.., head_dim, T] and [.., T, head_dim]
def test_the_streamed_kernel_lowers_for_tpu(head_dim):
    """Mosaic accepts the streamed program (HBM refs, DMA copies into double buffers): lowered
    for TPU without a device, forward and backward."""
    rng = np.random.default_rng(6)
    query, key, value = random_inputs(rng, 256, 1024, 2, 1, "bfloat16", 1, head_dim=head_dim)
    positions = jnp.arange(1024, dtype=jnp.int32)[None]
    rows = (positions[:, :256], positions, jnp.zeros((1, 256), jnp.int32),
            jnp.zeros((1, 1024), jnp.int32))
    slopes = (jnp.asarray(P.alibi_slopes(2), jnp.float32)[:, None],)

    def loss(query, key, value, slopes):
        out = flex_attention.attend_local(
            query, key, value, rows, slopes, causal=True, window=None, scale=0.125,
            function=P.alibi_block_bias, learned=True, compiler="mosaic",
            query_offset=jnp.asarray([512], jnp.int32), vmem_budget=0)
        return jnp.sum(out.astype(jnp.float32))

    lowered = jax.jit(jax.grad(loss, (0, 1, 2, 3))).trace(query, key, value, slopes).lower(
        lowering_platforms=("tpu",))
    text = lowered.as_text()
    assert text.count("tpu_custom_call") == 3  # forward, dq, dk/dv
