"""Llama and the models that share its layout: Mistral (a sliding window) and Qwen2 (biases on
q/k/v only). Read all three; write Llama and Qwen2."""

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
    in_heads,
    norm,
    out_heads,
    require,
    unsupported,
)
from tfm.nn.config import ModelConfig

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


def _rope_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """rope_base and the long-context scaling fields of ModelConfig (transformers 4 keeps
    them in rope_theta / rope_scaling, transformers 5 in rope_parameters). The original
    context is where Hugging Face reads it for each type: dynamic's is max_position_embeddings;
    yarn's rope_scaling.original_max_position_embeddings (else max_position_embeddings);
    longrope's the config's original_max_position_embeddings, with the factor their ratio."""
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    fields: dict[str, Any] = dict(
        rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    )
    if kind == "default":
        return fields
    if kind not in ROPE_TYPES:
        raise unsupported("rope_scaling.rope_type", kind, ", ".join(map(repr, ROPE_TYPES)))
    context = int(hf.get("max_position_embeddings", 2048))
    fields.update(rope_scaling=kind, rope_scaling_factor=float(rope.get("factor", 1.0)),
                  rope_attention_factor=float(rope.get("attention_factor") or 0.0))
    if kind == "dynamic":
        fields.update(rope_original_max_len=context)
    elif kind == "yarn":
        fields.update(
            rope_original_max_len=int(rope.get("original_max_position_embeddings") or context),
            rope_beta_fast=float(rope.get("beta_fast") or 32.0),
            rope_beta_slow=float(rope.get("beta_slow") or 1.0),
            rope_mscale=float(rope.get("mscale") or 0.0),
            rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
            rope_truncate=bool(rope.get("truncate", True)),
        )
    elif kind == "longrope":
        original = hf.get("original_max_position_embeddings") or rope.get(
            "original_max_position_embeddings")
        fields.update(
            rope_original_max_len=int(original or context),
            rope_scaling_factor=context / original if original else fields["rope_scaling_factor"],
            rope_short_factor=tuple(float(x) for x in rope["short_factor"]),
            rope_long_factor=tuple(float(x) for x in rope["long_factor"]),
        )
    elif kind == "llama3":
        fields.update(
            rope_original_max_len=int(rope["original_max_position_embeddings"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
        )
    return fields


def _sliding_window(hf: Mapping[str, Any]) -> int | None:
    """tfm's local_window (a query sees keys q - k <= window) from Mistral's or Qwen2's
    sliding window (keys q - k < sliding_window). Qwen2 windows layers from max_window_layers
    on: only a window on every layer (max_window_layers 0) has a tfm equivalent."""
    if hf["model_type"] == "qwen2" and not hf.get("use_sliding_window", False):
        return None
    if hf.get("sliding_window") is None:
        return None
    if hf["model_type"] == "qwen2" and hf.get("max_window_layers", 0) not in (0, None):
        raise unsupported("max_window_layers", hf["max_window_layers"],
                          "0 (a sliding window on every layer, as tfm's local_window)")
    return int(hf["sliding_window"]) - 1


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    model_type = hf["model_type"]
    require(hf, "hidden_act", ("silu",))
    require(hf, "pretraining_tp", (1,), 1)
    local_window = _sliding_window(hf)
    attention_bias = bool(hf.get("attention_bias", False))
    heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        tie_output=bool(hf.get("tie_word_embeddings", False)),
        scale_embeddings=False,
        pad_id=hf.get("pad_token_id"),
        d_model=hf["hidden_size"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        d_ff=hf["intermediate_size"],
        num_encoder_layers=0,
        num_decoder_layers=hf["num_hidden_layers"],
        dropout_rate=0.0,
        attention_dropout_rate=float(hf.get("attention_dropout", 0.0)),
        position_scheme="rope",
        max_len=hf.get("max_position_embeddings", 2048),
        rope_layout="rotate_half",
        **_rope_fields(hf),
        norm_type="rmsnorm",
        norm_placement="pre",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        activation="swiglu",
        use_bias=False,
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        attention_out_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(hf.get("mlp_bias", False)),
        local_window=local_window,
    )


def params_from_hf(config: ModelConfig, hf: Mapping[str, Any], raw: Mapping) -> Params:
    t = Tensors(raw)
    heads, kv_heads = config.num_heads, config.resolved_num_kv_heads
    bias = lambda name, group, shape: (
        t(name).reshape(shape) if config.has_bias(group) else None
    )
    layers = {}
    for i in range(config.num_decoder_layers):
        p = f"model.layers.{i}."
        attention = {}
        for name, hf_name, n in (("query", "q", heads), ("key", "k", kv_heads),
                                 ("value", "v", kv_heads)):
            attention[name] = dense(
                in_heads(t(f"{p}self_attn.{hf_name}_proj.weight"), n),
                bias(f"{p}self_attn.{hf_name}_proj.bias", "qkv", (n, -1)),
            )
        attention["out"] = dense(
            out_heads(t(p + "self_attn.o_proj.weight"), heads),
            bias(p + "self_attn.o_proj.bias", "attention_out", (-1,)),
        )
        mlp = lambda hf_name, p=p: dense(
            t(f"{p}mlp.{hf_name}.weight").T, bias(f"{p}mlp.{hf_name}.bias", "mlp", (-1,))
        )
        layers[f"layer_{i}"] = {
            "self_attention": attention,
            "self_attention_norm": norm(config, t(p + "input_layernorm.weight")),
            "feed_forward": {"wi": mlp("up_proj"), "wi_gate": mlp("gate_proj"),
                             "wo": mlp("down_proj")},
            "feed_forward_norm": norm(config, t(p + "post_attention_layernorm.weight")),
        }
    layers["final_norm"] = norm(config, t("model.norm.weight"))
    decoder: Params = {"stack": layers}
    if not config.tie_output:
        decoder["output_projection"] = {"kernel": t("lm_head.weight").T}
    return {"embed": {"embedding": t("model.embed_tokens.weight")}, "decoder": decoder}


# ------------------------------------------------------------------------------------- save


def save_type(config: ModelConfig) -> str:
    """llama, or qwen2 (biases on q/k/v only); else one line of what has no equivalent."""
    if config.has_bias("qkv") == config.has_bias("attention_out"):
        return "llama"  # attention_bias switches q, k, v and o together
    if config.has_bias("qkv") and not config.has_bias("mlp"):
        return "qwen2"
    raise UnsupportedCheckpoint(
        "save_pretrained: biases on the attention output but not on q/k/v have no "
        "Hugging Face Llama-family equivalent (attention_bias: all four; Qwen2: q/k/v)"
    )


def _rope_scaling_for_save(config: ModelConfig) -> dict[str, Any] | None:
    kind = config.rope_scaling
    if kind == "none":
        return None
    if kind == "ntk":
        raise unsupported("rope_scaling", "ntk", "none, linear, dynamic, yarn, longrope, llama3 "
                          "(Hugging Face has no static NTK-aware scaling)")
    scaling: dict[str, Any] = dict(rope_type=kind, factor=config.rope_scaling_factor)
    if config.rope_attention_factor:
        scaling.update(attention_factor=config.rope_attention_factor)
    if kind == "yarn":
        scaling.update(original_max_position_embeddings=config.rope_original_max_len,
                       beta_fast=config.rope_beta_fast, beta_slow=config.rope_beta_slow,
                       truncate=config.rope_truncate)
        if config.rope_mscale and config.rope_mscale_all_dim:
            scaling.update(mscale=config.rope_mscale, mscale_all_dim=config.rope_mscale_all_dim)
    elif kind == "longrope":
        scaling.update(short_factor=list(config.rope_short_factor),
                       long_factor=list(config.rope_long_factor))
    elif kind == "llama3":
        scaling.update(
            original_max_position_embeddings=config.rope_original_max_len,
            low_freq_factor=config.rope_low_freq_factor,
            high_freq_factor=config.rope_high_freq_factor,
        )
    return scaling


def _context_fields(config: ModelConfig) -> dict[str, Any]:
    """max_position_embeddings (and longrope's original_max_position_embeddings) as Hugging
    Face reads the original context of each scaling back."""
    if config.rope_scaling == "dynamic":
        return dict(max_position_embeddings=config.rope_original_max_len)
    if config.rope_scaling == "longrope":
        return dict(
            max_position_embeddings=round(
                config.rope_scaling_factor * config.rope_original_max_len),
            original_max_position_embeddings=config.rope_original_max_len,
        )
    return dict(max_position_embeddings=config.max_len)


def hf_config(config: ModelConfig, model_type: str) -> dict[str, Any]:
    """The config.json fields of a Llama or Qwen2 (`model_type`) model for `config`."""
    return dict(
        model_type=model_type, vocab_size=config.vocab_size,
        architectures=["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
        hidden_size=config.d_model, intermediate_size=config.d_ff,
        num_attention_heads=config.num_heads, num_key_value_heads=config.resolved_num_kv_heads,
        head_dim=config.resolved_head_dim, num_hidden_layers=config.num_decoder_layers,
        **_context_fields(config), rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_base, hidden_act="silu",
        rope_scaling=_rope_scaling_for_save(config),
        tie_word_embeddings=config.tie_output, attention_bias=config.has_bias("qkv"),
        mlp_bias=config.has_bias("mlp"), pad_token_id=config.pad_id,
        attention_dropout=config.attention_dropout_rate,
    )


def _layer_tensors(layer: Params, prefix: str, d_model: int) -> dict[str, np.ndarray]:
    """One decoder layer's tensors under Llama's names: Linear weights are [out, in], so the
    kernels are transposed; biases only where the layer has them."""
    attention, tensors = layer["self_attention"], {}
    for name, hf_name in (("query", "q"), ("key", "k"), ("value", "v")):
        kernel = attention[name]["kernel"].reshape(d_model, -1)
        tensors[f"{prefix}self_attn.{hf_name}_proj.weight"] = kernel.T
        if "bias" in attention[name]:
            tensors[f"{prefix}self_attn.{hf_name}_proj.bias"] = attention[name]["bias"].reshape(-1)
    tensors[prefix + "self_attn.o_proj.weight"] = attention["out"]["kernel"].reshape(-1, d_model).T
    if "bias" in attention["out"]:
        tensors[prefix + "self_attn.o_proj.bias"] = attention["out"]["bias"]
    for name, hf_name in (("wi", "up_proj"), ("wi_gate", "gate_proj"), ("wo", "down_proj")):
        layer_dense = layer["feed_forward"][name]
        tensors[f"{prefix}mlp.{hf_name}.weight"] = layer_dense["kernel"].T
        if "bias" in layer_dense:
            tensors[f"{prefix}mlp.{hf_name}.bias"] = layer_dense["bias"]
    for hf_name, name in (("input_layernorm", "self_attention_norm"),
                          ("post_attention_layernorm", "feed_forward_norm")):
        tensors[f"{prefix}{hf_name}.weight"] = layer[name]["rms_norm"]["scale"]
    return tensors


def hf_tensors(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Every tensor of a Llama-family causal LM from unrolled float32 `params`, by Hugging Face
    name (lm_head only when the output is not tied to the embedding)."""
    stack = params["decoder"]["stack"]
    tensors = {"model.embed_tokens.weight": params["embed"]["embedding"]}
    for i in range(config.num_decoder_layers):
        tensors.update(_layer_tensors(stack[f"layer_{i}"], f"model.layers.{i}.", config.d_model))
    tensors["model.norm.weight"] = stack["final_norm"]["rms_norm"]["scale"]
    if not config.tie_output:
        tensors["lm_head.weight"] = params["decoder"]["output_projection"]["kernel"].T
    return tensors


ARCHITECTURE = Architecture(
    name="Llama",
    model_types=("llama", "mistral", "qwen2"),
    config=config_from_hf,
    params=params_from_hf,
    save_fields=dict(position_scheme="rope", rope_layout="rotate_half", rope_fraction=1.0,
                     norm_type="rmsnorm", norm_placement="pre", activation="swiglu",
                     scale_embeddings=False, num_encoder_layers=0, local_window=None),
    save_type=save_type,
    save_config=hf_config,
    save_tensors=hf_tensors,
    save_types=("llama", "qwen2"),
)
