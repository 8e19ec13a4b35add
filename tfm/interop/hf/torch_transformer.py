"""`torch.nn.Transformer` state dicts saved as safetensors: read."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tfm.interop.hf.common import (
    Params,
    Tensors,
    UnsupportedCheckpoint,
    dense,
    in_heads,
    norm,
    out_heads,
)
from tfm.nn.config import ModelConfig


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

    t = Tensors({k: np.asarray(v, np.float32) for k, v in load_file(str(path)).items()},
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
        out = {name: dense(in_heads(w, num_heads), b.reshape(num_heads, -1))
               for name, w, b in zip(("query", "key", "value"), weights, biases, strict=True)}
        out["out"] = dense(out_heads(t(prefix + ".out_proj.weight"), num_heads),
                           t(prefix + ".out_proj.bias"))
        return out

    def layer_norm(prefix: str) -> Params:
        return norm(config, t(prefix + ".weight"), t(prefix + ".bias"))

    def stack(side: str, num_layers: int) -> Params:
        layers: Params = {}
        for i in range(num_layers):
            p = f"{side}.layers.{i}"
            layer = {"self_attention": attention(p + ".self_attn"),
                     "self_attention_norm": layer_norm(p + ".norm1")}
            ff_norm = "norm2"
            if side == "decoder":
                layer["cross_attention"] = attention(p + ".multihead_attn")
                layer["cross_attention_norm"] = layer_norm(p + ".norm2")
                ff_norm = "norm3"
            layer["feed_forward"] = {
                "wi": dense(t(p + ".linear1.weight").T, t(p + ".linear1.bias")),
                "wo": dense(t(p + ".linear2.weight").T, t(p + ".linear2.bias")),
            }
            layer["feed_forward_norm"] = layer_norm(f"{p}.{ff_norm}")
            layers[f"layer_{i}"] = layer
        if final:
            layers["final_norm"] = layer_norm(f"{side}.norm")
        return {"stack": layers}

    params = {"embed": {"embedding": embedding},
              "encoder": stack("encoder", config.num_encoder_layers),
              "decoder": stack("decoder", config.num_decoder_layers)}
    return config, params
