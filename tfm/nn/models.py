"""Encoder, decoder-only LM and encoder-decoder Transformer, built from one residual block.

Inputs are token ids with optional explicit `positions` (per packed segment, or an offset when
decoding) and `segment_ids` (packed examples; 0 = padding). A decoder accepts an explicit KV cache
(tfm/nn/cache.py) and returns the updated one:
`(logits, cache) = model.apply(params, tokens, cache=c)`.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm import kernels
from tfm.checks import ConfigError
from tfm.nn import context_split
from tfm.nn import remat as remat_lib
from tfm.nn.cache import CacheSlot, DecoderCache, check_cache
from tfm.nn.config import ModelConfig
from tfm.nn.context import (
    LayerContext,
    cached_inputs,
    full_pass_inputs,
    resolve_valid,
    self_attention_context,
    with_cross_attention,
    with_position_bias,
)
from tfm.nn.layers import (
    FeedForward,
    MultiHeadAttention,
    Norm,
    OutputProjection,
    PositionBias,
    PositionEmbedding,
    TokenEmbedding,
)

Array = jax.Array


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
        self_inputs = ctx.self_attention
        if config.scheme.bias_per_layer(config):
            bias = PositionBias(config, self.bidirectional, name="position_bias")(
                self_inputs.query_positions, self_inputs.key_positions)
            self_inputs = with_position_bias(self_inputs, bias)
        slot = None if cache is None else CacheSlot(cache, layer, ctx.write_index)
        h = _sublayer_input(config, x, "self_attention")
        y, cache = MultiHeadAttention(config, name="self_attention")(
            h, h, self_inputs, slot, deterministic)
        x = _residual(config, x, drop(y, deterministic=deterministic), "self_attention")
        if self.has_cross:
            slot = None if cache is None else CacheSlot(cache, layer)
            h = _sublayer_input(config, x, "cross_attention")
            y, cache = MultiHeadAttention(config, is_cross=True, name="cross_attention")(
                h, ctx.encoded, ctx.cross_attention, slot, deterministic)
            x = _residual(config, x, drop(y, deterministic=deterministic), "cross_attention")
        y = FeedForward(config, name="feed_forward")(_sublayer_input(config, x, "feed_forward"))
        x = _residual(config, x, drop(y, deterministic=deterministic), "feed_forward")
        return (x, cache), None


def _sublayer_input(config: ModelConfig, x: Array, name: str) -> Array:
    """What sublayer `name` reads: Norm(x) with pre-LN, x with post-LN."""
    return Norm(config, name=f"{name}_norm")(x) if config.norm_placement == "pre" else x


def _residual(config: ModelConfig, x: Array, dropped: Array, name: str) -> Array:
    """x + Dropout(Sublayer(...)), normalised after the sum with post-LN ("Add & Norm")."""
    if config.norm_placement == "pre":
        return x + dropped
    return Norm(config, name=f"{name}_norm")(x + dropped)


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
        from_segments = valid is None and segment_ids is not None
        valid = resolve_valid(tokens, valid, segment_ids)
        follows_index = segment_ids is not None or (positions is None and valid is None)
        positions, structure = full_pass_inputs(config, tokens, positions, valid, segment_ids,
                                                causal=False, valid_from_segments=from_segments)
        shards = context_split.shards_for(tokens, False, balanced=False)
        sequence = None
        if shards > 1:  # context parallelism: contiguous chunks, the output in the input's order
            tokens, positions, sequence, structure = context_split.split_rows(
                config, tokens, positions, valid, segment_ids, follows_index, shards,
                causal=False)
        x = _embed(config, self, embedding, tokens, positions, token_types)
        x = self.perturb("embedded", x)  # lets tests take gradients w.r.t. the input embeddings
        x = nn.Dropout(config.dropout_rate)(x, deterministic=deterministic)
        ctx = self_attention_context(
            config, PositionBias(config, True, name="position_bias"), positions, positions,
            structure, None)
        if sequence is not None:
            x, ctx = context_split.with_sequence(x, ctx, sequence)
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
        logits_at: Array | None = None,  # [batch] int: each row's logits at this index only
    ) -> tuple[Array, DecoderCache | None]:
        config = self.config
        if output_kernel is not None and not config.tie_output:
            raise ValueError("output_kernel is the tied embedding's transpose; this model's "
                             "output is untied (tie_output=False)")
        write_index, new_valid = None, None
        from_segments = valid is None and segment_ids is not None
        valid = resolve_valid(tokens, valid, segment_ids)
        sequence = None
        whole = cache is not None and not cache.filled_by(tokens.shape[1])  # a fresh prefill
        shards = context_split.shards_for(tokens, whole)  # splits as a full pass does
        if self.has_cross and encoded is not None:  # the source splits too, or both run whole
            shards = min(shards, context_split.shards_for(encoded, False, balanced=False))
        follows_index = segment_ids is not None or (positions is None and valid is None)
        if cache is None:
            positions, structure = full_pass_inputs(config, tokens, positions, valid, segment_ids,
                                                    True, valid_from_segments=from_segments)
        else:
            check_cache(cache, config, self.has_cross, tokens.shape[0])
            if segment_ids is not None:
                raise ValueError("segment_ids (packing) cannot be combined with a KV cache")
            write_index = cache.lengths
            positions, key_positions, structure, new_valid = cached_inputs(
                config, cache, tokens, positions, valid)
        if shards > 1:  # context parallelism: rows load balanced until the last block
            tokens, positions, sequence, structure = context_split.split_rows(
                config, tokens, positions, valid, segment_ids, follows_index, shards,
                causal=True)
        if cache is None or shards > 1:
            key_positions = positions

        x = _embed(config, self, self.embedding, tokens, positions, None)
        x = self.perturb("embedded", x)
        x = nn.Dropout(config.dropout_rate)(x, deterministic=deterministic)
        ctx = self_attention_context(
            config, PositionBias(config, False, name="position_bias"), positions, key_positions,
            structure, write_index)
        if sequence is not None:
            x, ctx = context_split.with_sequence(x, ctx, sequence)
        if self.has_cross:
            ctx = _cross_context(ctx, tokens, cache, encoded, source_valid, segment_ids,
                                 source_segment_ids, None if sequence is None else shards)

        x, new_cache = Stack(
            config, config.num_decoder_layers, self.has_cross, False, name="stack"
        )(x, cache, ctx, deterministic)
        x = context_split.restore_rows(x, shards)
        if config.output_scale is not None:
            x = x * jnp.asarray(config.output_scale, x.dtype)
        if return_hidden:
            if cache is not None:
                raise ValueError("return_hidden=True is for full passes (a loss), not cached calls")
            return x, None
        if logits_at is not None:  # e.g. a prefill's last token: no [batch, len, vocab] logits
            x = jnp.take_along_axis(x, jnp.asarray(logits_at)[:, None, None], axis=1)
        if config.tie_output:
            logits = self.embedding.attend(x, output_kernel)
        else:
            logits = OutputProjection(config, self.embedding.vocab_size,
                                      name="output_projection")(x)
        if cache is not None:
            logits, new_cache = _after_cached_call(logits, tokens, cache, new_cache, new_valid,
                                                   ctx.source_valid if self.has_cross else None)
        return logits, new_cache


def _cross_context(
    ctx: LayerContext, tokens: Array, cache: DecoderCache | None, encoded: Array | None,
    source_valid: Array | None, segment_ids: Array | None, source_segment_ids: Array | None,
    shards: int | None,
) -> LayerContext:
    """`ctx` with the decoder's cross-attention inputs: the encoder's output `encoded` [batch,
    src_len, d_model] (or the cache's keys when None) and its mask by parts; under context
    parallelism (`shards`, else None) each device's queries against the gathered source.
    tokens, segment_ids: [batch, len]; source_valid, source_segment_ids: [batch, src_len]."""
    if encoded is None and cache is None:
        raise ValueError("the encoder-decoder's decoder needs `encoded` or a filled cache")
    source_valid = cache.source_valid if encoded is None else source_valid
    ctx = with_cross_attention(ctx, encoded, source_valid, segment_ids, source_segment_ids)
    if shards is None:
        return ctx
    cross = context_split.cross_mask(tokens, segment_ids, ctx.source_valid, source_segment_ids,
                                     shards)
    return ctx.replace(cross_attention=ctx.cross_attention.replace(sequence=cross))


def _after_cached_call(
    logits: Array,  # [batch, len | 1, vocab]
    tokens: Array,  # [batch, len], the call's new tokens
    cache: DecoderCache, new_cache: DecoderCache,
    new_valid: Array | None,  # [batch, max_len] bool
    source_valid: Array | None,  # [batch, src_len] bool; None: no cross-attention
) -> tuple[Array, DecoderCache]:
    """The logits and the cache after a cached call: a row whose new tokens did not fit (only
    possible under jit, where lengths are not known in advance) gets NaN logits rather than
    silently wrong ones; lengths advance by the new tokens."""
    overflow = cache.lengths + tokens.shape[1] > cache.max_len  # [batch]
    logits = jnp.where(overflow[:, None, None], jnp.nan, logits)
    new_cache = new_cache.replace(lengths=cache.lengths + tokens.shape[1], valid=new_valid)
    if source_valid is not None:
        new_cache = new_cache.replace(source_valid=source_valid)
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
        logits_at: Array | None = None,  # [batch] int: logits [batch, 1, vocab] at that index
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
            logits_at=logits_at,
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
        source_valid = resolve_valid(source, source_valid, source_segment_ids)
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
