"""The dense mask and logit bias of an attention call, made from its structure by parts
(tfm.kernels.call.AttentionStructure) inside the kernels that read them written out (the
reference, the CPU blocks, jax.nn's xla and cuDNN paths, and the fused kernels' fallback). The
model never builds a [.., q_len, kv_len] mask: it describes one, and only these functions
write it out (tests/test_layout.py checks that tfm/nn calls none of them)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tfm.kernels import block_bias, reference
from tfm.kernels.cache_layouts import CacheLayout
from tfm.kernels.call import AttentionCall, AttentionStructure, BlockBias


def dense_mask(
    structure: AttentionStructure | None, q_len: int, kv_len: int
) -> jax.Array | None:  # [batch | 1, 1, q_len, kv_len] bool, True = attend; None: no mask
    """The structure's mask written out with the reference's mask functions."""
    if structure is None:
        return None
    query_index = jnp.arange(q_len, dtype=jnp.int32)[None]  # [1 | batch, q_len]
    key_index = jnp.arange(kv_len, dtype=jnp.int32)[None]
    masks = []
    if structure.causal:
        offset = structure.query_offset
        shifted = query_index if offset is None else query_index + offset[:, None]
        masks.append(reference.causal_mask(shifted, key_index))
    if structure.window is not None:
        by_position = structure.query_positions is not None
        masks.append(reference.local_window_mask(
            structure.query_positions if by_position else query_index,
            structure.key_positions if by_position else key_index, structure.window))
    if structure.key_valid is not None:
        masks.append(reference.padding_mask(structure.key_valid))
    if structure.query_segments is not None:
        masks.append(reference.segment_mask(structure.query_segments, structure.key_segments))
    return reference.combine_masks(*masks)


def dense_position_bias(by_blocks: BlockBias) -> jax.Array:  # [batch, heads, q_len, kv_len]
    """A position scheme's bias by blocks written out: its dense form, else its block function
    on whole rows."""
    if by_blocks.dense is not None:
        return by_blocks.dense(by_blocks.params, by_blocks.query_positions,
                               by_blocks.key_positions)
    return block_bias.dense_from_blocks(by_blocks.function, by_blocks.params,
                                        by_blocks.query_positions, by_blocks.key_positions)


def dense_bias(
    structure: AttentionStructure | None,
    query: jax.Array,  # [batch, q_len, heads, head_dim], as attention reads it
    scale: float,
) -> jax.Array | None:  # [batch | 1, heads, q_len, kv_len] float32; None: no bias
    """The structure's logit biases written out and summed: the position scheme's (by blocks)
    and the one computed from the queries (relative)."""
    if structure is None:
        return None
    biases = []
    if structure.bias is not None:
        biases.append(dense_position_bias(structure.bias))
    relative = structure.relative
    if relative is not None:
        biases.append(relative.function(query, relative.params, relative.query_positions,
                                        relative.key_positions, scale))
    if not biases:
        return None
    return biases[0] if len(biases) == 1 else biases[0] + biases[1]


def dense_call(
    call: AttentionCall,
    query: jax.Array,  # [batch, q_len, heads, head_dim]
    kv_len: int,
) -> AttentionCall:
    """`call` with its dense mask and bias (what the caller gave, else made from the
    structure), for kernels that read them written out."""
    q_len, head_dim = query.shape[1], query.shape[-1]
    mask = call.mask
    if mask is None:
        mask = dense_mask(call.structure, q_len, kv_len)
    bias = call.bias
    if bias is None:
        scale = reference.default_scale(head_dim) if call.scale is None else call.scale
        bias = dense_bias(call.structure, query, scale)
    return dataclasses.replace(call, mask=mask, bias=bias)


def reference_attention(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim], or in `layout`'s key order
    value: jax.Array,  # likewise
    call: AttentionCall,
    layout: CacheLayout | None = None,  # with call.cache_layout: the cache's
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """reference.dot_product_attention with the call's dense mask and bias; with
    call.cache_layout, keys and values as `layout` stores them, read without a copy."""
    key_axes, value_axes = ((layout.key_axes, layout.value_axes) if call.cache_layout and layout
                            else (reference.MODEL_AXES, reference.MODEL_AXES))
    dense = dense_call(call, query, key.shape[key_axes.index("s")])
    return reference.dot_product_attention(query, key, value, **dense.spec_options(),
                                           key_axes=key_axes, value_axes=value_axes)


def in_model_order(
    call: AttentionCall,
    key: jax.Array,  # in `layout`'s key order with call.cache_layout, else the model's
    value: jax.Array,  # likewise
    layout: CacheLayout,
) -> tuple[AttentionCall, jax.Array, jax.Array]:
    """A KV cache read in `layout` (call.cache_layout) as the call without it and keys and
    values [batch, kv_len, kv_heads, head_dim], for a kernel that takes only those (a copy of
    each where XLA materialises the transpose); any other call as it is."""
    if not call.cache_layout:
        return call, key, value
    return (dataclasses.replace(call, cache_layout=False), layout.in_model_order(key, True),
            layout.in_model_order(value, False))


def causal_by_index(structure: AttentionStructure | None, q_len: int, kv_len: int) -> bool:
    """Whether the structure says query i sees no key after i by index (self-attention without
    a cache): a kernel may skip those blocks."""
    return (structure is not None and structure.causal and structure.query_offset is None
            and q_len == kv_len)


def block_segments(
    structure: AttentionStructure, q_len: int, padding_segment: int
) -> tuple[jax.Array, jax.Array] | None:  # ([batch, q_len], [batch, kv_len]) int32, or None
    """The segments a blocked kernel compares: the structure's (None: all one), with invalid
    keys given `padding_segment` (no query has it), unless the segments already mark them
    (structure.segments_mark_padding: then the ids pass as they are, one array for both, as
    splash reads fewer bytes that way). None: one segment and every key valid."""
    query_segments, key_segments = structure.query_segments, structure.key_segments
    valid = structure.key_valid
    if valid is None or (structure.segments_mark_padding and query_segments is not None):
        return None if query_segments is None else (query_segments, key_segments)
    if query_segments is None:
        query_segments = jnp.ones((valid.shape[0], q_len), jnp.int32)
        key_segments = jnp.ones(valid.shape, jnp.int32)
    key_segments = jnp.where(valid, key_segments.astype(jnp.int32), padding_segment)
    return query_segments.astype(jnp.int32), key_segments
