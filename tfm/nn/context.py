"""What the blocks of one stack call share, built once before the layers: the positions, and
the masks and position biases of self- and cross-attention by their parts
(tfm.kernels.call.AttentionStructure in tfm.nn.layers.AttentionInputs: the kernels write them
out if they need to), from explicit positions, validity and packed segment ids (never from
token values)."""

from __future__ import annotations

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
    structure: AttentionStructure,
    write_index: Array | None,
) -> LayerContext:
    """One stack's self-attention inputs: positions, and the mask by parts with the shared
    position bias (unless each layer makes its own)."""
    inputs = AttentionInputs(query_positions, key_positions, structure)
    if not config.scheme.bias_per_layer(config):
        inputs = with_position_bias(inputs, position_bias(query_positions, key_positions))
    return LayerContext(self_attention=inputs, write_index=write_index)


def with_position_bias(inputs: AttentionInputs, by_blocks: BlockBias | None) -> AttentionInputs:
    """`inputs` with a position scheme's logit bias (PositionBias's BlockBias, or None)."""
    return inputs.replace(structure=inputs.structure.replace(bias=by_blocks))


def full_pass_inputs(
    config: ModelConfig,
    tokens: Array,  # [batch, len]
    positions: Array | None,  # [batch, len]
    valid: Array | None,  # [batch, len] bool
    segment_ids: Array | None,  # [batch, len]
    causal: bool,
    valid_from_segments: bool = False,
) -> tuple[Array, AttentionStructure]:
    """(positions, the self-attention mask by parts) of a pass over `tokens` alone (no cache):
    causal by index when `causal`, valid keys, packed segments, and the local window. The
    window compares indices when positions advance by one per token (the default positions,
    or packed segments': a blocked kernel builds it), else the positions.
    valid_from_segments: `valid` is segment_ids > 0 (resolve_valid made it from them), so the
    segments mark the padding (AttentionStructure.segments_mark_padding)."""
    follows_index = segment_ids is not None or (positions is None and valid is None)
    if positions is None:
        positions = default_positions(tokens)
        if valid is not None and segment_ids is None:
            positions = positions_from_valid(valid)
    by_position = None if follows_index or config.local_window is None else positions
    ids = None if segment_ids is None else jnp.asarray(segment_ids).astype(jnp.int32)
    structure = AttentionStructure(
        causal, config.local_window, ids, ids, key_valid=valid, query_positions=by_position,
        key_positions=by_position, segments_mark_padding=valid_from_segments and ids is not None)
    return positions, structure


def cached_inputs(
    config: ModelConfig, cache: DecoderCache, tokens: Array, positions: Array | None,
    valid: Array | None,
) -> tuple[Array, Array, AttentionStructure, Array | None]:
    """(positions, key positions [batch, max_len], the mask by parts, the cache's new `valid`)
    of new tokens attending to every filled slot of `cache` and to each other, causally: query
    i sits in slot write_index + i, and sees the filled, valid slots up to it.

    A prefill that fills the whole cache (DecoderCache.filled_by: as many tokens as slots, so
    the cache was empty and query i is slot i) gets a full pass's mask, without a write offset:
    the layers attend to its own keys through the fused kernels, with no [len, len] array
    (tfm.nn.layers)."""
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
    given_positions = positions is not None
    if positions is None:
        positions = jnp.take_along_axis(
            key_positions, default_positions(tokens, write_index), axis=1
        )
    fresh = cache.filled_by(tokens.shape[1])
    # A fresh prefill without explicit positions or valid tokens has positions 0, 1, ...: its
    # window compares indices.
    by_position = config.local_window is not None and not (
        fresh and not given_positions and valid is None)
    structure = AttentionStructure(
        True, config.local_window, key_valid=key_valid,
        query_offset=None if fresh else write_index,
        query_positions=positions if by_position else None,
        key_positions=key_positions if by_position else None)
    return positions, key_positions, structure, new_valid


def with_cross_attention(
    ctx: LayerContext,
    encoded: Array | None,  # [batch, src_len, d_model]; None: the cache holds keys/values
    source_valid: Array | None,  # [batch, src_len] bool; None = every source token is real
    segment_ids: Array | None,  # [batch, len]
    source_segment_ids: Array | None,  # [batch, src_len]
) -> LayerContext:
    """`ctx` with the cross-attention inputs: encoder output, and the mask by parts (valid
    source tokens, and packed segments when both sides are packed)."""
    if source_valid is None:
        source_valid = jnp.ones(encoded.shape[:2], bool)
    query_segments = key_segments = None
    if segment_ids is not None and source_segment_ids is not None:
        query_segments = jnp.asarray(segment_ids).astype(jnp.int32)
        key_segments = jnp.asarray(source_segment_ids).astype(jnp.int32)
    structure = AttentionStructure(False, None, query_segments, key_segments,
                                   key_valid=jnp.asarray(source_valid, bool))
    cross = AttentionInputs(ctx.self_attention.query_positions,
                            default_positions(source_valid), structure)
    return ctx.replace(encoded=encoded, cross_attention=cross, source_valid=source_valid)
