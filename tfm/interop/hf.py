"""Load and save Hugging Face checkpoints: GPT-2, Llama (and Mistral, Qwen2), T5 (v1.0, v1.1),
BERT (the encoder).

`load_pretrained(directory) -> (ModelConfig, params)` reads a local Hugging Face model folder
(`config.json` plus `model.safetensors`, sharded safetensors, or `pytorch_model.bin`) with
safetensors' numpy API: no torch is needed (except for `.bin` files). `params` are plain numpy
arrays in the unrolled layout of `model_for(config)` (`tfm.nn.models.stack_layer_params` converts
them for `scan_layers=True`). `save_pretrained(config, params, directory)` writes GPT-2 and
Llama-family configs back, so a tfm-trained model opens in Hugging Face tools.

Anything the mapping cannot express fails with one line naming the field, its value and what
is supported, before any weight is read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tfm.data.tokenizers import HFTokenizer
from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM, Encoder, EncoderDecoder

Params = dict[str, Any]
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "t5", "bert")
SAVE_FAMILIES = ("gpt2", "llama", "qwen2")


class UnsupportedCheckpoint(ValueError):
    """The checkpoint uses an architecture or a field value that tfm cannot express."""


class UnreadableCheckpoint(ValueError):
    """A weights file of the folder cannot be read (truncated, or not what its name says)."""


def _unsupported(field: str, value: Any, supported: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(
        f"Hugging Face config field {field}={value!r} is not supported; supported: {supported}"
    )


def _require(hf: Mapping[str, Any], field: str, allowed: tuple, default: Any = None) -> Any:
    value = hf.get(field, default)
    if value not in allowed:
        raise _unsupported(field, value, ", ".join(map(repr, allowed)))
    return value


# --------------------------------------------------------------------------------- reading


def read_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a Hugging Face model folder has config.json")
    return json.loads(path.read_text())


def _read_safetensors(path: Path) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(path)
    except SafetensorError as error:
        raise UnreadableCheckpoint(
            f"{path.name} in {path.parent} is unreadable (truncated or not a safetensors "
            f"file): {error}"
        ) from None


def read_tensors(directory: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder as float32 numpy arrays, by Hugging Face name."""
    directory = Path(directory)
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        tensors = _read_safetensors(single)
    elif index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        tensors = {}
        for shard in shards:
            tensors.update(_read_safetensors(directory / shard))
    elif (directory / "pytorch_model.bin").is_file():
        try:
            import torch
        except ImportError as error:
            raise UnsupportedCheckpoint(
                f"{directory}/pytorch_model.bin needs torch to read; convert it to "
                "model.safetensors or install torch"
            ) from error
        state = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
        tensors = {k: v.float().numpy() for k, v in state.items()}
    else:
        raise FileNotFoundError(
            f"{directory} holds no weights: expected model.safetensors, "
            "model.safetensors.index.json or pytorch_model.bin"
        )
    return {k: np.asarray(v, np.float32) for k, v in tensors.items()}


class _Tensors:
    """Name -> array lookup that strips known prefixes and reports missing names clearly."""

    def __init__(self, tensors: Mapping[str, np.ndarray], prefixes: tuple[str, ...] = ()):
        self.tensors = {}
        for name, value in tensors.items():
            for prefix in prefixes:
                if name.startswith(prefix):
                    name = name[len(prefix) :]
                    break
            self.tensors[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str, *alternatives: str) -> np.ndarray:
        for candidate in (name, *alternatives):
            if candidate in self.tensors:
                return self.tensors[candidate]
        raise UnsupportedCheckpoint(f"the checkpoint has no tensor {name!r}")


# Hugging Face Linear weights are [out, in]; tfm kernels are [in, *out] / [*in, out].
def _in_heads(weight: np.ndarray, heads: int) -> np.ndarray:  # [heads*hd, d] -> [d, heads, hd]
    return weight.T.reshape(weight.shape[1], heads, -1)


def _out_heads(weight: np.ndarray, heads: int) -> np.ndarray:  # [d, heads*hd] -> [heads, hd, d]
    return weight.T.reshape(heads, -1, weight.shape[0])


def _norm(config: ModelConfig, scale: np.ndarray, bias: np.ndarray | None = None) -> Params:
    if config.norm_type == "rmsnorm":
        return {"rms_norm": {"scale": scale}}
    return {"layer_norm": {"scale": scale, "bias": bias}}


def _dense(kernel: np.ndarray, bias: np.ndarray | None) -> Params:
    return {"kernel": kernel} if bias is None else {"kernel": kernel, "bias": bias}


# ------------------------------------------------------------------------------------ GPT-2

_GPT2_ACTIVATIONS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
                     "relu": "relu"}


def _gpt2_config(hf: Mapping[str, Any]) -> ModelConfig:
    _require(hf, "scale_attn_weights", (True,), True)
    _require(hf, "scale_attn_by_inverse_layer_idx", (False,), False)
    _require(hf, "add_cross_attention", (False,), False)
    activation = _require(hf, "activation_function", tuple(_GPT2_ACTIVATIONS))
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
        activation=_GPT2_ACTIVATIONS[activation],
        use_bias=True,
    )


def _gpt2_params(config: ModelConfig, hf: Mapping[str, Any], raw: Mapping) -> Params:
    t = _Tensors(raw, ("transformer.",))
    heads, d = config.num_heads, config.d_model
    layers = {}
    for i in range(config.num_decoder_layers):
        p = f"h.{i}."
        qkv_w = np.split(t(p + "attn.c_attn.weight"), 3, axis=1)  # Conv1D: [in, out]
        qkv_b = np.split(t(p + "attn.c_attn.bias"), 3)
        attention = {
            name: _dense(w.reshape(d, heads, -1), b.reshape(heads, -1))
            for name, w, b in zip(("query", "key", "value"), qkv_w, qkv_b, strict=True)
        }
        attention["out"] = _dense(
            t(p + "attn.c_proj.weight").reshape(heads, -1, d), t(p + "attn.c_proj.bias")
        )
        layers[f"layer_{i}"] = {
            "self_attention": attention,
            "self_attention_norm": _norm(config, t(p + "ln_1.weight"), t(p + "ln_1.bias")),
            "feed_forward": {
                "wi": _dense(t(p + "mlp.c_fc.weight"), t(p + "mlp.c_fc.bias")),
                "wo": _dense(t(p + "mlp.c_proj.weight"), t(p + "mlp.c_proj.bias")),
            },
            "feed_forward_norm": _norm(config, t(p + "ln_2.weight"), t(p + "ln_2.bias")),
        }
    layers["final_norm"] = _norm(config, t("ln_f.weight"), t("ln_f.bias"))
    return {
        "embed": {"embedding": t("wte.weight")},
        "decoder": {
            "position_embedding": {"position_embedding": t("wpe.weight")},
            "stack": layers,
        },
    }


# ------------------------------------------------------------------ Llama, Mistral, Qwen2


def _rope_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """rope_base and the long-context scaling fields of ModelConfig (transformers 4 keeps
    them in rope_theta / rope_scaling, transformers 5 in rope_parameters)."""
    rope = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    fields: dict[str, Any] = dict(
        rope_base=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    )
    if kind == "default":
        return fields
    if kind not in ("linear", "llama3"):
        raise _unsupported("rope_scaling.rope_type", kind, "'default', 'linear', 'llama3'")
    fields.update(rope_scaling=kind, rope_scaling_factor=float(rope["factor"]))
    if kind == "llama3":
        fields.update(
            rope_original_max_len=int(rope["original_max_position_embeddings"]),
            rope_low_freq_factor=float(rope["low_freq_factor"]),
            rope_high_freq_factor=float(rope["high_freq_factor"]),
        )
    return fields


def _llama_config(hf: Mapping[str, Any]) -> ModelConfig:
    model_type = hf["model_type"]
    _require(hf, "hidden_act", ("silu",))
    _require(hf, "pretraining_tp", (1,), 1)
    local_window = None
    if model_type == "mistral" and hf.get("sliding_window") is not None:
        local_window = int(hf["sliding_window"]) - 1  # HF: a query sees keys q - k < window
    if model_type == "qwen2":
        _require(hf, "use_sliding_window", (False,), False)
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


def _llama_params(config: ModelConfig, hf: Mapping[str, Any], raw: Mapping) -> Params:
    t = _Tensors(raw)
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
            attention[name] = _dense(
                _in_heads(t(f"{p}self_attn.{hf_name}_proj.weight"), n),
                bias(f"{p}self_attn.{hf_name}_proj.bias", "qkv", (n, -1)),
            )
        attention["out"] = _dense(
            _out_heads(t(p + "self_attn.o_proj.weight"), heads),
            bias(p + "self_attn.o_proj.bias", "attention_out", (-1,)),
        )
        mlp = lambda hf_name, p=p: _dense(
            t(f"{p}mlp.{hf_name}.weight").T, bias(f"{p}mlp.{hf_name}.bias", "mlp", (-1,))
        )
        layers[f"layer_{i}"] = {
            "self_attention": attention,
            "self_attention_norm": _norm(config, t(p + "input_layernorm.weight")),
            "feed_forward": {"wi": mlp("up_proj"), "wi_gate": mlp("gate_proj"),
                             "wo": mlp("down_proj")},
            "feed_forward_norm": _norm(config, t(p + "post_attention_layernorm.weight")),
        }
    layers["final_norm"] = _norm(config, t("model.norm.weight"))
    decoder: Params = {"stack": layers}
    if not config.tie_output:
        decoder["output_projection"] = {"kernel": t("lm_head.weight").T}
    return {"embed": {"embedding": t("model.embed_tokens.weight")}, "decoder": decoder}


# --------------------------------------------------------------------------------------- T5

_T5_ACTIVATIONS = {"relu": "relu", "gated-gelu": "geglu"}


def _t5_config(hf: Mapping[str, Any]) -> ModelConfig:
    activation = _require(hf, "feed_forward_proj", tuple(_T5_ACTIVATIONS), "relu")
    if activation == "gated-gelu":
        _require(hf, "dense_act_fn", ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
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
        activation=_T5_ACTIVATIONS[activation],
        use_bias=False,
        attention_scale=1.0,  # T5 folds 1/sqrt(d_kv) into its initialisation
        output_scale=hf["d_model"] ** -0.5 if scaled else None,
    )


def _t5_params(config: ModelConfig, hf: Mapping[str, Any], raw: Mapping) -> Params:
    t = _Tensors(raw)
    heads = config.num_heads

    def attention(prefix: str) -> Params:
        qkv = {name: {"kernel": _in_heads(t(f"{prefix}.{hf_name}.weight"), heads)}
               for name, hf_name in (("query", "q"), ("key", "k"), ("value", "v"))}
        return {**qkv, "out": {"kernel": _out_heads(t(f"{prefix}.o.weight"), heads)}}

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
                "self_attention_norm": _norm(config, t(f"{p}.0.layer_norm.weight")),
            }
            ff = 1
            if side == "decoder":
                layer["cross_attention"] = attention(f"{p}.1.EncDecAttention")
                layer["cross_attention_norm"] = _norm(config, t(f"{p}.1.layer_norm.weight"))
                ff = 2
            layer["feed_forward"] = feed_forward(f"{p}.{ff}.DenseReluDense")
            layer["feed_forward_norm"] = _norm(config, t(f"{p}.{ff}.layer_norm.weight"))
            layers[f"layer_{i}"] = layer
        layers["final_norm"] = _norm(config, t(f"{side}.final_layer_norm.weight"))
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


# ------------------------------------------------------------------------------------- BERT


def _bert_config(hf: Mapping[str, Any]) -> ModelConfig:
    _require(hf, "position_embedding_type", ("absolute",), "absolute")
    _require(hf, "is_decoder", (False,), False)
    activation = _require(hf, "hidden_act", ("gelu", "gelu_new", "relu"))
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
        activation={"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu"}[activation],
        use_bias=True,
    )


def _bert_params(config: ModelConfig, hf: Mapping[str, Any], raw: Mapping) -> Params:
    t = _Tensors(raw, ("bert.",))
    heads = config.num_heads

    def norm(prefix: str) -> Params:
        return _norm(config, t(prefix + ".weight", prefix + ".gamma"),
                     t(prefix + ".bias", prefix + ".beta"))

    layers = {}
    for i in range(config.num_encoder_layers):
        p = f"encoder.layer.{i}."
        attention = {
            name: _dense(_in_heads(t(f"{p}attention.self.{name}.weight"), heads),
                         t(f"{p}attention.self.{name}.bias").reshape(heads, -1))
            for name in ("query", "key", "value")
        }
        attention["out"] = _dense(_out_heads(t(p + "attention.output.dense.weight"), heads),
                                  t(p + "attention.output.dense.bias"))
        layers[f"layer_{i}"] = {
            "self_attention": attention,
            "self_attention_norm": norm(p + "attention.output.LayerNorm"),
            "feed_forward": {
                "wi": _dense(
                    t(p + "intermediate.dense.weight").T, t(p + "intermediate.dense.bias")
                ),
                "wo": _dense(t(p + "output.dense.weight").T, t(p + "output.dense.bias")),
            },
            "feed_forward_norm": norm(p + "output.LayerNorm"),
        }
    return {
        "embed": {"embedding": t("embeddings.word_embeddings.weight")},
        "position_embedding": {"position_embedding": t("embeddings.position_embeddings.weight")},
        "token_type_embedding": t("embeddings.token_type_embeddings.weight"),
        "embedding_norm": norm("embeddings.LayerNorm"),
        "stack": layers,
    }


_LOADERS: dict[str, tuple[Callable, Callable]] = {
    "gpt2": (_gpt2_config, _gpt2_params),
    "llama": (_llama_config, _llama_params),
    "mistral": (_llama_config, _llama_params),
    "qwen2": (_llama_config, _llama_params),
    "t5": (_t5_config, _t5_params),
    "bert": (_bert_config, _bert_params),
}


def config_from_hf(hf: Mapping[str, Any]) -> ModelConfig:
    """The tfm ModelConfig of a Hugging Face config.json; unsupported fields raise one line."""
    model_type = hf.get("model_type")
    if model_type not in _LOADERS:
        raise _unsupported("model_type", model_type, ", ".join(FAMILIES))
    return _LOADERS[model_type][0](hf)


def load_pretrained(directory: str | Path) -> tuple[ModelConfig, Params]:
    """(ModelConfig, params) of a local Hugging Face model folder; see the module docstring."""
    hf = read_config(directory)
    config = config_from_hf(hf)
    params = _LOADERS[hf["model_type"]][1](config, hf, read_tensors(directory))
    return config, params


def model_for(config: ModelConfig) -> Any:
    """The tfm module a loaded config describes: DecoderLM, EncoderDecoder or Encoder."""
    if config.num_encoder_layers and config.num_decoder_layers:
        return EncoderDecoder(config)
    if config.num_decoder_layers:
        return DecoderLM(config)
    return Encoder(config)


def load_tokenizer(directory: str | Path) -> HFTokenizer | None:
    """The folder's `tokenizer.json` as the data pipeline's HFTokenizer (the same ids and special
    tokens as data.tokenizer="hf:DIR"), or None when the folder has none."""
    if not (Path(directory) / "tokenizer.json").is_file():
        return None
    try:
        return HFTokenizer.load(directory)
    except ValueError as error:
        raise UnsupportedCheckpoint(str(error)) from None


# ---------------------------------------------------------------------- torch.nn.Transformer


def load_torch_transformer(
    path: str | Path,
    num_heads: int,
    *,
    norm_first: bool = False,
    activation: str = "relu",
    norm_eps: float = 1e-5,
    position_scheme: str = "sinusoidal",
) -> tuple[ModelConfig, Params]:
    """(ModelConfig, params) of a `torch.nn.Transformer` saved as safetensors: its state dict
    under `transformer.` and the shared token embedding as `embedding.weight` (scaled by
    sqrt(d_model), tied to the output). The state dict does not say the head count, the
    activation, norm_first or the positions added to the embeddings: pass them. Final encoder
    and decoder norms (torch's default) are loaded when present, also after post-LN."""
    from safetensors.numpy import load_file

    t = _Tensors({k: np.asarray(v, np.float32) for k, v in load_file(str(path)).items()},
                 ("transformer.",))
    count = lambda side: len(
        {k.split(".")[2] for k in t.tensors if k.startswith(f"{side}.layers.")}
    )
    embedding = t("embedding.weight")
    d_model = embedding.shape[1]
    final = "encoder.norm.weight" in t
    if final != ("decoder.norm.weight" in t):
        raise UnsupportedCheckpoint("encoder.norm and decoder.norm must be both present or both "
                                    "absent (tfm's final_norm applies to both stacks)")
    config = ModelConfig(
        vocab_size=embedding.shape[0], share_embeddings=True, tie_output=True,
        scale_embeddings=True, pad_id=None, d_model=d_model, num_heads=num_heads,
        d_ff=t("encoder.layers.0.linear1.weight").shape[0],
        num_encoder_layers=count("encoder"), num_decoder_layers=count("decoder"),
        dropout_rate=0.0, position_scheme=position_scheme, norm_type="layernorm",
        norm_placement="pre" if norm_first else "post", final_norm=final, norm_eps=norm_eps,
        activation=activation, use_bias=True,
    )

    def attention(prefix: str) -> Params:
        weights = np.split(t(prefix + ".in_proj_weight"), 3)
        biases = np.split(t(prefix + ".in_proj_bias"), 3)
        out = {name: _dense(_in_heads(w, num_heads), b.reshape(num_heads, -1))
               for name, w, b in zip(("query", "key", "value"), weights, biases, strict=True)}
        out["out"] = _dense(_out_heads(t(prefix + ".out_proj.weight"), num_heads),
                            t(prefix + ".out_proj.bias"))
        return out

    def norm(prefix: str) -> Params:
        return _norm(config, t(prefix + ".weight"), t(prefix + ".bias"))

    def stack(side: str, num_layers: int) -> Params:
        layers: Params = {}
        for i in range(num_layers):
            p = f"{side}.layers.{i}"
            layer = {"self_attention": attention(p + ".self_attn"),
                     "self_attention_norm": norm(p + ".norm1")}
            ff_norm = "norm2"
            if side == "decoder":
                layer["cross_attention"] = attention(p + ".multihead_attn")
                layer["cross_attention_norm"] = norm(p + ".norm2")
                ff_norm = "norm3"
            layer["feed_forward"] = {
                "wi": _dense(t(p + ".linear1.weight").T, t(p + ".linear1.bias")),
                "wo": _dense(t(p + ".linear2.weight").T, t(p + ".linear2.bias")),
            }
            layer["feed_forward_norm"] = norm(f"{p}.{ff_norm}")
            layers[f"layer_{i}"] = layer
        if final:
            layers["final_norm"] = norm(f"{side}.norm")
        return {"stack": layers}

    params = {"embed": {"embedding": embedding},
              "encoder": stack("encoder", config.num_encoder_layers),
              "decoder": stack("decoder", config.num_decoder_layers)}
    return config, params


# ------------------------------------------------------------------------------------- save


def _unstack(params: Params, num_layers: int) -> Params:
    """The unrolled layout of `params` (undoes nn.scan's stacked "layers")."""
    stack = dict(params["decoder"]["stack"])
    if "layers" in stack:
        stacked = stack.pop("layers")
        import jax

        for i in range(num_layers):
            stack[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return {**params, "decoder": {**params["decoder"], "stack": stack}}


def _family_for_save(config: ModelConfig) -> str:
    """gpt2, llama, or qwen2 (Llama with biases on q/k/v only); else one line of what differs."""
    gpt2 = dict(position_scheme="learned", norm_type="layernorm", norm_placement="pre",
                activation="gelu_tanh", tie_output=True, scale_embeddings=False,
                num_encoder_layers=0)
    llama = dict(position_scheme="rope", rope_layout="rotate_half", rope_fraction=1.0,
                 norm_type="rmsnorm", norm_placement="pre", activation="swiglu",
                 scale_embeddings=False, num_encoder_layers=0, local_window=None)
    for family, wanted in (("gpt2", gpt2), ("llama", llama)):
        if all(getattr(config, k) == v for k, v in wanted.items()):
            if family == "gpt2":
                return family
            if config.has_bias("qkv") == config.has_bias("attention_out"):
                return "llama"  # attention_bias switches q, k, v and o together
            if config.has_bias("qkv") and not config.has_bias("mlp"):
                return "qwen2"
            raise UnsupportedCheckpoint(
                "save_pretrained: biases on the attention output but not on q/k/v have no "
                "Hugging Face Llama-family equivalent (attention_bias: all four; Qwen2: q/k/v)"
            )
    differences = {
        family: [f"{k}={getattr(config, k)!r} (needs {v!r})" for k, v in wanted.items()
                 if getattr(config, k) != v]
        for family, wanted in (("gpt2", gpt2), ("llama", llama))
    }
    raise UnsupportedCheckpoint(
        "save_pretrained writes GPT-2 or Llama configs only; this config differs from GPT-2 in "
        f"{', '.join(differences['gpt2'])} and from Llama in {', '.join(differences['llama'])}"
    )


def _rope_scaling_for_save(config: ModelConfig) -> dict[str, Any] | None:
    if config.rope_scaling == "none":
        return None
    if config.rope_scaling == "ntk":
        raise _unsupported("rope_scaling", "ntk", "none, linear, llama3 (Hugging Face has no "
                           "static NTK-aware scaling)")
    scaling = dict(rope_type=config.rope_scaling, factor=config.rope_scaling_factor)
    if config.rope_scaling == "llama3":
        scaling.update(
            original_max_position_embeddings=config.rope_original_max_len,
            low_freq_factor=config.rope_low_freq_factor,
            high_freq_factor=config.rope_high_freq_factor,
        )
    return scaling


def _gpt2_hf_config(config: ModelConfig) -> dict[str, Any]:
    """GPT-2's config.json fields for `config`; fails on what GPT-2 cannot express (grouped or
    resized heads, missing biases)."""
    d, heads = config.d_model, config.num_heads
    if config.num_kv_heads not in (None, heads) or config.head_dim not in (None, d // heads):
        raise _unsupported("num_kv_heads/head_dim", (config.num_kv_heads, config.head_dim),
                           "GPT-2 has plain multi-head attention")
    if not all(config.has_bias(g) for g in ("qkv", "attention_out", "mlp")):
        raise UnsupportedCheckpoint("GPT-2 has biases everywhere: set use_bias=True")
    return dict(
        model_type="gpt2", architectures=["GPT2LMHeadModel"], vocab_size=config.vocab_size,
        n_embd=d, n_head=heads, n_layer=config.num_decoder_layers, n_positions=config.max_len,
        n_inner=config.d_ff, layer_norm_epsilon=config.norm_eps,
        activation_function="gelu_new", tie_word_embeddings=True,
        resid_pdrop=config.dropout_rate, embd_pdrop=config.dropout_rate,
        attn_pdrop=config.attention_dropout_rate, pad_token_id=config.pad_id,
    )


def _gpt2_layer_tensors(layer: Params, prefix: str, d_model: int) -> dict[str, np.ndarray]:
    """One decoder layer's tensors under GPT-2's names (its Conv1D weights are [in, out], like
    tfm kernels, so only the head axes are merged)."""
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


def _gpt2_hf_tensors(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Every tensor of a GPT2LMHeadModel from unrolled float32 `params`, by Hugging Face name."""
    stack = params["decoder"]["stack"]
    tensors = {
        "transformer.wte.weight": params["embed"]["embedding"],
        "transformer.wpe.weight": params["decoder"]["position_embedding"]["position_embedding"],
    }
    for i in range(config.num_decoder_layers):
        tensors.update(
            _gpt2_layer_tensors(stack[f"layer_{i}"], f"transformer.h.{i}.", config.d_model)
        )
    tensors["transformer.ln_f.weight"] = stack["final_norm"]["layer_norm"]["scale"]
    tensors["transformer.ln_f.bias"] = stack["final_norm"]["layer_norm"]["bias"]
    return tensors


def _llama_hf_config(config: ModelConfig, family: str) -> dict[str, Any]:
    """The config.json fields of a Llama or Qwen2 (`family`) model for `config`."""
    return dict(
        model_type=family, vocab_size=config.vocab_size,
        architectures=["Qwen2ForCausalLM" if family == "qwen2" else "LlamaForCausalLM"],
        hidden_size=config.d_model, intermediate_size=config.d_ff,
        num_attention_heads=config.num_heads, num_key_value_heads=config.resolved_num_kv_heads,
        head_dim=config.resolved_head_dim, num_hidden_layers=config.num_decoder_layers,
        max_position_embeddings=config.max_len, rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_base, hidden_act="silu",
        rope_scaling=_rope_scaling_for_save(config),
        tie_word_embeddings=config.tie_output, attention_bias=config.has_bias("qkv"),
        mlp_bias=config.has_bias("mlp"), pad_token_id=config.pad_id,
        attention_dropout=config.attention_dropout_rate,
    )


def _llama_layer_tensors(layer: Params, prefix: str, d_model: int) -> dict[str, np.ndarray]:
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
        dense = layer["feed_forward"][name]
        tensors[f"{prefix}mlp.{hf_name}.weight"] = dense["kernel"].T
        if "bias" in dense:
            tensors[f"{prefix}mlp.{hf_name}.bias"] = dense["bias"]
    for hf_name, name in (("input_layernorm", "self_attention_norm"),
                          ("post_attention_layernorm", "feed_forward_norm")):
        tensors[f"{prefix}{hf_name}.weight"] = layer[name]["rms_norm"]["scale"]
    return tensors


def _llama_hf_tensors(config: ModelConfig, params: Params) -> dict[str, np.ndarray]:
    """Every tensor of a Llama-family causal LM from unrolled float32 `params`, by Hugging Face
    name (lm_head only when the output is not tied to the embedding)."""
    stack = params["decoder"]["stack"]
    tensors = {"model.embed_tokens.weight": params["embed"]["embedding"]}
    for i in range(config.num_decoder_layers):
        tensors.update(
            _llama_layer_tensors(stack[f"layer_{i}"], f"model.layers.{i}.", config.d_model)
        )
    tensors["model.norm.weight"] = stack["final_norm"]["rms_norm"]["scale"]
    if not config.tie_output:
        tensors["lm_head.weight"] = params["decoder"]["output_projection"]["kernel"].T
    return tensors


def _write_hf_folder(
    directory: str | Path, hf_config: dict[str, Any], tensors: dict[str, np.ndarray]
) -> None:
    """Writes config.json and model.safetensors (PyTorch-format metadata) into `directory`,
    creating it if needed."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})


def save_pretrained(config: ModelConfig, params: Params, directory: str | Path) -> str:
    """Writes config.json and model.safetensors of a GPT-2 or Llama-family tfm model into
    `directory`; returns the Hugging Face model_type."""
    import jax

    family = _family_for_save(config)
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    params = _unstack(params, config.num_decoder_layers)
    if family == "gpt2":
        hf_config = _gpt2_hf_config(config)
        tensors = _gpt2_hf_tensors(config, params)
    else:
        hf_config = _llama_hf_config(config, family)
        tensors = _llama_hf_tensors(config, params)
    _write_hf_folder(directory, hf_config, tensors)
    return family


# --------------------------------------------------------------------------------- generate


def generate_pretrained(
    directory: str | Path,
    prompts: list[str],
    *,
    max_new_tokens: int = 32,
    prompt_ids: bool = False,
) -> list[str]:
    """Greedy continuations (decoder-only) or outputs (T5) of text prompts, through the
    folder's tokenizer.json; with `prompt_ids` the prompts are space-separated token ids and
    the outputs are ids too. Rows are right-padded with zeros and carry their lengths, so each
    prompt continues from its own end."""
    from tfm.decode.generate import lm_generate, translate

    config, params = load_pretrained(directory)
    hf_config = read_config(directory)
    tokenizer = None if prompt_ids else load_tokenizer(directory)
    if not prompt_ids and tokenizer is None:
        raise UnsupportedCheckpoint(
            f"{directory} has no tokenizer.json; "
            "pass token ids with --prompt_ids"
        )
    if prompt_ids:
        try:
            encoded = [[int(t) for t in prompt.split()] for prompt in prompts]
        except ValueError as error:
            message = f"--prompt_ids needs space-separated ids: {error}"
            raise UnsupportedCheckpoint(message) from None
    else:
        encoded = [tokenizer.encode(prompt) for prompt in prompts]
    if any(not ids for ids in encoded):
        raise UnsupportedCheckpoint("every prompt needs at least one token")
    eos = hf_config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    eos = config.vocab_size - 1 if eos is None else eos  # a model without EOS runs to the end
    width = max(map(len, encoded))
    lengths = np.array([len(ids) for ids in encoded])
    if config.num_encoder_layers and config.num_decoder_layers:
        source = np.zeros((len(encoded), width), np.int32)
        for row, ids in enumerate(encoded):
            source[row, : len(ids)] = ids
        start = hf_config.get("decoder_start_token_id")
        output = translate(
            params, config, source, lengths, method="greedy", eos_id=eos,
            bos_id=config.pad_id if start is None else start, max_new_tokens=max_new_tokens,
        )
    elif config.num_decoder_layers:
        prompts_array = np.zeros((len(encoded), width), np.int32)
        for row, ids in enumerate(encoded):
            prompts_array[row, : len(ids)] = ids
        output = lm_generate(params, config, prompts_array, lengths,
                             max_new_tokens=max_new_tokens, eos_id=eos)
    else:
        raise UnsupportedCheckpoint(
            f"{directory} holds an encoder ({hf_config.get('model_type')}): nothing to generate"
        )
    texts = []
    for tokens, length in zip(np.asarray(output.tokens), np.asarray(output.lengths), strict=True):
        new = tokens[:length].tolist()
        if prompt_ids:
            texts.append(" ".join(map(str, new)))
        else:
            texts.append(tokenizer.decode(new))
    return texts
