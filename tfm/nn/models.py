"""Encoder, decoder-only LM and encoder-decoder Transformer, built from one residual block.

Inputs are token ids with optional explicit `positions` (per packed segment, or an offset when
decoding) and `segment_ids` (packed examples; 0 = padding). A decoder accepts an explicit KV cache
(tfm/nn/cache.py) and returns the updated one:
`(logits, cache) = model.apply(params, tokens, cache=c)`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from tfm import kernels
from tfm.checks import ConfigError
from tfm.kernels.call import AttentionStructure, BlockBias
from tfm.nn import attention
from tfm.nn import cache as cache_lib
from tfm.nn import remat as remat_lib
from tfm.nn.cache import DecoderCache, check_cache, check_room
from tfm.nn.config import ModelConfig
from tfm.nn.layers import (
    FeedForward,
    MultiHeadAttention,
    Norm,
    PositionBias,
    PositionEmbedding,
    TokenEmbedding,
)

Array = jax.Array


@struct.dataclass
class LayerContext:
    """What every block of one stack call shares, computed once before the layers.

    self_mask: [batch, 1, q_len, kv_len] bool or None; self_bias: [batch | 1, heads, q_len,
    kv_len] (a position scheme's shared logit bias) or None; query_positions: [batch, q_len];
    key_positions: [batch, kv_len]; write_index: [batch] cache slot of the first new token (None
    without a cache); causal: no cache and causal masking (attention may skip future blocks).
    Cross-attention (encoder-decoder only): encoded [batch, src_len, d_model] (None: read the
    cache), cross_mask [batch, 1, q_len, src_len], source_positions, source_valid [batch,
    src_len]. self_structure / cross_structure: the same masks by their parts, for fused kernels
    (tfm.kernels.AttentionStructure; None where only the dense mask can say it).
    """

    self_mask: Array | None
    self_bias: Array | None
    query_positions: Array
    key_positions: Array
    write_index: Array | None = None
    causal: bool = struct.field(pytree_node=False, default=False)
    encoded: Array | None = None
    cross_mask: Array | None = None
    source_positions: Array | None = None
    source_valid: Array | None = None
    self_structure: AttentionStructure | None = None
    cross_structure: AttentionStructure | None = None


class Block(nn.Module):
    """Self-attention, optional cross-attention, FFN; each wrapped in a residual with dropout.

    post-LN (the paper's "Add & Norm"): x = Norm(x + Dropout(Sublayer(x)));
    pre-LN: x = x + Dropout(Sublayer(Norm(x))), with a final norm after the stack.
    Call signature fits nn.scan: ((x, cache), layer index, LayerContext) -> ((x, cache), None).
    `cache` is the DecoderCache of every layer (tfm/nn/cache.py layout) or None; this block reads
    and writes its own layer's slots in place and returns the same cache form.
    """

    config: ModelConfig
    has_cross: bool
    bidirectional: bool

    @nn.compact
    def __call__(
        self, carry: tuple, layer: Array | int, ctx: LayerContext, deterministic: bool
    ) -> tuple[tuple[Array, DecoderCache | None], None]:
        # carry: (x [batch, len, d_model], the DecoderCache or None)
        x, cache = carry
        config = self.config
        drop = nn.Dropout(config.dropout_rate)

        def residual(x: Array, sublayer: Any, name: str) -> tuple[Array, Any]:
            if config.norm_placement == "pre":
                y, extra = sublayer(Norm(config, name=f"{name}_norm")(x))
                return x + drop(y, deterministic=deterministic), extra
            y, extra = sublayer(x)
            return Norm(config, name=f"{name}_norm")(
                x + drop(y, deterministic=deterministic)
            ), extra

        self_bias, self_structure = ctx.self_bias, ctx.self_structure
        if config.scheme.bias_per_layer(config):
            self_bias, by_blocks = PositionBias(config, self.bidirectional, name="position_bias")(
                ctx.query_positions, ctx.key_positions
            )
            self_structure = _with_block_bias(self_structure, by_blocks)
        self_attention = MultiHeadAttention(config, name="self_attention")
        x, cache = residual(
            x,
            lambda h: self_attention(
                h,
                h,
                mask=ctx.self_mask,
                bias=self_bias,
                query_positions=ctx.query_positions,
                key_positions=ctx.key_positions,
                cache=cache,
                layer=layer,
                write_index=ctx.write_index,
                causal=ctx.causal,
                structure=self_structure,
                deterministic=deterministic,
            ),
            "self_attention",
        )
        if self.has_cross:
            cross_attention = MultiHeadAttention(config, is_cross=True, name="cross_attention")
            x, cache = residual(
                x,
                lambda h: cross_attention(
                    h,
                    ctx.encoded,
                    mask=ctx.cross_mask,
                    bias=None,
                    query_positions=ctx.query_positions,
                    key_positions=ctx.source_positions,
                    cache=cache,
                    layer=layer,
                    structure=ctx.cross_structure,
                    deterministic=deterministic,
                ),
                "cross_attention",
            )

        feed_forward = FeedForward(config, name="feed_forward")
        x, _ = residual(x, lambda h: (feed_forward(h), None), "feed_forward")
        return (x, cache), None


class Stack(nn.Module):
    """`num_layers` blocks, unrolled or under nn.scan (compile time flat in depth), plus the
    final norm of pre-LN. The DecoderCache of all layers travels through the stack as the carry
    (per-layer or stacked slots, see tfm/nn/cache.py); each block updates its layer's in place."""

    config: ModelConfig
    num_layers: int
    has_cross: bool
    bidirectional: bool

    @nn.compact
    def __call__(
        self, x: Array, cache: DecoderCache | None, ctx: LayerContext, deterministic: bool
    ) -> tuple[Array, DecoderCache | None]:
        config = self.config
        block = Block
        if config.remat != "none":
            # static_argnums counts self: (self, carry, layer, ctx, deterministic). Unrolled,
            # `layer` is a python int that picks the layer's cache slots, which a traced one
            # cannot; under nn.scan it is traced anyway and the cache is stacked.
            block = nn.remat(
                Block,
                policy=remat_lib.policy(config.remat),
                static_argnums=(4,) if config.scan_layers else (2, 4),
                # Inside a scan XLA cannot merge the recomputation away, so the barriers that
                # prevent_cse adds only cost time (jax.checkpoint's docs).
                prevent_cse=not config.scan_layers,
            )
        if config.scan_layers:
            scanned = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                in_axes=(0, nn.broadcast, nn.broadcast),
                length=self.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            layers = jnp.arange(self.num_layers, dtype=jnp.int32)
            (x, cache), _ = scanned(config, self.has_cross, self.bidirectional, name="layers")(
                (x, cache), layers, ctx, deterministic
            )
        else:
            for i in range(self.num_layers):
                (x, cache), _ = block(
                    config, self.has_cross, self.bidirectional, name=f"layer_{i}"
                )((x, cache), i, ctx, deterministic)
        if config.has_final_norm:
            x = Norm(config, name="final_norm")(x)
        return x, cache


def _default_positions(tokens: Array, offset: Array | None = None) -> Array:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return positions if offset is None else positions + offset[:, None]


def _resolve_valid(
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


def _positions_from_valid(valid: Array, offset: Array | int = 0) -> Array:
    """Each token's position = how many real tokens precede it (+ offset), so left padding
    does not shift positions; padding gets its neighbour's position (it is never attended)."""
    counted = jnp.cumsum(valid.astype(jnp.int32), axis=1) - valid.astype(jnp.int32)
    return counted + jnp.asarray(offset, jnp.int32).reshape(-1, 1)


def _embed(
    config: ModelConfig,
    module: nn.Module,
    embedding: nn.Module,
    tokens: Array,
    positions: Array,
    token_types: Array | None,
) -> Array:
    """Token (+ position, + token-type) embeddings, then the embedding norm if configured."""
    x = PositionEmbedding(config, name="position_embedding")(embedding(tokens), positions)
    if config.type_vocab_size:
        table = module.param(
            "token_type_embedding",
            nn.with_logical_partitioning(nn.initializers.normal(stddev=0.02), (None, "embed")),
            (config.type_vocab_size, config.d_model),
            config.params_dtype,
        )
        types = jnp.zeros_like(tokens) if token_types is None else token_types
        x = x + jnp.take(table, types, axis=0).astype(x.dtype)
    elif token_types is not None:
        raise ValueError("token_types needs model.type_vocab_size > 0")
    if config.embedding_norm:
        x = Norm(config, name="embedding_norm")(x)
    return x


def _self_attention_context(
    config: ModelConfig,
    position_bias: PositionBias,
    query_positions: Array,  # [batch, q_len]
    key_positions: Array,  # [batch, kv_len]
    masks: list[Array | None],
    write_index: Array | None,
    causal: bool,
    structure: AttentionStructure | None = None,
) -> LayerContext:
    """Masks and shared position biases for one stack's self-attention. `causal`: no cache
    and causal masking, so query i sees no key after i (attention may skip those blocks).
    structure: the same masks by their parts (`_self_structure`), or None."""
    if config.local_window is not None:
        masks.append(
            attention.local_window_mask(query_positions, key_positions, config.local_window)
        )
    shared_bias = None
    if not config.scheme.bias_per_layer(config):
        shared_bias, by_blocks = position_bias(query_positions, key_positions)
        structure = _with_block_bias(structure, by_blocks)
    return LayerContext(
        self_mask=attention.combine_masks(*masks),
        self_bias=shared_bias,
        query_positions=query_positions,
        key_positions=key_positions,
        write_index=write_index,
        causal=causal,
        self_structure=structure,
    )


def _with_block_bias(
    structure: AttentionStructure | None, by_blocks: BlockBias | None
) -> AttentionStructure | None:
    """The self-attention structure with the position bias by blocks (None stays None: only the
    dense mask and bias describe that attention)."""
    if structure is None or by_blocks is None:
        return structure
    return dataclasses.replace(structure, bias=by_blocks)


def _self_structure(
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


def _causal_inputs(
    tokens: Array, positions: Array | None, valid: Array | None, segment_ids: Array | None
) -> tuple[Array, Array, list[Array | None]]:
    """(positions, key positions, masks) of causal self-attention over `tokens` alone."""
    if positions is None:
        positions = _default_positions(tokens)
        if valid is not None and segment_ids is None:
            positions = _positions_from_valid(valid)
    order = _default_positions(tokens)  # causal by index, whatever the positions
    masks = [
        attention.causal_mask(order, order),
        None if valid is None else attention.padding_mask(valid),
    ]
    if segment_ids is not None:
        masks.append(attention.segment_mask(segment_ids, segment_ids))
    return positions, positions, masks


def _cached_inputs(
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
    slots = _default_positions(jnp.zeros((cache.batch_size, cache.max_len), jnp.int32))
    filled = attention.valid_from_lengths(cache.lengths + tokens.shape[1], cache.max_len)
    key_valid, key_positions = filled, slots
    if cache.valid is not None:
        written = jnp.ones(tokens.shape, bool) if valid is None else valid
        new_valid = cache_lib.write_valid(cache.valid, written, write_index)
        key_valid = filled & new_valid
        # A slot's position counts the real tokens before it (left padding aside).
        key_positions = _positions_from_valid(new_valid)
    if positions is None:
        positions = jnp.take_along_axis(
            key_positions, _default_positions(tokens, write_index), axis=1
        )
    masks = [
        attention.causal_mask(_default_positions(tokens, write_index), slots),
        attention.padding_mask(key_valid),
    ]
    return positions, key_positions, masks, new_valid


def _with_cross_attention(
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
    cross_masks = [attention.padding_mask(source_valid)]
    # By parts: query segments (packed ids, else all 1) against key segments (packed ids, else
    # 1 = real / 0 = padding source token).
    query_segments = jnp.ones_like(ctx.query_positions, jnp.int32)
    key_segments = source_valid.astype(jnp.int32)
    if segment_ids is not None and source_segment_ids is not None:
        cross_masks.append(attention.segment_mask(segment_ids, source_segment_ids))
        query_segments = jnp.asarray(segment_ids).astype(jnp.int32)
        key_segments = jnp.asarray(source_segment_ids).astype(jnp.int32)
    structure = None
    if encoded is not None:
        structure = AttentionStructure(False, None, query_segments, key_segments)
    return ctx.replace(
        encoded=encoded,
        cross_mask=attention.combine_masks(*cross_masks),
        cross_structure=structure,
        source_positions=_default_positions(source_valid),
        source_valid=source_valid,
    )


class Encoder(nn.Module):
    """Bidirectional Transformer encoder (Vaswani et al. 2017 sec. 3.1)."""

    config: ModelConfig
    shared_embedding: nn.Module | None = None

    @nn.compact
    def __call__(
        self,
        tokens: Array,  # [batch, src_len]
        *,
        positions: Array | None = None,  # [batch, src_len]
        segment_ids: Array | None = None,  # [batch, src_len]
        valid: Array | None = None,  # [batch, src_len] bool; None = segment_ids > 0 or all
        token_types: Array | None = None,  # [batch, src_len] (BERT segments A/B)
        deterministic: bool = True,
    ) -> Array:  # [batch, src_len, d_model]
        config = self.config
        embedding = self.shared_embedding
        if embedding is None:
            embedding = TokenEmbedding(config, config.resolved_source_vocab_size, name="embed")
        valid = _resolve_valid(tokens, valid, segment_ids)
        follow_index = segment_ids is not None or (positions is None and valid is None)
        if positions is None:
            positions = _default_positions(tokens)
            if valid is not None and segment_ids is None:
                positions = _positions_from_valid(valid)
        x = _embed(config, self, embedding, tokens, positions, token_types)
        x = self.perturb("embedded", x)  # lets tests take gradients w.r.t. the input embeddings
        x = nn.Dropout(config.dropout_rate)(x, deterministic=deterministic)
        masks = [None if valid is None else attention.padding_mask(valid)]
        if segment_ids is not None:
            masks.append(attention.segment_mask(segment_ids, segment_ids))
        ctx = _self_attention_context(
            config,
            PositionBias(config, True, name="position_bias"),
            positions,
            positions,
            masks,
            None,
            False,
            _self_structure(config, False, valid, segment_ids, follow_index),
        )
        x, _ = Stack(config, config.num_encoder_layers, False, True, name="stack")(
            x, None, ctx, deterministic
        )
        return x


class Decoder(nn.Module):
    """Causal Transformer decoder; with cross-attention it is the encoder-decoder's decoder."""

    config: ModelConfig
    has_cross: bool
    embedding: nn.Module

    @nn.compact
    def __call__(
        self,
        tokens: Array,  # [batch, len]
        *,
        positions: Array | None = None,  # [batch, len]
        segment_ids: Array | None = None,  # [batch, len]
        valid: Array | None = None,  # [batch, len] bool; None = segment_ids > 0, or all real
        cache: DecoderCache | None = None,
        encoded: Array | None = None,  # [batch, src_len, d_model]
        source_valid: Array | None = None,  # [batch, src_len] bool
        source_segment_ids: Array | None = None,  # [batch, src_len]
        deterministic: bool = True,
        output_kernel: Array | None = None,  # [d_model, vocab], tied output only
        return_hidden: bool = False,  # the output projection's input instead of the logits
    ) -> tuple[Array, DecoderCache | None]:
        config = self.config
        if output_kernel is not None and not config.tie_output:
            raise ValueError("output_kernel is the tied embedding's transpose; this model's "
                             "output is untied (tie_output=False)")
        write_index, new_valid = None, None
        valid = _resolve_valid(tokens, valid, segment_ids)
        structure = None
        if cache is None:
            follow_index = segment_ids is not None or (positions is None and valid is None)
            structure = _self_structure(config, True, valid, segment_ids, follow_index)
            positions, key_positions, masks = _causal_inputs(tokens, positions, valid, segment_ids)
        else:
            check_cache(cache, config, self.has_cross, tokens.shape[0])
            if segment_ids is not None:
                raise ValueError("segment_ids (packing) cannot be combined with a KV cache")
            write_index = cache.lengths
            positions, key_positions, masks, new_valid = _cached_inputs(
                cache, tokens, positions, valid
            )

        x = _embed(config, self, self.embedding, tokens, positions, None)
        x = self.perturb("embedded", x)
        x = nn.Dropout(config.dropout_rate)(x, deterministic=deterministic)
        ctx = _self_attention_context(
            config, PositionBias(config, False, name="position_bias"), positions, key_positions,
            masks, write_index, cache is None, structure)
        if self.has_cross:
            if encoded is None and cache is None:
                raise ValueError("the encoder-decoder's decoder needs `encoded` or a filled cache")
            source_valid = cache.source_valid if encoded is None else source_valid
            ctx = _with_cross_attention(ctx, encoded, source_valid, segment_ids, source_segment_ids)

        x, new_cache = Stack(
            config, config.num_decoder_layers, self.has_cross, False, name="stack"
        )(x, cache, ctx, deterministic)
        if config.output_scale is not None:
            x = x * jnp.asarray(config.output_scale, x.dtype)
        if return_hidden:
            if cache is not None:
                raise ValueError("return_hidden=True is for full passes (a loss), not cached calls")
            return x, None
        if config.tie_output:
            logits = self.embedding.attend(x, output_kernel)
        else:
            logits = nn.DenseGeneral(
                self.embedding.vocab_size,
                use_bias=config.lm_head_bias,
                dtype=config.compute_dtype,
                param_dtype=config.params_dtype,
                kernel_init=nn.with_logical_partitioning(
                    nn.initializers.xavier_uniform(), ("embed", "vocab")
                ),
                name="output_projection",
            )(x).astype(jnp.float32)
        if cache is not None:
            # A row whose new tokens did not fit (only possible under jit, where lengths are
            # not known in advance) gets NaN logits rather than silently wrong ones.
            overflow = cache.lengths + tokens.shape[1] > cache.max_len  # [batch]
            logits = jnp.where(overflow[:, None, None], jnp.nan, logits)
            new_cache = new_cache.replace(lengths=cache.lengths + tokens.shape[1], valid=new_valid)
            if self.has_cross:
                new_cache = new_cache.replace(source_valid=ctx.source_valid)
        return logits, new_cache


class DecoderLM(nn.Module):
    """Decoder-only causal language model: `logits = model.apply(params, tokens)`, or with a cache
    `(logits, cache) = model.apply(params, tokens, cache=cache)`. Its config has no encoder
    layers (ModelConfig.decoder_only)."""

    config: ModelConfig

    def __post_init__(self) -> None:
        check_decoder_only(self.config)
        super().__post_init__()

    @nn.compact
    def __call__(
        self,
        tokens: Array,  # [batch, len]
        *,
        positions: Array | None = None,  # [batch, len]
        segment_ids: Array | None = None,  # [batch, len]
        valid: Array | None = None,  # [batch, len] bool (e.g. left padding); None = all real
        cache: DecoderCache | None = None,
        deterministic: bool = True,
        output_kernel: Array | None = None,  # [d_model, vocab]: `output_kernel(params, config)`
        return_hidden: bool = False,  # [batch, len, d_model] instead: `output_projection`'s input
    ) -> Array | tuple[Array, DecoderCache]:  # logits [batch, len, vocab] float32
        config = self.config
        embedding = TokenEmbedding(config, config.vocab_size, name="embed")
        logits, new_cache = Decoder(config, False, embedding, name="decoder")(
            tokens,
            positions=positions,
            segment_ids=segment_ids,
            valid=valid,
            cache=cache,
            deterministic=deterministic,
            output_kernel=output_kernel,
            return_hidden=return_hidden,
        )
        return logits if cache is None else (logits, new_cache)


def check_decoder_only(config: ModelConfig) -> None:
    """ConfigError when `config` has encoder layers, which a DecoderLM would silently ignore
    (ModelConfig's defaults are the paper's encoder-decoder)."""
    if config.num_encoder_layers:
        raise ConfigError(
            f"DecoderLM has no encoder, but model.num_encoder_layers={config.num_encoder_layers} "
            "(ModelConfig's default is the paper's 6 + 6-layer encoder-decoder); set "
            "model.num_encoder_layers=0 (ModelConfig.decoder_only(vocab_size=..., "
            "num_layers=...) does), or use EncoderDecoder"
        )


class EncoderDecoder(nn.Module):
    """The Transformer of Vaswani et al. 2017: `model.apply(params, source, inputs)` for training;
    `encode` once, then `decode` with a cache for generation."""

    config: ModelConfig

    def setup(self) -> None:
        config = self.config
        target_embedding = TokenEmbedding(config, config.vocab_size, name="embed")
        if config.share_embeddings:
            source_embedding = target_embedding
        else:
            source_embedding = TokenEmbedding(
                config, config.resolved_source_vocab_size, name="source_embed"
            )
        self.encoder = Encoder(config, source_embedding, name="encoder")
        self.decoder = Decoder(config, True, target_embedding, name="decoder")

    def encode(
        self,
        source: Array,  # [batch, src_len]
        *,
        source_positions: Array | None = None,
        source_segment_ids: Array | None = None,
        source_valid: Array | None = None,  # [batch, src_len] bool
        deterministic: bool = True,
    ) -> Array:  # [batch, src_len, d_model]
        return self.encoder(
            source,
            positions=source_positions,
            segment_ids=source_segment_ids,
            valid=source_valid,
            deterministic=deterministic,
        )

    def decode(
        self,
        tokens: Array,  # [batch, len]
        *,
        encoded: Array | None,  # [batch, src_len, d_model]; None reads the cross cache
        source_valid: Array | None = None,  # [batch, src_len] bool
        positions: Array | None = None,
        segment_ids: Array | None = None,
        source_segment_ids: Array | None = None,
        valid: Array | None = None,  # [batch, len] bool
        cache: DecoderCache | None = None,
        deterministic: bool = True,
        output_kernel: Array | None = None,  # [d_model, vocab]: `output_kernel(params, config)`
        return_hidden: bool = False,  # [batch, len, d_model] instead: `output_projection`'s input
    ) -> Array | tuple[Array, DecoderCache]:  # logits [batch, len, vocab] float32
        logits, new_cache = self.decoder(
            tokens,
            positions=positions,
            segment_ids=segment_ids,
            valid=valid,
            cache=cache,
            encoded=encoded,
            source_valid=source_valid,
            source_segment_ids=source_segment_ids,
            deterministic=deterministic,
            output_kernel=output_kernel,
            return_hidden=return_hidden,
        )
        return logits if cache is None else (logits, new_cache)

    def __call__(
        self,
        source: Array,  # [batch, src_len]
        inputs: Array,  # [batch, len] decoder inputs (BOS + target[:-1])
        *,
        source_positions: Array | None = None,
        source_segment_ids: Array | None = None,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        source_valid: Array | None = None,  # [batch, src_len] bool; None = segment ids > 0
        valid: Array | None = None,  # [batch, len] bool; None = segment ids > 0
        deterministic: bool = True,
        return_hidden: bool = False,  # [batch, len, d_model] instead: `output_projection`'s input
    ) -> Array:  # logits [batch, len, vocab] float32
        source_valid = _resolve_valid(source, source_valid, source_segment_ids)
        encoded = self.encode(
            source,
            source_positions=source_positions,
            source_segment_ids=source_segment_ids,
            source_valid=source_valid,
            deterministic=deterministic,
        )
        return self.decode(
            inputs,
            encoded=encoded,
            source_valid=source_valid,
            positions=positions,
            segment_ids=segment_ids,
            source_segment_ids=source_segment_ids,
            valid=valid,
            deterministic=deterministic,
            return_hidden=return_hidden,
        )


def output_projection(params: Any, config: ModelConfig) -> tuple[Array, Array | None]:
    """The output layer as (table [vocab, d_model], bias [vocab] or None): logits = hidden @
    table.T + bias, where hidden is the model's output with return_hidden=True. The tied
    embedding's table itself, or the untied projection's kernel transposed; differentiable in
    `params` (boxed or not)."""
    if config.tie_output:
        return nn.meta.unbox(params["embed"]["embedding"]), None
    projection = nn.meta.unbox(params["decoder"]["output_projection"])
    return projection["kernel"].T, projection.get("bias")


def output_kernel(params: Any, config: ModelConfig) -> Array | None:
    """What to pass as `output_kernel=` to DecoderLM / EncoderDecoder.decode at every step of a
    decoding loop, made once before it: the tied output projection as the kernels want it
    (`tfm.kernels.tied_output_kernel`; None = read the table), None for an untied model.
    params: the model's parameters (boxed or not)."""
    if not config.tie_output:
        return None
    table = nn.meta.unbox(params["embed"]["embedding"])  # [vocab, d_model]
    return kernels.tied_output_kernel(table, config.compute_dtype)


def stack_layer_params(params: Any) -> Any:
    """Converts unrolled parameters ({"layer_0": ..., "layer_1": ...}) into the nn.scan layout
    ({"layers": leaves stacked on axis 0}), e.g. to load an unrolled checkpoint into a scanned
    model. Expects plain (unboxed) arrays: `flax.linen.meta.unbox(params)`."""
    if not isinstance(params, dict):
        return params
    converted = {key: stack_layer_params(value) for key, value in params.items()}
    num_layers = sum(key.startswith("layer_") and key[6:].isdigit() for key in converted)
    if num_layers:
        layers = [converted.pop(f"layer_{i}") for i in range(num_layers)]
        converted["layers"] = jax.tree.map(lambda *leaves: jnp.stack(leaves), *layers)
    return converted
