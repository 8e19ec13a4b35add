"""The model families tfm builds, by name, and everything that differs between them: the model a
ModelConfig builds, how a batch of the data pipeline (tfm/data/pipeline.py) feeds it, which record
formats train it, how it generates (tfm/decode/generate.py), what evaluation scores by default,
and its parameter and matmul-weight counts (read from the model itself, for tfm/training/flops.py).
Data, training, evaluation, generation and FLOP counts ask the entry instead of comparing family
names; a new family is one entry here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

from tfm.checks import ConfigError
from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM, Encoder, EncoderDecoder, output_projection


@dataclasses.dataclass(frozen=True)
class ModelCounts:
    """A model's sizes, from the shapes of its parameters (`Family.counts`).

    params: every parameter. Matmul weights (the kernels of the attention projections, the FFNs
    and the output layer, which counts also when tied to the embedding since its matmul still
    runs) by what they run once for: `target_weights` per output token, `source_weights` per
    source token (the encoder's and the cross-attention key/value projections). Attention
    widths, summed over layers (layers * num_heads * head_dim): `self_width` of output-token
    queries over output-token keys, `cross_width` over source keys, `source_width` of source
    queries over source keys."""

    params: int
    target_weights: int
    source_weights: int
    self_width: int
    cross_width: int
    source_width: int


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family. `inputs`: the batch keys passed positionally to the model (token ids);
    `keywords`: (model keyword, batch key) pairs passed by name (positions, packing).

    text_format / pair_format: the tfm.data.pipeline.FORMATS entry that turns a text record /
    a (source, target) record into this family's examples (None: it does not train on those).
    generator: the tfm.decode.generate.GENERATORS entry that decodes with it (None: it does not
    generate). pair_metric: what evaluation decodes for on (source, target) data by default
    (tfm.training.config.GENERATION_METRICS; synthetic tasks use exact_match for every family).
    source_scope: the parameter subtree read once per source token (() = every parameter,
    None = none); output_layer: whether the model ends in a vocabulary projection."""

    name: str
    description: str
    model: Callable[[ModelConfig], nn.Module]
    inputs: tuple[str, ...]
    keywords: tuple[tuple[str, str], ...]
    text_format: str | None
    pair_format: str | None
    generator: str | None
    pair_metric: str
    source_scope: tuple[str, ...] | None
    output_layer: bool = True

    @property
    def reads_source(self) -> bool:
        """An encoder reads a source sequence: prompts are sources (source tokens + eos), and
        the decoder starts from bos with a budget that follows the source length."""
        return "source" in self.inputs

    def logits(
        self,
        model: nn.Module,
        params: Any,
        batch: Mapping[str, jax.Array],  # every entry [batch, len]
        *,
        deterministic: bool,
        dropout_rng: jax.Array | None = None,
        return_hidden: bool = False,
    ) -> jax.Array:  # [batch, len, vocab] float32 (return_hidden: [batch, len, d_model])
        """The model's logits for a batch of the data pipeline; return_hidden: the output
        projection's input instead (tfm.nn.models.output_projection)."""
        rngs = None if dropout_rng is None else {"dropout": dropout_rng}
        return model.apply(
            {"params": params},
            *(batch[key] for key in self.inputs),
            **{keyword: batch[key] for keyword, key in self.keywords},
            deterministic=deterministic,
            return_hidden=return_hidden,
            rngs=rngs,
        )

    def init(self, model: nn.Module, rng: jax.Array, batch: Mapping[str, jax.Array]) -> Any:
        """Fresh parameters for inputs shaped like `batch`'s."""
        return model.init(rng, *(batch[key] for key in self.inputs))["params"]

    def param_shapes(self, config: ModelConfig) -> Any:
        """The model's parameters as jax.ShapeDtypeStructs (jax.eval_shape: nothing is
        allocated or computed), unboxed."""
        tokens = {key: jnp.zeros((1, 1), jnp.int32) for key in self.inputs}
        model = self.model(config)
        shapes = jax.eval_shape(lambda: self.init(model, jax.random.key(0), tokens))
        return nn.meta.unbox(shapes)

    def counts(self, config: ModelConfig) -> ModelCounts:
        """Parameter, matmul-weight and attention-width counts of the model `config` builds."""
        shapes = self.param_shapes(config)
        sizes = {"params": 0, "target": 0, "source": 0, "self": 0, "cross": 0, "source_attn": 0}
        for path, leaf in traverse_util.flatten_dict(shapes).items():
            size = math.prod(leaf.shape)
            sizes["params"] += size
            if path[-1] != "kernel" or len(leaf.shape) < 2:
                continue  # embeddings, norms, biases, position tables: not matmul weights
            in_source = self.source_scope is not None and (
                path[: len(self.source_scope)] == self.source_scope)
            cross = "cross_attention" in path
            per_source = in_source or (cross and path[-2] in ("key", "value"))
            sizes["source" if per_source else "target"] += size
            if path[-2] == "query":  # [(layers,) d_model, heads, head_dim]
                width = size // config.d_model
                sizes["source_attn" if in_source else "cross" if cross else "self"] += width
        if self.output_layer and config.tie_output:
            table, _ = output_projection(shapes, config)  # the embedding, used as a matmul
            sizes["target"] += math.prod(table.shape)
        return ModelCounts(sizes["params"], sizes["target"], sizes["source"], sizes["self"],
                           sizes["cross"], sizes["source_attn"])


_PACKING = (("positions", "positions"), ("segment_ids", "segment_ids"))
FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("lm", "decoder-only language model", DecoderLM, ("inputs",), _PACKING,
               text_format="text", pair_format="prompt_answer", generator="continue",
               pair_metric="none", source_scope=None),
        Family(
            "seq2seq",
            "encoder-decoder (the paper's Transformer)",
            EncoderDecoder,
            ("source", "inputs"),
            (("source_positions", "source_positions"),
             ("source_segment_ids", "source_segment_ids"), *_PACKING),
            text_format=None, pair_format="source_target", generator="translate",
            pair_metric="bleu", source_scope=("encoder",),
        ),
        # Loaded from Hugging Face (BERT), not trained or decoded by tfm's loop.
        Family("encoder", "bidirectional encoder (BERT)", Encoder, ("source",),
               (("positions", "source_positions"), ("segment_ids", "source_segment_ids")),
               text_format=None, pair_format=None, generator=None, pair_metric="none",
               source_scope=(), output_layer=False),
    )
}


# The families tfm trains (data.mode), in one vocabulary used by data, training and generation.
MODES = tuple(name for name, family in FAMILIES.items() if family.pair_format is not None)
# What (source, target) pairs train when data.mode is unset: the paper's encoder-decoder.
DEFAULT_PAIR_MODE = "seq2seq"


def get_family(mode: str) -> Family:
    """The family called `mode` (one of FAMILIES)."""
    if mode not in FAMILIES:
        raise ConfigError(f"mode={mode!r} is unknown; choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[mode]


def family_for_data(is_text: bool, mode: str | None) -> Family:
    """The family a dataset trains: data.mode when given (checked against the records), else
    the family that reads text (for text) or DEFAULT_PAIR_MODE (for pairs)."""
    if mode is None:
        if not is_text:
            return FAMILIES[DEFAULT_PAIR_MODE]
        return next(family for family in FAMILIES.values() if family.text_format is not None)
    family = get_family(mode)
    if is_text and family.text_format is None:
        readers = ", ".join(f.name for f in FAMILIES.values() if f.text_format is not None)
        raise ConfigError(f"data.mode={mode!r} needs pairs (source and target records); text "
                          f"trains: {readers}")
    return family


def family_of(config: ModelConfig) -> Family:
    """The family whose model a config's layer counts describe (a Hugging Face checkpoint's):
    encoder and decoder layers: seq2seq; decoder only: lm; encoder only: encoder."""
    if config.num_encoder_layers and config.num_decoder_layers:
        return FAMILIES["seq2seq"]
    return FAMILIES["lm" if config.num_decoder_layers else "encoder"]
