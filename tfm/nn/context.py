"""What the blocks of one stack call share, built once before the layers: the positions, the
masks and the position biases of self- and cross-attention (tfm.nn.layers.AttentionInputs),
from explicit positions, validity and packed segment ids (never from token values)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from tfm.kernels.call import AttentionStructure, BlockBias
from tfm.nn import attention
from tfm.nn import cache as cache_lib
from tfm.nn.cache import DecoderCache, check_room
from tfm.nn.config import ModelConfig
from tfm.nn.layers import AttentionInputs

Array = jax.Array


@struct.dataclass
class LayerContext:
    """What every block of one stack call shares, computed once before the layers.

    self_attention: the self-attention's mask, shared position bias and positions;
    write_index: [batch] cache slot of the first new token (None without a cache).
    Cross-attention (encoder-decoder only): encoded [batch, src_len, d_model] (None: read the
    cache), cross_attention (its mask and positions), source_valid [batch, src_len].
    """

    self_attention: AttentionInputs
    write_index: Array | None = None
    encoded: Array | None = None
    cross_attention: AttentionInputs | None = None
    source_valid: Array | None = None


def default_positions(tokens: Array, offset: Array | None = None) -> Array:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return positions if offset is None else positions + offset[:, None]


def resolve_valid(
    tokens: Array, valid: Array | None, segment_ids: Array | None
) -> Array | None:
    """[batch, len] bool validity: given explicitly, else segment id > 0 (packed rows, 0 =
    padding), else None (every token is real). Never inferred from token values."""
    if valid is not None:
        if valid.shape != tokens.shape:
            raise ValueError(f"valid must be {tokens.shape} like the tokens; got {valid.shape}")
        return jnp.asarray(valid, bool)
    if segment_ids is not None:
        return jnp.asarray(segment_ids) > 0
    return None


def positions_from_valid(valid: Array, offset: Array | int = 0) -> Array:
    """Each token's position = how many real tokens precede it (+ offset), so left padding
    does not shift positions; padding gets its neighbour's position (it is never attended)."""
    counted = jnp.cumsum(valid.astype(jnp.int32), axis=1) - valid.astype(jnp.int32)
    return counted + jnp.asarray(offset, jnp.int32).reshape(-1, 1)


def self_attention_context(
    config: ModelConfig,
    position_bias: Any,  # tfm.nn.layers.PositionBias, made by the calling module
    query_positions: Array,  # [batch, q_len]
    key_positions: Array,  # [batch, kv_len]
    masks: list[Array | None],
    write_index: Array | None,
    causal: bool,
    structure: AttentionStructure | None = None,
) -> LayerContext:
    """Masks and shared position biases for one stack's self-attention. `causal`: no cache
    and causal masking, so query i sees no key after i (attention may skip those blocks).
    structure: the same masks by their parts (`self_structure`), or None."""
    if config.local_window is not None:
        masks.append(
            attention.local_window_mask(query_positions, key_positions, config.local_window)
        )
    inputs = AttentionInputs(attention.combine_masks(*masks), None, query_positions,
                             key_positions, structure, causal)
    if not config.scheme.bias_per_layer(config):
        inputs = with_position_bias(inputs, position_bias(query_positions, key_positions))
    return LayerContext(self_attention=inputs, write_index=write_index)


def with_position_bias(
    inputs: AttentionInputs, bias: tuple[Array | None, BlockBias | None]
) -> AttentionInputs:
    """`inputs` with a position scheme's logit bias (PositionBias's dense form and block form)."""
    dense, by_blocks = bias
    return inputs.replace(bias=dense, structure=with_block_bias(inputs.structure, by_blocks))


def with_block_bias(
    structure: AttentionStructure | None, by_blocks: BlockBias | None
) -> AttentionStructure | None:
    """The self-attention structure with the position bias by blocks (None stays None: only the
    dense mask and bias describe that attention)."""
    if structure is None or by_blocks is None:
        return structure
    return dataclasses.replace(structure, bias=by_blocks)


def self_structure(
    config: ModelConfig,
    causal: bool,
    valid: Array | None,  # [batch, len] bool
    segment_ids: Array | None,  # [batch, len]
    positions_follow_index: bool,
) -> AttentionStructure | None:
    """Self-attention's mask (without a cache) by its parts: causal, the local window, and
    segments (packed ids, else 1 = real / 0 = padding). A window is by positions, so it is
    described only when positions advance by one per token (`positions_follow_index`: the
    default positions, or packed segments'); else None: only the dense mask says it."""
    window = config.local_window
    if window is not None and not positions_follow_index:
        return None
    ids = segment_ids if segment_ids is not None else valid
    ids = None if ids is None else jnp.asarray(ids).astype(jnp.int32)
    return AttentionStructure(causal, window, ids, ids)


def causal_inputs(
    tokens: Array, positions: Array | None, valid: Array | None, segment_ids: Array | None
) -> tuple[Array, Array, list[Array | None]]:
    """(positions, key positions, masks) of causal self-attention over `tokens` alone."""
    if positions is None:
        positions = default_positions(tokens)
        if valid is not None and segment_ids is None:
            positions = positions_from_valid(valid)
    order = default_positions(tokens)  # causal by index, whatever the positions
    masks = [
        attention.causal_mask(order, order),
        None if valid is None else attention.padding_mask(valid),
    ]
    if segment_ids is not None:
        masks.append(attention.segment_mask(segment_ids, segment_ids))
    return positions, positions, masks


def cached_inputs(
    cache: DecoderCache, tokens: Array, positions: Array | None, valid: Array | None
) -> tuple[Array, Array, list[Array | None], Array | None]:
    """(positions, key positions [batch, max_len], masks, the cache's new `valid`) of new
    tokens attending to every filled slot of `cache` and to each other, causally."""
    if tokens.shape[1] > cache.max_len:
        raise ValueError(
            f"{tokens.shape[1]} tokens are longer than the cache (max_len="
            f"{cache.max_len}); build a larger cache with init_cache"
        )
    check_room(cache, tokens.shape[1])
    write_index, new_valid = cache.lengths, None
    slots = default_positions(jnp.zeros((cache.batch_size, cache.max_len), jnp.int32))
    filled = attention.valid_from_lengths(cache.lengths + tokens.shape[1], cache.max_len)
    key_valid, key_positions = filled, slots
    if cache.valid is not None:
        written = jnp.ones(tokens.shape, bool) if valid is None else valid
        new_valid = cache_lib.write_valid(cache.valid, written, write_index)
        key_valid = filled & new_valid
        # A slot's position counts the real tokens before it (left padding aside).
        key_positions = positions_from_valid(new_valid)
    if positions is None:
        positions = jnp.take_along_axis(
            key_positions, default_positions(tokens, write_index), axis=1
        )
    masks = [
        attention.causal_mask(default_positions(tokens, write_index), slots),
        attention.padding_mask(key_valid),
    ]
    return positions, key_positions, masks, new_valid


def with_cross_attention(
    ctx: LayerContext,
    encoded: Array | None,  # [batch, src_len, d_model]; None: the cache holds keys/values
    source_valid: Array | None,  # [batch, src_len] bool; None = every source token is real
    segment_ids: Array | None,
    source_segment_ids: Array | None,
) -> LayerContext:
    """`ctx` with the cross-attention inputs: encoder output, padding (+ packing) mask."""
    if source_valid is None:
        source_len = encoded.shape[1]
        source_valid = attention.valid_from_lengths(
            jnp.full(encoded.shape[:1], source_len), source_len
        )
    query_positions = ctx.self_attention.query_positions
    cross_masks = [attention.padding_mask(source_valid)]
    # By parts: query segments (packed ids, else all 1) against key segments (packed ids, else
    # 1 = real / 0 = padding source token).
    query_segments = jnp.ones_like(query_positions, jnp.int32)
    key_segments = source_valid.astype(jnp.int32)
    if segment_ids is not None and source_segment_ids is not None:
        cross_masks.append(attention.segment_mask(segment_ids, source_segment_ids))
        query_segments = jnp.asarray(segment_ids).astype(jnp.int32)
        key_segments = jnp.asarray(source_segment_ids).astype(jnp.int32)
    structure = None
    if encoded is not None:
        structure = AttentionStructure(False, None, query_segments, key_segments)
    cross = AttentionInputs(attention.combine_masks(*cross_masks), None, query_positions,
                            default_positions(source_valid), structure)
    return ctx.replace(encoded=encoded, cross_attention=cross, source_valid=source_valid)
