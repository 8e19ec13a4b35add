"""GPT-2 (`GPT2LMHeadModel`): read and write. Its Conv1D weights are [in, out], like tfm
kernels, so only the head axes are split or merged."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from tfm.interop.hf.common import (
    Architecture,
    Params,
    Tensors,
    UnsupportedCheckpoint,
    dense,
    norm,
    require,
    unsupported,
)
from tfm.nn.config import ModelConfig

_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                "relu": "relu"}


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    require(hf, "scale_attn_weights", (True,), True)
    require(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
    require(hf, "add_cross_attention", (False,), False)
    activation = require(hf, "activation_function", tuple(_ACTIVATIONS))
    d_model = hf["n_embd"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        tie_output=True,
        scale_embeddings=False,
        pad_id=hf.get("pad_token_id"),
        d_model=d_model,
        num_heads=hf["n_head"],
        d_ff=hf.get("n_inner") or 4 * d_model,
        num_encoder_layers=0,
        num_decoder_layers=hf["n_layer"],
        dropout_rate=float(hf.get("resid_pdrop", 0.0)),
        position_scheme="learned",
        max_len=hf["n_positions"],
        norm_type="layernorm",
        norm_placement="pre",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation=_ACTIVATIONS[activation],
        use_bias=True,
    )


def params_from_hf(config: ModelConfig, hf: Mapping[str, Any], raw: Mapping) -> Params:
    t = Tensors(raw, ("transformer.",))
    heads, d = config.num_heads, config.d_model
    layers = {}
    for i in range(config.num_decoder_layers):
        p = f"h.{i}."
        qkv_w = np.split(t(p + "attn.c_attn.weight"), 3, axis=1)  # Conv1D: [in, out]
        qkv_b = np.split(t(p + "attn.c_attn.bias"), 3)
        attention = {
            name: dense(w.reshape(d, heads, -1), b.reshape(heads, -1))
            for name, w, b in zip(("query", "key", "value"), qkv_w, qkv_b, strict=True)
        }
        attention["out"] = dense(
            t(p + "attn.c_proj.weight").reshape(heads, -1, d), t(p + "attn.c_proj.bias")
        )
        layers[f"layer_{i}"] = {
            "self_attention": attention,
            "self_attention_norm": norm(config, t(p + "ln_1.weight"), t(p + "ln_1.bias")),
            "feed_forward": {
                "wi": dense(t(p + "mlp.c_fc.weight"), t(p + "mlp.c_fc.bias")),
                "wo": dense(t(p + "mlp.c_proj.weight"), t(p + "mlp.c_proj.bias")),
            },
            "feed_forward_norm": norm(config, t(p + "ln_2.weight"), t(p + "ln_2.bias")),
        }
    layers["final_norm"] = norm(config, t("ln_f.weight"), t("ln_f.bias"))
    return {
        "embed": {"embedding": t("wte.weight")},
        "decoder": {
            "position_embedding": {"position_embedding": t("wpe.weight")},
            "stack": layers,
        },
    }


def hf_config(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """GPT-2's config.json fields for `config`; fails on what GPT-2 cannot express (grouped or
    resized heads, missing biases)."""
    d, heads = config.d_model, config.num_heads
    if config.num_kv_heads not in (None, heads) or config.head_dim not in (None, d // heads):
        raise unsupported("num_kv_heads/head_dim", (config.num_kv_heads, config.head_dim),
                          "GPT-2 has plain multi-head attention")
    if not all(config.has_bias(g) for g in ("qkv", "attention_out", "mlp")):
        raise UnsupportedCheckpoint("GPT-2 has biases everywhere: set use_bias=True")
    return dict(
        model_type=model_type, architectures=["GPT2LMHeadModel"], vocab_size=config.vocab_size,
        n_embd=d, n_head=heads, n_layer=config.num_decoder_layers, n_positions=config.max_len,
        n_inner=config.d_ff, layer_norm_epsilon=config.norm_eps,
        activation_function="gelu_new", tie_word_embeddings=True,
        resid_pdrop=config.dropout_rate, embd_pdrop=config.dropout_rate,
        attn_pdrop=config.attention_dropout_rate, pad_token_id=config.pad_id,
    )


def _layer_tensors(layer: Params, prefix: str, d_model: int) -> dict[str, np.ndarray]:
    """One decoder layer's tensors under GPT-2's names."""
    attention, qkv = layer["self_attention"], ("query", "key", "value")
    tensors = {
        prefix + "attn.c_attn.weight": np.concatenate(
            [attention[n]["kernel"].reshape(d_model, -1) for n in qkv], axis=1),
        prefix + "attn.c_attn.bias": np.concatenate(
            [attention[n]["bias"].reshape(-1) for n in qkv]),
        prefix + "attn.c_proj.weight": attention["out"]["kernel"].reshape(-1, d_model),
        prefix + "attn.c_proj.bias": attention["out"]["bias"],
    }
    for hf_name, name in (("ln_1", "self_attention_norm"), ("ln_2", "feed_forward_norm")):
        tensors[f"{prefix}{hf_name}.weight"] = layer[name]["layer_norm"]["scale"]
        tensors[f"{prefix}{hf_name}.bias"] = layer[name]["layer_norm"]["bias"]
    for hf_name, name in (("c_fc", "wi"), ("c_proj", "wo")):
        tensors[f"{prefix}mlp.{hf_name}.weight"] = layer["feed_forward"][name]["kernel"]
        tensors[f"{prefix}mlp.{hf_name}.bias"] = layer["feed_forward"][name]["bias"]
    return tensors


def hf_tensors(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Every tensor of a GPT2LMHeadModel from unrolled float32 `params`, by Hugging Face name."""
    stack = params["decoder"]["stack"]
    tensors = {
        "transformer.wte.weight": params["embed"]["embedding"],
        "transformer.wpe.weight": params["decoder"]["position_embedding"]["position_embedding"],
    }
    for i in range(config.num_decoder_layers):
        tensors.update(_layer_tensors(stack[f"layer_{i}"], f"transformer.h.{i}.", config.d_model))
    tensors["transformer.ln_f.weight"] = stack["final_norm"]["layer_norm"]["scale"]
    tensors["transformer.ln_f.bias"] = stack["final_norm"]["layer_norm"]["bias"]
    return tensors


ARCHITECTURE = Architecture(
    name="GPT-2",
    model_types=("gpt2",),
    config=config_from_hf,
    params=params_from_hf,
    save_fields=dict(position_scheme="learned", norm_type="layernorm", norm_placement="pre",
                     activation="gelu_tanh", tie_output=True, scale_embeddings=False,
                     num_encoder_layers=0),
    save_type=lambda config: "gpt2",
    save_config=hf_config,
    save_tensors=hf_tensors,
    save_types=("gpt2",),
)
