"""The model families tfm trains, by name: what each builds from a ModelConfig and how a batch of
the data pipeline (tfm/data/pipeline.py) feeds it. Training, evaluation and FLOP counts ask the
entry instead of comparing mode names; a new family is one entry here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax

from tfm.checks import ConfigError
from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM, EncoderDecoder


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family. `inputs`: the batch keys passed positionally to the model (token ids);
    `keywords`: (model keyword, batch key) pairs passed by name (positions, packing)."""

    name: str
    description: str
    model: Callable[[ModelConfig], nn.Module]
    inputs: tuple[str, ...]
    keywords: tuple[tuple[str, str], ...]

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


_PACKING = (("positions", "positions"), ("segment_ids", "segment_ids"))
FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family("lm", "decoder-only language model", DecoderLM, ("inputs",), _PACKING),
        Family(
            "seq2seq",
            "encoder-decoder (the paper's Transformer)",
            EncoderDecoder,
            ("source", "inputs"),
            (("source_positions", "source_positions"),
             ("source_segment_ids", "source_segment_ids"), *_PACKING),
        ),
    )
}


# What a model is, in one vocabulary used by data, training and generation.
MODES = tuple(FAMILIES)


def get_family(mode: str) -> Family:
    """The family called `mode` (one of MODES)."""
    if mode not in FAMILIES:
        raise ConfigError(f"mode={mode!r} is unknown; choose one of: {', '.join(FAMILIES)}")
    return FAMILIES[mode]
