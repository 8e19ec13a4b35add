"""BERT (the encoder, `BertModel` or the encoder of its task heads): read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tfm.interop.hf.common import (
    Architecture,
    Params,
    Tensors,
    dense,
    in_heads,
    norm,
    out_heads,
    require,
)
from tfm.nn.config import ModelConfig

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu"}


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    require(hf, "position_embedding_type", ("absolute",), "absolute")
    require(hf, "is_decoder", (False,), False)
    activation = require(hf, "hidden_act", tuple(_ACTIVATIONS))
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        tie_output=False,
        scale_embeddings=False,
        pad_id=hf.get("pad_token_id"),
        type_vocab_size=hf.get("type_vocab_size", 2),
        embedding_norm=True,
        d_model=hf["hidden_size"],
        num_heads=hf["num_attention_heads"],
        d_ff=hf["intermediate_size"],
        num_encoder_layers=hf["num_hidden_layers"],
        num_decoder_layers=0,
        dropout_rate=float(hf.get("hidden_dropout_prob", 0.0)),
        position_scheme="learned",
        max_len=hf["max_position_embeddings"],
        norm_type="layernorm",
        norm_placement="post",
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
        activation=_ACTIVATIONS[activation],
        use_bias=True,
    )


def params_from_hf(config: ModelConfig, hf: Mapping[str, Any], raw: Mapping) -> Params:
    t = Tensors(raw, ("bert.",))
    heads = config.num_heads

    def layer_norm(prefix: str) -> Params:
        return norm(config, t(prefix + ".weight", prefix + ".gamma"),
                    t(prefix + ".bias", prefix + ".beta"))

    layers = {}
    for i in range(config.num_encoder_layers):
        p = f"encoder.layer.{i}."
        attention = {
            name: dense(in_heads(t(f"{p}attention.self.{name}.weight"), heads),
                        t(f"{p}attention.self.{name}.bias").reshape(heads, -1))
            for name in ("query", "key", "value")
        }
        attention["out"] = dense(out_heads(t(p + "attention.output.dense.weight"), heads),
                                 t(p + "attention.output.dense.bias"))
        layers[f"layer_{i}"] = {
            "self_attention": attention,
            "self_attention_norm": layer_norm(p + "attention.output.LayerNorm"),
            "feed_forward": {
                "wi": dense(t(p + "intermediate.dense.weight").T, t(p + "intermediate.dense.bias")),
                "wo": dense(t(p + "output.dense.weight").T, t(p + "output.dense.bias")),
            },
            "feed_forward_norm": layer_norm(p + "output.LayerNorm"),
        }
    return {
        "embed": {"embedding": t("embeddings.word_embeddings.weight")},
        "position_embedding": {"position_embedding": t("embeddings.position_embeddings.weight")},
        "token_type_embedding": t("embeddings.token_type_embeddings.weight"),
        "embedding_norm": layer_norm("embeddings.LayerNorm"),
        "stack": layers,
    }


ARCHITECTURE = Architecture(name="BERT", model_types=("bert",), config=config_from_hf,
                            params=params_from_hf)
