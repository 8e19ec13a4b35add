"""The reference maths every kernel is tested against: scaled dot-product attention (Vaswani
et al. 2017, eq. 1), masked softmax, dropout on the weights, the masks that feed them, and the
dense projection (`linear`).

This is the specification: plain einsums, scores -> bias and masks -> softmax -> weighted sum,
layout [batch, length, heads, head_dim]. Faster implementations of the same functions (CPU
blocks, fused GPU/TPU kernels) live beside it in tfm/kernels/ and are tested against it;
`tfm.kernels.attention(..., backend=...)` and `tfm.kernels.linear` choose among them. It sits
at the bottom of the import graph: it imports nothing from tfm. Masks are bool, True = may
attend, shaped [batch, 1, q_len, kv_len] (or broadcastable to it). tfm.nn.attention and
tfm.nn.dense re-export these names.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# The axis order of the keys and values a layer computes: batch, slots (length), kv heads,
# head_dim; a KV cache may store them in another (tfm.kernels.cache_layouts).
MODEL_AXES = "bsnh"

# Finite, so a fully masked row never produces NaN; its weights are then set to zero, so it
# reads no key at all (not a uniform average over masked, possibly future, keys).
MASKED_LOGIT = -0.7 * float(np.finfo(np.float32).max)


def dot_product_attention(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim]
    value: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim]
    *,
    bias: jax.Array | None = None,  # float, broadcastable to [batch, num_heads, q_len, kv_len]
    mask: jax.Array | None = None,  # bool, True = attend, likewise
    scale: float | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
    return_weights: bool = False,
    key_axes: str = MODEL_AXES,
    value_axes: str = MODEL_AXES,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """softmax(Q K^T * scale + bias) V, Vaswani et al. 2017 eq. (1), with grouped-query heads.

    num_heads % num_kv_heads == 0: query head n reads kv head n // (num_heads // num_kv_heads)
    (GQA; one kv head is MQA). scale defaults to 1 / sqrt(head_dim). The logits and softmax are
    float32; the output has query's dtype. A query whose keys are all masked gets a zero output
    (and zero gradient). dropout_rate > 0 drops attention weights (inverted dropout, needs
    dropout_rng). Returns out [batch, q_len, num_heads, head_dim], plus the (post-dropout)
    weights [batch, num_heads, q_len, kv_len] float32 when return_weights.
    key_axes, value_axes: the key's and value's axis order when they come in a KV cache's
    layout (a permutation of "bsnh": batch, slots, kv heads, head_dim), read as they are.
    """
    in_cache_layout = (key_axes, value_axes) != (MODEL_AXES, MODEL_AXES)
    query, key, value, bias, mask = check_inputs(
        query, key, value, bias, mask, dropout_rate, dropout_rng,
        check_cache_axes(query, key, value, key_axes, value_axes) if in_cache_layout else None,
    )
    batch, q_len, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[key_axes.index("n")]
    kv_len = key.shape[key_axes.index("s")]
    groups = num_heads // num_kv_heads
    scale = default_scale(head_dim) if scale is None else scale
    grouped = query.reshape(batch, q_len, num_kv_heads, groups, head_dim)
    scores = jnp.einsum(f"bqkgh,{_einsum_axes(key_axes)}->bkgqs", grouped, key,
                        preferred_element_type=jnp.float32)
    weights = masked_softmax(  # [batch, kv_heads, groups, q_len, kv_len]
        scores * jnp.float32(scale),
        group_heads(bias, num_kv_heads),
        group_heads(mask, num_kv_heads),
    )
    weights = dropout(weights, dropout_rate, dropout_rng)
    out = jnp.einsum(
        f"bkgqs,{_einsum_axes(value_axes)}->bqkgh", weights.astype(value.dtype), value,
        preferred_element_type=jnp.float32,
    ).reshape(query.shape).astype(query.dtype)
    if return_weights:
        return out, weights.reshape(batch, num_heads, q_len, kv_len)
    return out


def check_cache_axes(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # in key_axes order
    value: jax.Array,  # in value_axes order
    key_axes: str,
    value_axes: str,
) -> int:
    """The key length of keys and values in a KV cache's axis orders (permutations of
    MODEL_AXES); a readable error where their sizes disagree with each other or the query."""
    sizes = [dict(zip(axes, np.shape(array), strict=True))
             for axes, array in ((key_axes, key), (value_axes, value))]
    batch, _, num_heads, head_dim = np.shape(query)
    if sizes[0] != sizes[1] or (sizes[0]["b"], sizes[0]["h"]) != (batch, head_dim) or (
            num_heads % sizes[0]["n"]):
        raise ValueError(f"query {tuple(np.shape(query))} with key {tuple(np.shape(key))} "
                         f"({key_axes}) and value {tuple(np.shape(value))} ({value_axes}): they "
                         "must share batch and head_dim, with num_heads a multiple of kv_heads")
    return sizes[0]["s"]


def _einsum_axes(axes: str) -> str:
    """A layout's axes as the einsum letters above (kv heads are "k")."""
    return axes.replace("n", "k")


def default_scale(head_dim: int) -> float:
    """1 / sqrt(head_dim), the paper's logit scale (sec. 3.2.1)."""
    return 1.0 / np.sqrt(head_dim)


def group_heads(array: jax.Array | None, num_kv_heads: int) -> jax.Array | None:
    """A bias or mask [b|1, num_heads|1, q, k] -> [b|1, kv_heads|1, groups|1, q, k]."""
    if array is None or array.shape[1] == 1:
        return None if array is None else array[:, :, None]
    return array.reshape(array.shape[0], num_kv_heads, -1, *array.shape[2:])


def masked_softmax(
    scores: jax.Array,  # [..., q_len, kv_len] float32, scaled
    bias: jax.Array | None,  # broadcastable to scores
    mask: jax.Array | None,  # bool, likewise
) -> jax.Array:
    """softmax(scores + bias) over kv_len with masked keys left out; a query with no visible
    key gets all-zero weights (it reads nothing)."""
    if bias is not None:
        scores = scores + bias.astype(jnp.float32)
    if mask is None:
        return jax.nn.softmax(scores, axis=-1)
    weights = jax.nn.softmax(jnp.where(mask, scores, MASKED_LOGIT), axis=-1)
    return jnp.where(jnp.any(mask, axis=-1, keepdims=True), weights, 0.0)


def dropout_keep(rng: jax.Array, rate: float, shape: tuple[int, ...]) -> jax.Array:
    """bool [*shape]: which attention weights survive inverted dropout at `rate`."""
    return jax.random.bernoulli(rng, 1.0 - rate, shape)


def apply_keep(weights: jax.Array, keep: jax.Array | None, rate: float) -> jax.Array:
    """Inverted dropout with a given keep mask (None: no dropout)."""
    return weights if keep is None else jnp.where(keep, weights / (1.0 - rate), 0.0)


def dropout(weights: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    """Inverted dropout of attention weights (Vaswani et al. 2017 sec. 5.4 on sub-layers;
    on the weights as in tensor2tensor)."""
    if rate == 0:
        return weights
    return apply_keep(weights, dropout_keep(rng, rate, weights.shape), rate)


def _check_broadcastable(name: str, array: jax.Array, expected: tuple[int, ...]) -> None:
    shape = tuple(array.shape)
    if len(shape) != 4 or any(d not in (1, e) for d, e in zip(shape, expected, strict=True)):
        raise ValueError(
            f"{name} has shape {shape}; expected rank 4 broadcastable to "
            f"[batch, num_heads, q_len, kv_len] = {list(expected)} (each dim 1 or equal)"
        )


def check_inputs(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    bias: jax.Array | None,
    mask: jax.Array | None,
    dropout_rate: float,
    dropout_rng: jax.Array | None,
    kv_len: int | None = None,  # when key/value come in another layout (a kernel's cache)
) -> tuple[jax.Array, ...]:
    """Readable errors for inputs `dot_product_attention` (or a kernel) cannot take; returns
    the inputs as arrays."""
    query, key, value = jnp.asarray(query), jnp.asarray(key), jnp.asarray(value)
    for name, array in (("query", query), ("key", key), ("value", value)):
        if array.ndim != 4:
            raise ValueError(f"{name} must be rank 4 [batch, length, heads, head_dim], "
                             f"got shape {tuple(array.shape)}")
    batch, q_len, num_heads, head_dim = query.shape
    if kv_len is None:
        if key.shape != value.shape:
            raise ValueError(f"key and value shapes must match, got {key.shape} and {value.shape}")
        if key.shape[0] != batch or key.shape[3] != head_dim:
            raise ValueError(f"query {query.shape} and key {key.shape} must share batch and "
                             "head_dim")
        kv_len, num_kv_heads = key.shape[1], key.shape[2]
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} must be a multiple of "
                             f"num_kv_heads={num_kv_heads}")
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
    return query, key, value, bias, mask


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


# The dense projection every layer uses: y = x . kernel over the last axes of x, operands in
# the compute dtype, accumulated in float32 (tfm.kernels.linear may choose a faster
# implementation of the same values).
def linear_dtypes(
    x: jax.Array,  # [..., *in_dims]
    kernel: jax.Array,  # [*in_dims, *out_dims]
    num_contracted: int,
    compute_dtype: jnp.dtype | str | None,
    out_dtype: jnp.dtype | str | None,
) -> tuple[jnp.dtype, jnp.dtype]:
    """(compute dtype, output dtype) of a `linear` call, after checking that x ends in the
    kernel's input dims."""
    in_dims = kernel.shape[:num_contracted]
    if tuple(x.shape[x.ndim - num_contracted :]) != tuple(in_dims):
        raise ValueError(
            f"linear: x {tuple(x.shape)} must end in the kernel's input dims {tuple(in_dims)}"
        )
    compute_dtype = jnp.dtype(compute_dtype or x.dtype)
    return compute_dtype, jnp.dtype(out_dtype or compute_dtype)


def linear(
    x: jax.Array,  # [..., *in_dims]
    kernel: jax.Array,  # [*in_dims, *out_dims]
    *,
    num_contracted: int = 1,
    compute_dtype: jnp.dtype | str | None = None,
    out_dtype: jnp.dtype | str | None = None,
) -> jax.Array:  # [..., *out_dims] in out_dtype (default compute_dtype)
    """Contracts the last `num_contracted` axes of x with the leading axes of kernel, operands
    in compute_dtype (default x.dtype), accumulated in float32."""
    compute_dtype, out_dtype = linear_dtypes(x, kernel, num_contracted, compute_dtype, out_dtype)
    x_axes = tuple(range(x.ndim - num_contracted, x.ndim))
    y = jax.lax.dot_general(
        x.astype(compute_dtype),
        kernel.astype(compute_dtype),
        ((x_axes, tuple(range(num_contracted))), ((), ())),
        preferred_element_type=jnp.float32,
    )
    return y.astype(out_dtype)
