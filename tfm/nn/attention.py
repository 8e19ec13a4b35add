"""Scaled dot-product attention (Vaswani et al. 2017, eq. 1) and the masks that feed it.

Pure functions, layout [batch, length, heads, head_dim]. Three backends compute the same thing:
"reference" (plain einsums; the only one with attention dropout and returned weights), "xla"
(`jax.nn.dot_product_attention`, implementation="xla") and "cudnn" (cuDNN flash attention, GPU).
Masks are bool, True = may attend, shaped [batch, 1, q_len, kv_len] (or broadcastable to it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tfm.checks import ConfigError
from tfm.kernels import cpu_attention
from tfm.nn.config import ATTENTION_BACKENDS

_CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
_CUDNN_MAX_HEAD_DIM = 256  # Hopper and later; jax itself refuses > 128 on older GPUs.


def _check_broadcastable(name: str, array: jax.Array, expected: tuple[int, ...]) -> None:
    shape = tuple(array.shape)
    if len(shape) != 4 or any(d not in (1, e) for d, e in zip(shape, expected, strict=True)):
        raise ValueError(
            f"{name} has shape {shape}; expected rank 4 broadcastable to "
            f"[batch, num_heads, q_len, kv_len] = {list(expected)} (each dim 1 or equal)"
        )


def _check_backend(
    backend: str, query: jax.Array, bias: jax.Array | None, return_weights: bool,
    dropout_rate: float, kv_len: int,
) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(
            f"attention_backend={backend!r} is unknown; "
            f"choose one of: {', '.join(ATTENTION_BACKENDS)}"
        )
    if backend == "reference":
        return
    if return_weights:
        raise ConfigError(
            f"attention_backend={backend!r} cannot return attention weights (fused kernels never "
            "materialise them); use attention_backend='reference'"
        )
    if dropout_rate > 0:
        raise ConfigError(
            f"attention_backend={backend!r} has no attention dropout "
            f"(dropout_rate={dropout_rate}); set attention_dropout_rate=0 or use "
            "attention_backend='reference'"
        )
    if backend != "cudnn":
        return
    if query.dtype not in _CUDNN_DTYPES:
        raise ConfigError(
            f"attention_backend='cudnn' needs bfloat16 or float16 inputs (cuDNN flash attention), "
            f"got {query.dtype}; set dtype='bfloat16' or use attention_backend='xla'"
        )
    head_dim = query.shape[-1]
    if head_dim % 8 or head_dim > _CUDNN_MAX_HEAD_DIM:
        raise ConfigError(
            f"attention_backend='cudnn' needs head_dim a multiple of 8 and "
            f"<= {_CUDNN_MAX_HEAD_DIM}, got {head_dim}; use attention_backend='xla'"
        )
    if bias is not None and tuple(bias.shape[2:]) != (query.shape[1], kv_len):
        raise ConfigError(
            f"attention_backend='cudnn' needs bias of shape [1|batch, 1|num_heads, q_len, kv_len] "
            f"(no broadcasting over lengths), got {tuple(bias.shape)}; use attention_backend='xla'"
        )
    if jax.default_backend() != "gpu":
        raise ConfigError(
            f"attention_backend='cudnn' needs a GPU, but jax.default_backend() is "
            f"{jax.default_backend()!r}; use attention_backend='xla' or 'reference'"
        )


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    scale: float | None = None,
    backend: str = "reference",
    return_weights: bool = False,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    causal: bool = False,
    cache_layout: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """softmax(Q K^T * scale + bias) V, Vaswani et al. 2017 eq. (1), with grouped-query heads.

    query: [batch, q_len, num_heads, head_dim]
    key, value: [batch, kv_len, num_kv_heads, head_dim], num_heads % num_kv_heads == 0
      (GQA; query head n reads kv head n // (num_heads // num_kv_heads); 1 kv head is MQA).
    bias (additive float), mask (bool, True = attend): broadcastable to
      [batch, num_heads, q_len, kv_len].
    scale defaults to 1 / sqrt(head_dim). The softmax runs in float32; the output has query's dtype.
    A query whose keys are all masked gets a zero output (and zero gradient).
    dropout_rate > 0 drops attention weights (inverted dropout, needs dropout_rng).
    causal=True promises that query i never attends to key j > i (self-attention without a
    cache; the mask must still say so): the reference backend then skips the key blocks after
    each block of CAUSAL_BLOCK queries (longer blocks past MAX_CAUSAL_BLOCKS of them).
    cache_layout=True: key comes as [batch, num_kv_heads, head_dim, kv_len] and value as
    [batch, num_kv_heads, kv_len, head_dim] (tfm/nn/cache.py's layout, which the matmuls read
    without transposing).
    The reference backend in bfloat16 / float16 (without return_weights) computes each block
    with `cpu_attention.attend_16bit`: the same forward, a hand-written backward pass
    whose matmuls take 16-bit operands (autodiff made them float32).
    Returns out [batch, q_len, num_heads, head_dim], plus the (post-dropout) weights
    [batch, num_heads, q_len, kv_len] float32 when return_weights.
    """
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    for name, array in (("query", query), ("key", key), ("value", value)):
        if array.ndim != 4:
            raise ValueError(f"{name} must be rank 4 [batch, length, heads, head_dim], "
                             f"got shape {tuple(array.shape)}")
    batch, q_len, num_heads, head_dim = query.shape
    if cache_layout:
        num_kv_heads, kv_len = key.shape[1], key.shape[3]
        heads = (batch, num_kv_heads)
        expected_kv = (*heads, head_dim, kv_len), (*heads, kv_len, head_dim)
        if (tuple(key.shape), tuple(value.shape)) != expected_kv:
            raise ValueError(f"with cache_layout, query {tuple(query.shape)} needs key and value "
                             f"shaped {expected_kv}; got {tuple(key.shape)}, {tuple(value.shape)}")
    else:
        if key.shape != value.shape:
            raise ValueError(f"key and value shapes must match, got {key.shape} and {value.shape}")
        _, kv_len, num_kv_heads, _ = key.shape
        if key.shape[0] != batch or key.shape[3] != head_dim:
            raise ValueError(f"query {query.shape} and key {key.shape} must share batch and "
                             "head_dim")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"query, key and value must share a dtype, got "
                         f"{query.dtype}, {key.dtype}, {value.dtype}")
    expected = (batch, num_heads, q_len, kv_len)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:
            raise ValueError(f"mask must be bool (True = attend), got {mask.dtype}; "
                             "pass additive masks as bias")
        _check_broadcastable("mask", mask, expected)
    if bias is not None:
        bias = jnp.asarray(bias)
        _check_broadcastable("bias", bias, expected)
    if not 0.0 <= dropout_rate < 1.0:
        raise ValueError(f"dropout_rate={dropout_rate} must be in [0, 1)")
    if dropout_rate > 0 and dropout_rng is None:
        raise ValueError(f"dropout_rate={dropout_rate} > 0 needs a dropout_rng")
    _check_backend(backend, query, bias, return_weights, dropout_rate, kv_len)
    scale = 1.0 / np.sqrt(head_dim) if scale is None else scale

    if backend in ("xla", "cudnn"):
        if cache_layout:
            key, value = key.transpose(0, 3, 1, 2), value.transpose(0, 2, 1, 3)
        if backend == "cudnn":
            # jax folds the mask into a bias in the query dtype, and cuDNN wants full
            # [q_len, kv_len] bias dims. A bias gradient needs bias shape [1, num_heads, ...].
            if mask is not None:
                mask = jnp.broadcast_to(mask, mask.shape[:2] + (q_len, kv_len))
            if bias is not None:
                bias = bias.astype(query.dtype)
        out = jax.nn.dot_product_attention(
            query, key, value, bias=bias, mask=mask, scale=scale, implementation=backend
        )
        if mask is None:
            return out
        attends = jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None]  # [batch, q_len, 1|h, 1]
        return jnp.where(attends, out, jnp.zeros((), out.dtype))

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
    blocks = _causal_blocks(q_len, kv_len) if causal and not return_weights else [(0, q_len)]
    # Causal: queries [start, stop) see no key at or past `stop`.
    blocks = tuple((start, stop, stop if len(blocks) > 1 else kv_len) for start, stop in blocks)
    if sixteen_bit:
        outs = [cpu_attention.attend_16bit(
            grouped_query, key_major, value_major, bias, mask, scale, dropout_rate, dropout_rng,
            blocks,
        )]
    else:
        outs, all_weights = [], []
        for start, stop, kv_stop in blocks:
            out_block, weights = cpu_attention.attend_block(
                grouped_query[:, :, :, start:stop],
                key_major[..., :kv_stop] if cache_layout else key_major[:, :, :kv_stop],
                value_major[:, :, :kv_stop],
                None if bias is None else cpu_attention.rows_cols(bias, start, stop, kv_stop),
                None if mask is None else cpu_attention.rows_cols(mask, start, stop, kv_stop),
                scale,
                dropout_rate,
                cpu_attention.block_rng(dropout_rng, start),
                cache_layout,
            )
            outs.append(out_block)
            all_weights.append(weights)
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=3)
    # [batch, kv_heads, groups, q_len, head_dim] -> [batch, q_len, num_heads, head_dim]
    out = out.transpose(0, 3, 1, 2, 4).reshape(query.shape).astype(query.dtype)
    if return_weights:
        return out, all_weights[0].reshape(expected)
    return out


# Causal attention skips the key blocks after each block of this many queries once q_len reaches
# twice this. 64 beat 128 and 32 for the forward + backward pass on a 2-core CPU at lengths 128
# to 512 (10-21% faster than 128, e.g. 9.5 vs 12.0 ms at batch 2 x 256 x 6 heads of 64).
CAUSAL_BLOCK = 64
# Longer queries use fewer, longer blocks: each block is its own matmuls in the compiled program,
# so this bounds compile time (at 1,024 the forward pass ran as fast with 8 blocks as with 16).
MAX_CAUSAL_BLOCKS = 8


def _causal_blocks(q_len: int, kv_len: int) -> list[tuple[int, int]]:
    """Query blocks [start, stop) for causal self-attention without a cache (q_len == kv_len)."""
    if q_len != kv_len or q_len < 2 * CAUSAL_BLOCK:
        return [(0, q_len)]
    size = max(CAUSAL_BLOCK, -(-q_len // MAX_CAUSAL_BLOCKS))
    size = -(-size // CAUSAL_BLOCK) * CAUSAL_BLOCK  # a multiple of CAUSAL_BLOCK
    return [(start, min(start + size, q_len)) for start in range(0, q_len, size)]


def causal_mask(query_positions: jax.Array, key_positions: jax.Array) -> jax.Array:
    """Attend to keys at or before the query: key_pos <= query_pos.

    query_positions: [batch, q_len], key_positions: [batch, kv_len] -> [batch, 1, q_len, kv_len].
    Explicit positions serve packed rows and KV-cache decoding at per-row offsets.
    """
    query_positions, key_positions = jnp.asarray(query_positions), jnp.asarray(key_positions)
    return key_positions[:, None, None, :] <= query_positions[:, None, :, None]


def padding_mask(key_valid: jax.Array, query_valid: jax.Array | None = None) -> jax.Array:
    """Attend only to valid keys (and from valid queries).

    key_valid: [batch, kv_len] bool; query_valid: [batch, q_len] bool or None.
    Returns [batch, 1, q_len, kv_len], or [batch, 1, 1, kv_len] when query_valid is None.
    """
    mask = jnp.asarray(key_valid, bool)[:, None, None, :]
    if query_valid is not None:
        mask = mask & jnp.asarray(query_valid, bool)[:, None, :, None]
    return mask


def segment_mask(query_segment_ids: jax.Array, key_segment_ids: jax.Array) -> jax.Array:
    """Attend within the same packed segment (equal ids).

    query_segment_ids: [batch, q_len], key_segment_ids: [batch, kv_len]
    -> [batch, 1, q_len, kv_len].
    """
    query_ids, key_ids = jnp.asarray(query_segment_ids), jnp.asarray(key_segment_ids)
    return query_ids[:, None, :, None] == key_ids[:, None, None, :]


def local_window_mask(
    query_positions: jax.Array, key_positions: jax.Array, radius: int
) -> jax.Array:
    """|q - k| <= radius: restricted self-attention (Vaswani et al. 2017, Table 1, neighbourhood r).

    positions: [batch, q_len], [batch, kv_len] -> [batch, 1, q_len, kv_len].
    """
    if radius < 0:
        raise ValueError(f"radius={radius} must be >= 0")
    query_positions, key_positions = jnp.asarray(query_positions), jnp.asarray(key_positions)
    distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]
    return jnp.abs(distance) <= radius


def combine_masks(*masks: jax.Array | None) -> jax.Array | None:
    """Logical AND of the given masks (broadcasting); None entries skipped, None if all are None."""
    present = [jnp.asarray(m, bool) for m in masks if m is not None]
    if not present:
        return None
    combined = present[0]
    for mask in present[1:]:
        combined = combined & mask
    return combined


def valid_from_lengths(lengths: jax.Array, length: int) -> jax.Array:
    """lengths: [batch] -> [batch, length] bool, True for the first lengths[b] positions."""
    return jnp.arange(length)[None, :] < jnp.asarray(lengths)[:, None]


def valid_from_ids(ids: jax.Array, pad_id: int = 0) -> jax.Array:
    """ids: [batch, length] -> [batch, length] bool, True where ids != pad_id."""
    return jnp.asarray(ids) != pad_id
