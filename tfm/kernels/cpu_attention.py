"""Attention on CPU: the reference maths (tfm.nn.attention) computed in query blocks, in the
layouts XLA's CPU matmuls read without copies, with a hand-written backward pass in 16 bits.

- Causal self-attention skips the key blocks after each block of CAUSAL_BLOCK queries (about
  half the work of the core at long lengths).
- Keys and values are head-major, [batch, kv_heads, len, head_dim] (keys [.., head_dim, len] in
  16 bits and in the KV cache, tfm/kernels/cpu_cache.py), so each matmul is a plain batched one.
- `attend_16bit`: all the query blocks of a bfloat16/float16 call under one custom VJP. With
  autodiff the float32-accumulated logits made every backward matmul float32 x float32, so a
  bf16 model never used the CPU's bf16 units. Here they take 16-bit operands in the layouts
  XLA's CPU bf16 kernels (YNNPACK) take (`cpu_dense.swap_minor` copies); the softmax backward
  uses delta = rowsum(dout * out) (as flash attention does), and the key and value gradients of
  all blocks are summed in float32. float32 keeps autodiff (`attend_block`).
benchmarks/README.md has what each of these bought.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tfm.kernels import cpu_dense, masks
from tfm.kernels.call import AttentionCall
from tfm.kernels.reference import (
    apply_keep,
    check_inputs,
    default_scale,
    dropout_keep,
    group_heads,
    masked_softmax,
)

# Causal attention skips the key blocks after each block of this many queries once q_len
# reaches twice this (64 beat 128 and 32 for the forward + backward pass at lengths 128-512).
CAUSAL_BLOCK = 64
# Longer queries use fewer, longer blocks: each block is its own matmuls in the compiled program,
# so this bounds compile time.
MAX_CAUSAL_BLOCKS = 8


def attention(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, kv_heads, head_dim]; cache_layout: [b, kv, hd, kv_len]
    value: jax.Array,  # [batch, kv_len, kv_heads, head_dim]; cache_layout: [b, kv, kv_len, hd]
    call: AttentionCall,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`tfm.nn.attention.dot_product_attention` on CPU, the same values: with `call.causal`
    the key blocks past each query block are skipped; with `call.cache_layout` keys and values
    come in the KV cache's layout (tfm/kernels/cpu_cache.py). The mask and bias are written
    out from the call's structure (tfm.kernels.masks)."""
    call = masks.dense_call(call, query, key.shape[3] if call.cache_layout else key.shape[1])
    bias, mask, scale = call.bias, call.mask, call.scale
    dropout_rate, dropout_rng = call.dropout_rate, call.dropout_rng
    return_weights, causal, cache_layout = call.return_weights, call.causal, call.cache_layout
    batch, q_len, num_heads, head_dim = jnp.shape(query)
    kv_len = None
    if cache_layout:
        num_kv_heads, kv_len = key.shape[1], key.shape[3]
        heads = (batch, num_kv_heads)
        expected_kv = (*heads, head_dim, kv_len), (*heads, kv_len, head_dim)
        if (tuple(key.shape), tuple(value.shape)) != expected_kv:
            raise ValueError(f"with cache_layout, query {tuple(query.shape)} needs key and value "
                             f"shaped {expected_kv}; got {tuple(key.shape)}, {tuple(value.shape)}")
    query, key, value, bias, mask = check_inputs(
        query, key, value, bias, mask, dropout_rate, dropout_rng, kv_len
    )
    if not cache_layout:
        kv_len, num_kv_heads = key.shape[1:3]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    scale = default_scale(head_dim) if scale is None else scale
    # Head-major layout for the two batched matmuls: [batch, kv_heads, groups, len, head_dim].
    groups = num_heads // num_kv_heads
    grouped_query = query.reshape(batch, q_len, num_kv_heads, groups, head_dim).transpose(
        0, 2, 3, 1, 4
    )
    # 16-bit compute: hand-written backward with 16-bit matmuls, keys [b, kv, head_dim, kv_len].
    sixteen_bit = jnp.dtype(query.dtype).itemsize < 4 and not return_weights
    key_axes = (0, 2, 3, 1) if sixteen_bit else (0, 2, 1, 3)
    key_major = key if cache_layout else key.transpose(key_axes)
    value_major = value if cache_layout else value.transpose(0, 2, 1, 3)
    blocks = causal_blocks(q_len, kv_len) if causal and not return_weights else [(0, q_len)]
    # Causal: queries [start, stop) see no key at or past `stop`.
    blocks = tuple((start, stop, stop if len(blocks) > 1 else kv_len) for start, stop in blocks)
    if sixteen_bit:
        out = attend_16bit(grouped_query, key_major, value_major, bias, mask, scale,
                           dropout_rate, dropout_rng, blocks)
    else:
        outs, all_weights = [], []
        for start, stop, kv_stop in blocks:
            out_block, weights = attend_block(
                grouped_query[:, :, :, start:stop],
                key_major[..., :kv_stop] if cache_layout else key_major[:, :, :kv_stop],
                value_major[:, :, :kv_stop],
                None if bias is None else rows_cols(bias, start, stop, kv_stop),
                None if mask is None else rows_cols(mask, start, stop, kv_stop),
                scale,
                dropout_rate,
                block_rng(dropout_rng, start),
                cache_layout,
            )
            outs.append(out_block)
            all_weights.append(weights)
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    # [batch, kv_heads, groups, q_len, head_dim] -> [batch, q_len, num_heads, head_dim]
    out = out.transpose(0, 3, 1, 2, 4).reshape(query.shape).astype(query.dtype)
    if return_weights:
        return out, all_weights[0].reshape(batch, num_heads, q_len, kv_len)
    return out


def causal_blocks(q_len: int, kv_len: int) -> list[tuple[int, int]]:
    """Query blocks [start, stop) for causal self-attention without a cache (q_len == kv_len)."""
    if q_len != kv_len or q_len < 2 * CAUSAL_BLOCK:
        return [(0, q_len)]
    size = max(CAUSAL_BLOCK, -(-q_len // MAX_CAUSAL_BLOCKS))
    size = -(-size // CAUSAL_BLOCK) * CAUSAL_BLOCK  # a multiple of CAUSAL_BLOCK
    return [(start, min(start + size, q_len)) for start in range(0, q_len, size)]


def attend_block(
    grouped_query: jax.Array,  # [batch, kv_heads, groups, q_len, head_dim]
    key: jax.Array,  # [batch, kv_heads, kv_len, head_dim], or [.., head_dim, kv_len] if transposed
    value: jax.Array,  # [batch, kv_heads, kv_len, head_dim]
    bias: jax.Array | None,  # broadcastable to [batch, num_heads, q_len, kv_len]
    mask: jax.Array | None,  # likewise, bool
    scale: float,
    dropout_rate: float,
    dropout_rng: jax.Array | None,
    keys_transposed: bool,
) -> tuple[jax.Array, jax.Array]:
    """softmax(q k^T * scale + bias) v for one block, differentiated by jax. Returns (out
    [batch, kv_heads, groups, q_len, head_dim] float32, weights [batch, kv_heads, groups, q_len,
    kv_len] float32, after dropout)."""
    out, weights, keep = _block_forward(
        grouped_query, key, value, bias, mask, dropout_rng, scale, dropout_rate, keys_transposed
    )
    return out, apply_keep(weights, keep, dropout_rate)


def rows_cols(array: jax.Array, start: int, stop: int, kv_stop: int) -> jax.Array:
    """Query rows [start, stop) and key columns [0, kv_stop) of a broadcastable
    [batch, heads, q_len, kv_len] mask or bias (size-1 dims stay)."""
    return array[:, :, _rows(array, start, stop), _cols(array, kv_stop)]


def _rows(array: jax.Array, start: int, stop: int) -> slice:
    return slice(start, stop) if array.shape[2] > 1 else slice(None)


def _cols(array: jax.Array, kv_stop: int) -> slice:
    return slice(0, kv_stop) if array.shape[3] > 1 else slice(None)


def block_rng(dropout_rng: jax.Array | None, start: int) -> jax.Array | None:
    """The dropout key of the query block starting at `start` (the call's own key for 0)."""
    return dropout_rng if dropout_rng is None or start == 0 else jax.random.fold_in(
        dropout_rng, start
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 8))
def attend_16bit(
    grouped_query: jax.Array,  # [batch, kv_heads, groups, q_len, head_dim] bf16 or f16
    keys_t: jax.Array,  # [batch, kv_heads, head_dim, kv_len], same dtype
    value: jax.Array,  # [batch, kv_heads, kv_len, head_dim], same dtype
    bias: jax.Array | None,  # float, broadcastable to [batch, num_heads, q_len, kv_len]
    mask: jax.Array | None,  # bool, likewise
    scale: float,
    dropout_rate: float,
    dropout_rng: jax.Array | None,
    blocks: tuple[tuple[int, int, int], ...],
) -> jax.Array:
    """`attend_block` over query blocks (start, stop, kv_stop): queries [start, stop) read keys
    [0, kv_stop), with dropout keys from `block_rng`. Keys come transposed; the backward pass is
    hand-written with 16-bit matmuls, its key and value gradients accumulated in float32.
    Returns out [batch, kv_heads, groups, q_len, head_dim] float32."""
    return _forward_16bit(
        grouped_query, keys_t, value, bias, mask, dropout_rng, scale, dropout_rate, blocks
    )[0]


def _block_forward(query, key, value, bias, mask, rng, scale, rate, keys_transposed=True):
    """One block: -> (out float32, weights before dropout float32, dropout keep mask | None)."""
    num_kv_heads = query.shape[1]
    spec = "bkgth,bkhs->bkgts" if keys_transposed else "bkgth,bksh->bkgts"
    logits = jnp.einsum(spec, query, key, preferred_element_type=jnp.float32)
    weights = masked_softmax(
        logits * jnp.float32(scale),
        group_heads(bias, num_kv_heads),
        group_heads(mask, num_kv_heads),
    )
    keep = None if rate == 0 else dropout_keep(rng, rate, weights.shape)
    out = jnp.einsum(
        "bkgts,bksh->bkgth", apply_keep(weights, keep, rate).astype(value.dtype), value,
        preferred_element_type=jnp.float32,
    )
    return out, weights, keep


def _forward_16bit(query, keys_t, value, bias, mask, rng, scale, rate, blocks):
    outs, all_weights = [], []
    for start, stop, kv_stop in blocks:
        out, weights, _ = _block_forward(
            query[:, :, :, start:stop], keys_t[..., :kv_stop], value[:, :, :kv_stop],
            None if bias is None else rows_cols(bias, start, stop, kv_stop),
            None if mask is None else rows_cols(mask, start, stop, kv_stop),
            block_rng(rng, start), scale, rate,
        )
        outs.append(out)
        all_weights.append(weights)
    return (outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)), all_weights


def _attend_16bit_fwd(query, keys_t, value, bias, mask, scale, rate, rng, blocks):
    out, all_weights = _forward_16bit(query, keys_t, value, bias, mask, rng, scale, rate, blocks)
    return out, (query, keys_t, value, bias, rng, out, all_weights)


def _attend_16bit_bwd(scale, rate, blocks, residuals, grad_out):
    query, keys_t, value, bias, rng, out, all_weights = residuals
    dtype = query.dtype
    batch, num_kv_heads, groups = query.shape[:3]
    # softmax backward: d logits = w * (d w - rowsum(d w * w)); rowsum(d w * w) equals
    # rowsum(d out * out) (out = dropped w . v), a reduction over head_dim, not kv_len.
    delta = jnp.sum(grad_out * out, axis=-1, keepdims=True)  # [b, k, g, q, 1]
    grad_out = grad_out.astype(dtype)
    values_t = cpu_dense.swap_minor(value)  # [b, k, head_dim, kv_len]
    keys = cpu_dense.swap_minor(keys_t)  # [b, k, kv_len, head_dim]

    def rows_first(array):  # [b, k, g, q, n] -> [b, k, g * q, n], rows contracted together
        return array.reshape(batch, num_kv_heads, -1, array.shape[-1])

    grad_query, grad_keys_t, grad_values_t = [], 0.0, 0.0
    grad_bias = None if bias is None else jnp.zeros(bias.shape, jnp.float32)
    for (start, stop, kv_stop), weights in zip(blocks, all_weights, strict=True):
        block_grad_out = grad_out[:, :, :, start:stop]
        grad_dropped = jnp.einsum(
            "bkgth,bkhs->bkgts", block_grad_out, values_t[..., :kv_stop],
            preferred_element_type=jnp.float32,
        )
        keep = None if rate == 0 else dropout_keep(block_rng(rng, start), rate, weights.shape)
        grad_logits = weights * (apply_keep(grad_dropped, keep, rate) - delta[:, :, :, start:stop])
        grad_scores = (grad_logits * jnp.float32(scale)).astype(dtype)
        grad_query.append(jnp.einsum(
            "bkgts,bksh->bkgth", grad_scores, keys[:, :, :kv_stop],
            preferred_element_type=jnp.float32,
        ))
        padding = ((0, 0), (0, 0), (0, 0), (0, keys_t.shape[-1] - kv_stop))
        grad_keys_t = grad_keys_t + jnp.pad(jnp.einsum(  # [b, k, head_dim, kv_stop]
            "bkhx,bkxs->bkhs", cpu_dense.swap_minor(rows_first(query[:, :, :, start:stop])),
            rows_first(grad_scores), preferred_element_type=jnp.float32,
        ), padding)
        grad_values_t = grad_values_t + jnp.pad(jnp.einsum(
            "bkhx,bkxs->bkhs", cpu_dense.swap_minor(rows_first(block_grad_out)),
            rows_first(apply_keep(weights, keep, rate).astype(dtype)),
            preferred_element_type=jnp.float32,
        ), padding)
        if bias is not None:
            block_bias = group_heads(rows_cols(bias, start, stop, kv_stop), num_kv_heads)
            sizes = zip(block_bias.shape, grad_logits.shape, strict=True)
            summed = tuple(axis for axis, (size, full) in enumerate(sizes) if size == 1 < full)
            block_grad = jnp.sum(grad_logits, axis=summed, keepdims=True)
            grad_bias = grad_bias.at[
                :, :, _rows(bias, start, stop), _cols(bias, kv_stop)
            ].add(block_grad.reshape(rows_cols(bias, start, stop, kv_stop).shape))
    grad_query = grad_query[0] if len(grad_query) == 1 else jnp.concatenate(grad_query, axis=3)
    # Behind a barrier, XLA cannot fold a later transpose into these matmuls (it would swap
    # their operands into a layout the bf16 kernels refuse, and the program fails at run time).
    grad_query, grad_keys_t, grad_values_t = jax.lax.optimization_barrier(
        (grad_query, grad_keys_t, grad_values_t)
    )
    return (
        grad_query.astype(dtype),
        grad_keys_t.astype(keys_t.dtype),
        jnp.swapaxes(grad_values_t, -1, -2).astype(value.dtype),
        None if bias is None else grad_bias.astype(bias.dtype),
        None,
        None,
    )


attend_16bit.defvjp(_attend_16bit_fwd, _attend_16bit_bwd)
