"""T5 (v1.0 and v1.1, `T5ForConditionalGeneration`): read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tfm.interop.hf.common import (
    Architecture,
    Params,
    Tensors,
    in_heads,
    norm,
    out_heads,
    require,
)
from tfm.nn.config import ModelConfig

_ACTIVATIONS = {"relu": "relu", "gated-gelu": "geglu"}


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    activation = require(hf, "feed_forward_proj", tuple(_ACTIVATIONS), "relu")
    if activation == "gated-gelu":
        require(hf, "dense_act_fn", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
    tied = bool(hf.get("tie_word_embeddings", True))
    scaled = tied and hf.get("scale_decoder_outputs", True)
    layers = hf["num_layers"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        share_embeddings=True,
        tie_output=tied,
        scale_embeddings=False,
        pad_id=hf.get("pad_token_id", 0),
        d_model=hf["d_model"],
        num_heads=hf["num_heads"],
        head_dim=hf["d_kv"],
        d_ff=hf["d_ff"],
        num_encoder_layers=layers,
        num_decoder_layers=hf.get("num_decoder_layers") or layers,
        dropout_rate=float(hf.get("dropout_rate", 0.0)),
        position_scheme="t5_bias",
        t5_num_buckets=hf.get("relative_attention_num_buckets", 32),
        t5_max_distance=hf.get("relative_attention_max_distance", 128),
        t5_shared_across_layers=True,
        norm_type="rmsnorm",
        norm_placement="pre",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-6)),
        activation=_ACTIVATIONS[activation],
        use_bias=False,
        attention_scale=1.0,  # T5 folds 1/sqrt(d_kv) into its initialisation
        output_scale=hf["d_model"] ** -0.5 if scaled else None,
    )


def params_from_hf(config: ModelConfig, hf: Mapping[str, Any], raw: Mapping) -> Params:
    t = Tensors(raw)
    heads = config.num_heads

    def attention(prefix: str) -> Params:
        qkv = {name: {"kernel": in_heads(t(f"{prefix}.{hf_name}.weight"), heads)}
               for name, hf_name in (("query", "q"), ("key", "k"), ("value", "v"))}
        return {**qkv, "out": {"kernel": out_heads(t(f"{prefix}.o.weight"), heads)}}

    def feed_forward(prefix: str) -> Params:
        if config.activation == "geglu":
            return {"wi": {"kernel": t(f"{prefix}.wi_1.weight").T},
                    "wi_gate": {"kernel": t(f"{prefix}.wi_0.weight").T},
                    "wo": {"kernel": t(f"{prefix}.wo.weight").T}}
        return {"wi": {"kernel": t(f"{prefix}.wi.weight").T},
                "wo": {"kernel": t(f"{prefix}.wo.weight").T}}

    def stack(side: str, num_layers: int) -> Params:
        layers: Params = {}
        for i in range(num_layers):
            p = f"{side}.block.{i}.layer"
            layer = {
                "self_attention": attention(f"{p}.0.SelfAttention"),
                "self_attention_norm": norm(config, t(f"{p}.0.layer_norm.weight")),
            }
            ff = 1
            if side == "decoder":
                layer["cross_attention"] = attention(f"{p}.1.EncDecAttention")
                layer["cross_attention_norm"] = norm(config, t(f"{p}.1.layer_norm.weight"))
                ff = 2
            layer["feed_forward"] = feed_forward(f"{p}.{ff}.DenseReluDense")
            layer["feed_forward_norm"] = norm(config, t(f"{p}.{ff}.layer_norm.weight"))
            layers[f"layer_{i}"] = layer
        layers["final_norm"] = norm(config, t(f"{side}.final_layer_norm.weight"))
        bias = t(f"{side}.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
        return {"position_bias": {"t5_bias_table": bias}, "stack": layers}

    decoder = stack("decoder", config.num_decoder_layers)
    if not config.tie_output:
        decoder["output_projection"] = {"kernel": t("lm_head.weight").T}
    return {
        "embed": {"embedding": t("shared.weight", "encoder.embed_tokens.weight")},
        "encoder": stack("encoder", config.num_encoder_layers),
        "decoder": decoder,
    }


ARCHITECTURE = Architecture(name="T5", model_types=("t5",), config=config_from_hf,
                            params=params_from_hf)
