"""Query blocks against keys: the inner step of `attention.dot_product_attention`'s reference
backend (masked softmax weights, attention dropout, and the two matmuls).

Two versions of the same computation:
- `attend_block`: one block, plain einsums that jax differentiates (float32 compute, and any
  call that returns the weights).
- `attend_16bit`: all the query blocks of a call, the same forward with a hand-written backward
  pass, for bfloat16 and float16. With autodiff, the float32-accumulated logits made every
  backward matmul of the attention core float32 x float32, so a bf16 model never used the CPU's
  bf16 units there. Here the backward matmuls take 16-bit operands (accumulating in float32)
  in the layouts XLA's CPU bf16 kernels (YNNPACK) take: the left operand contracted on its
  minor axis, the right one on its major axis (`cpu_dense.swap_minor` copies); keys come transposed,
  [..., head_dim, kv_len]. The softmax backward uses delta = rowsum(dout * out) (as flash
  attention does) instead of a reduction over the logits, and the key and value gradients of
  all blocks are summed in float32. In an interleaved scratch A/B on a CPU with AVX512-BF16
  the bf16 char-GPT train step of benchmarks/vs_torch.py ran 1.33x faster with it than with
  autodiff (median of 7; benchmarks/README.md has the benchmark). float32 keeps autodiff: its
  compiled train step is the same program as before.

Layouts: queries [batch, kv_heads, groups, q_len, head_dim] (grouped-query heads; groups = 1 for
plain multi-head), values [batch, kv_heads, kv_len, head_dim]; bias (float) and mask (bool,
True = attend) broadcastable to [batch, num_heads, q_len, kv_len]. Outputs are float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from tfm.kernels import cpu_dense

# Finite, so a fully masked row never produces NaN; its weights are then set to zero, so it
# reads no key at all (not a uniform average over masked, possibly future, keys).
MASKED_LOGIT = -0.7 * float(np.finfo(np.float32).max)


def _grouped(array: jax.Array, num_kv_heads: int, groups: int) -> jax.Array:
    """[b|1, num_heads|1, q, k] -> [b|1, kv_heads|1, groups|1, q, k]."""
    if array.shape[1] == 1:
        return array[:, :, None]
    return array.reshape(array.shape[0], num_kv_heads, groups, *array.shape[2:])


def _softmax_weights(
    logits: jax.Array,  # [batch, kv_heads, groups, q_len, kv_len] float32, scaled
    bias: jax.Array | None,  # grouped, broadcastable to logits
    mask: jax.Array | None,  # grouped bool, likewise
) -> jax.Array:
    """softmax(logits + bias) over kv_len with masked keys left out; a query with no visible
    key gets all-zero weights (it reads nothing)."""
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    weights = jax.nn.softmax(
        logits if mask is None else jnp.where(mask, logits, MASKED_LOGIT), axis=-1
    )
    if mask is not None:
        weights = jnp.where(jnp.any(mask, axis=-1, keepdims=True), weights, 0.0)
    return weights


def _dropout_keep(rng: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    """bool [*shape]: which attention weights survive inverted dropout at `rate`."""
    return jax.random.bernoulli(rng, 1.0 - rate, shape)


def _dropped(weights: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    return weights if keep is None else jnp.where(keep, weights / (1.0 - rate), 0.0)


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
    return out, _dropped(weights, keep, dropout_rate)


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
    num_kv_heads, groups = query.shape[1:3]
    spec = "bkgth,bkhs->bkgts" if keys_transposed else "bkgth,bksh->bkgts"
    logits = jnp.einsum(spec, query, key, preferred_element_type=jnp.float32)
    weights = _softmax_weights(
        logits * jnp.float32(scale),
        None if bias is None else _grouped(bias, num_kv_heads, groups),
        None if mask is None else _grouped(mask, num_kv_heads, groups),
    )
    keep = None if rate == 0 else _dropout_keep(rng, rate, weights.shape)
    out = jnp.einsum(
        "bkgts,bksh->bkgth", _dropped(weights, keep, rate).astype(value.dtype), value,
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
        keep = None if rate == 0 else _dropout_keep(block_rng(rng, start), rate, weights.shape)
        grad_logits = weights * (_dropped(grad_dropped, keep, rate) - delta[:, :, :, start:stop])
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
            rows_first(_dropped(weights, keep, rate).astype(dtype)),
            preferred_element_type=jnp.float32,
        ), padding)
        if bias is not None:
            block_bias = _grouped(rows_cols(bias, start, stop, kv_stop), num_kv_heads, groups)
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
