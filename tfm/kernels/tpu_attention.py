"""Attention on TPU by Pallas splash attention (jax.experimental.pallas.ops.tpu): flash
attention whose mask is built per block from its parts (causal, local window, packed segments,
padding), so no [batch, heads, q_len, kv_len] score or mask reaches HBM, and blocks the mask
removes are skipped. Same values as the reference (tfm.nn.attention) at every real query.

It serves calls that describe their mask (`AttentionCall.structure`) and read no KV cache;
a prefill chunk against the cache goes to flex (its causal mask starts at a traced per-row
offset), cached decoding steps (a few queries) to the reference maths, whose score rows are
small. No logit bias (ALiBi, T5, Shaw), no dropout, no returned weights.
Off TPU it runs in Pallas interpret mode (slow; for tests). Mosaic refuses float32 contract
precision on 16-bit operands, so a process that sets jax_default_matmul_precision="highest"
cannot compile it for TPU with bfloat16 activations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from tfm.checks import ConfigError
from tfm.kernels import flex_attention, masks, per_device, reference
from tfm.kernels.call import AttentionCall


def serves(call: AttentionCall, q_len: int, kv_len: int) -> bool:
    """Whether splash attention computes this call (else the reference does)."""
    return per_device.described_by_parts(call, q_len, kv_len)


def attention(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim]; call.cache_layout: TPU_LAYOUT's
    value: jax.Array,  # like key
    call: AttentionCall,
) -> jax.Array:  # [batch, q_len, num_heads, head_dim]
    """The reference's softmax(Q K^T * scale) V by splash attention, under shard_map when a
    multi-device mesh is set (jax.set_mesh; tfm.kernels.per_device)."""
    structure = call.structure
    if call.bias is not None or (structure is not None and (
            structure.bias is not None or structure.relative is not None)):
        raise ConfigError("attention_backend='splash' takes no logit bias (ALiBi, T5, Shaw); "
                          "use 'auto' or 'reference'")
    if call.dropout_rate > 0 or call.return_weights:
        raise ConfigError("attention_backend='splash' has no attention dropout and returns no "
                          "weights; use 'reference'")
    if call.cache_layout or per_device.chunk_of_cache(call, query.shape[1], key.shape[1]):
        # A KV cache read: a prefill chunk's causal mask starts at each row's traced cache
        # offset, and splash's masks are static: flex (with no bias) takes the offset, and
        # reads TPU_LAYOUT (the reference's einsums for fewer queries than a block).
        return flex_attention.attention(query, key, value, call)
    if not serves(call, query.shape[1], key.shape[1]):
        return masks.reference_attention(query, key, value, call)
    query, key, value, _, _ = reference.check_inputs(query, key, value, None, None, 0.0, None)
    scale = reference.default_scale(query.shape[-1]) if call.scale is None else call.scale
    segments = masks.block_segments(structure, query.shape[1], per_device.PADDING_KEY_SEGMENT)
    local = functools.partial(_attend_local, causal=structure.causal, window=structure.window,
                              scale=scale)
    return per_device.run(local, query, key, value, segments,
                          backend="attention_backend='splash'")


def operand_layout(head_dim: int) -> splash.QKVLayout:
    """How the kernel reads the query, key and value. TPU stores an array's last axis in
    128-lane tiles, so heads-major [.., T, head_dim] operands with head_dim 64 (GPT-2's, the
    paper's) take twice their size in HBM, and so do the copies the backward pass keeps.
    With the sequence on the lanes (SEQ_MINOR: the kernel reads [.., head_dim, T]) nothing is
    padded; XLA stores the heads-major arrays that way, so the transpose costs no copy.
    A head_dim that fills whole tiles (128, 256) keeps the head on the lanes, which moves
    fewer bytes there (GPT-2 small with 6 heads of 128: 32.2 against 34.3 GB, v5e-8)."""
    if head_dim % per_device.LANES:
        return splash.QKVLayout.SEQ_MINOR
    return splash.QKVLayout.HEAD_DIM_MINOR


def _static_mask(
    num_heads: int, q_len: int, kv_len: int, causal: bool, window: int | None
) -> splash_mask.MultiHeadMask:
    """The mask's static part (causal, window), the same for every head."""
    shape = (q_len, kv_len)
    if window is not None:
        head_mask = splash_mask.LocalMask(shape, (window, 0 if causal else window), offset=0)
    elif causal:
        head_mask = splash_mask.CausalMask(shape)
    else:
        head_mask = splash_mask.FullMask(shape)
    return splash_mask.MultiHeadMask([head_mask] * num_heads)


def _padded_segments(
    segments: tuple[jax.Array, jax.Array] | None,  # ([batch, q_len], [batch, kv_len]) int
    batch: int, q_len: int, kv_len: int, q_padded: int, kv_padded: int,
) -> tuple[jax.Array, jax.Array] | None:
    """Segment ids for the padded lengths: padded keys get a segment no query has. (A row
    left with no key is harmless: splash's mask value is finite, so it averages, never NaN.)"""
    if segments is None and kv_padded == kv_len:
        return None
    if segments is None:
        segments = (jnp.zeros((batch, q_len), jnp.int32), jnp.zeros((batch, kv_len), jnp.int32))
    query_segments, key_segments = (ids.astype(jnp.int32) for ids in segments)
    query_segments = jnp.pad(query_segments, ((0, 0), (0, q_padded - q_len)))
    key_segments = jnp.pad(key_segments, ((0, 0), (0, kv_padded - kv_len)),
                           constant_values=per_device.PADDING_KEY_SEGMENT)
    return query_segments, key_segments


def _attend_local(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim], this device's rows and heads
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    segments: tuple[jax.Array, jax.Array] | None,  # ([batch, q_len], [batch, kv_len]) int
    heads: None = None,
    *, causal: bool, window: int | None, scale: float, compiler: str | None,
) -> jax.Array:  # [batch, q_len, num_heads, head_dim]
    """Splash attention over local arrays: lengths padded to whole 128-lane blocks, one
    kernel call per batch row (vmap)."""
    batch, q_len, num_heads, _ = query.shape
    kv_len = key.shape[1]
    q_padded, kv_padded = per_device.round_up(q_len), per_device.round_up(kv_len)
    segments = _padded_segments(segments, batch, q_len, kv_len, q_padded, kv_padded)

    def heads_major(x: jax.Array, padded: int) -> jax.Array:  # -> [batch, heads, padded, hd]
        x = jnp.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0), (0, 0)))
        return x.transpose(0, 2, 1, 3)

    # Splash takes pre-scaled queries (Q K^T * scale = (Q * scale) K^T).
    scaled = (query.astype(jnp.float32) * scale).astype(query.dtype)
    block_q, block_kv = per_device.block_size(q_padded), per_device.block_size(kv_padded)
    layout = operand_layout(query.shape[-1])
    sizes = splash.BlockSizes(
        block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
        block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
        block_q_dq=block_q, block_kv_dq=block_kv,
        q_layout=layout, k_layout=layout, v_layout=layout,
    )
    mask = _static_mask(num_heads, q_padded, kv_padded, causal, window)

    def run(args, segments, *, compiler: str):  # a Mosaic kernel: interpreted off TPU
        kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                        interpret=compiler != "mosaic")
        if segments is None:
            return jax.vmap(kernel)(*args)
        return jax.vmap(lambda q, k, v, q_ids, kv_ids: kernel(
            q, k, v, segment_ids=splash.SegmentIds(q_ids, kv_ids)))(*args, *segments)

    args = (heads_major(scaled, q_padded), heads_major(key, kv_padded),
            heads_major(value, kv_padded))
    out = per_device.by_platform(run, compiler, args, segments)
    return out.transpose(0, 2, 1, 3)[:, :q_len].astype(query.dtype)

