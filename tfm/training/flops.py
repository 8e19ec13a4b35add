"""Parameter and FLOP counts from a ModelConfig, and model FLOPs utilisation (device peaks:
tfm/kernels/hardware.py).

Convention (Kaplan et al. 2020 sec. 2.1; Chowdhery et al. 2022 (PaLM) appendix B): training
costs 6 FLOPs per matmul weight per token (2 forward, 4 backward) plus, per layer, 12 * T * d_attn
for the attention scores and the weighted sum of values (QK^T and AV, 2 * T * d_attn each
forward), where T is the number of keys attended to and d_attn = num_heads * head_dim. Matmul
weights are the attention projections, the FFN matrices and the output projection (counted also
when tied to the embedding, since the matmul still runs); embedding lookups, norms, biases,
softmax and position-scheme extras (Shaw tables, T5/ALiBi biases) are not counted, nor are causal
or local-window masks (the masked score matrix is computed in full).
"""

from __future__ import annotations

from tfm.checks import ConfigError
from tfm.nn.config import ModelConfig

KINDS = ("lm", "seq2seq", "encoder")

def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ConfigError(f"kind={kind!r} is unknown; choose one of: {', '.join(KINDS)}")


def _attention_counts(config: ModelConfig) -> tuple[int, int, int]:
    """(query/output weights, key/value weights, biases) of one attention layer."""
    d, head_dim = config.d_model, config.resolved_head_dim
    q_width, kv_width = config.num_heads * head_dim, config.resolved_num_kv_heads * head_dim
    bias = (q_width + 2 * kv_width) * config.has_bias("qkv")
    bias += d * config.has_bias("attention_out")
    return 2 * d * q_width, 2 * d * kv_width, bias


def _mlp_counts(config: ModelConfig) -> tuple[int, int]:
    """(weights, biases) of one FFN: two matrices, or three for SwiGLU (gate, up, down)."""
    matrices = 3 if config.activation in ("swiglu", "geglu") else 2
    bias = (matrices - 1) * config.d_ff + config.d_model if config.has_bias("mlp") else 0
    return matrices * config.d_model * config.d_ff, bias


def count_params_from_config(config: ModelConfig, kind: str = "lm") -> dict[str, int]:
    """Parameter counts of the model `kind` builds (tfm/nn/models.py: DecoderLM, EncoderDecoder,
    Encoder), by group: embedding, output (untied projection), position, attention, mlp, norm,
    total; plus `matmul`, the weights that enter the 6N FLOP count (see the module docstring)."""
    _check_kind(kind)
    d = config.d_model
    stacks = {
        "lm": [("decoder", config.num_decoder_layers)],
        "encoder": [("encoder", config.num_encoder_layers)],
        "seq2seq": [("encoder", config.num_encoder_layers), ("decoder", config.num_decoder_layers)],
    }[kind]
    qo, kv, attn_bias = _attention_counts(config)
    mlp, mlp_bias = _mlp_counts(config)
    norm = 2 * d if config.norm_type == "layernorm" else d  # LayerNorm: scale and bias

    counts = dict.fromkeys(("embedding", "output", "position", "attention", "mlp", "norm"), 0)
    counts["matmul"] = 0
    for name, layers in stacks:
        attentions = 2 if (kind == "seq2seq" and name == "decoder") else 1  # + cross-attention
        counts["attention"] += layers * attentions * (qo + kv + attn_bias)
        counts["mlp"] += layers * (mlp + mlp_bias)
        counts["norm"] += (layers * (attentions + 1) + (config.norm_placement == "pre")) * norm
        counts["matmul"] += layers * (attentions * (qo + kv) + mlp)
        counts["position"] += config.scheme.num_params(config, layers)

    source_vocab = config.resolved_source_vocab_size
    if kind == "encoder":
        counts["embedding"] = source_vocab * d
    else:
        counts["embedding"] = config.vocab_size * d
        if kind == "seq2seq" and not config.share_embeddings:
            counts["embedding"] += source_vocab * d
        counts["output"] = 0 if config.tie_output else d * config.vocab_size
        counts["matmul"] += d * config.vocab_size
    groups = ("embedding", "output", "position", "attention", "mlp", "norm")
    counts["total"] = sum(counts[g] for g in groups)
    return counts


def attention_core_flops(config: ModelConfig, keys: int, layers: int) -> float:
    """Training FLOPs per query token of the attention core (q k^T and weights . v, forward and
    backward) over `keys` keys in each of `layers` layers: 12 * layers * keys * d_attn."""
    return 12.0 * layers * keys * config.num_heads * config.resolved_head_dim


def flops_per_token(
    config: ModelConfig, seq_len: int, kind: str = "lm", source_len: int | None = None
) -> float:
    """Training FLOPs per token: 6 * matmul weights + 12 * layers * keys * d_attn.

    kind="lm" and "encoder": per token of a `seq_len` sequence. kind="seq2seq": per decoder
    (target) token, for a `seq_len`-token target and a `source_len`-token source (default
    seq_len): the encoder's work and the cross-attention key/value projections run once per
    source token and are spread over the target tokens. Multiply by tokens/s for FLOP/s.
    """
    return (_weight_flops_per_token(config, seq_len, kind, source_len)
            + attention_flops_per_token(config, seq_len, kind, source_len))


def _weight_flops_per_token(
    config: ModelConfig, seq_len: int, kind: str, source_len: int | None
) -> float:
    """flops_per_token's 6 * matmul weights part."""
    _check_kind(kind)
    qo, kv, _ = _attention_counts(config)
    mlp, _ = _mlp_counts(config)
    if kind == "encoder":
        return 6.0 * config.num_encoder_layers * (qo + kv + mlp)
    layers = config.num_decoder_layers
    decoder = 6.0 * (layers * (qo + kv + mlp) + config.d_model * config.vocab_size)
    if kind == "lm":
        return decoder
    source_len = seq_len if source_len is None else source_len
    encoder = 6.0 * config.num_encoder_layers * (qo + kv + mlp) + 6.0 * layers * kv
    return decoder + 6.0 * layers * qo + encoder * source_len / seq_len


def attention_flops_per_token(
    config: ModelConfig, seq_len: int, kind: str = "lm", source_len: int | None = None
) -> float:
    """flops_per_token's attention-core part (12 * layers * keys * d_attn), the work a fused
    attention kernel does (self-attention, and for seq2seq cross-attention and the encoder's,
    spread over the target tokens as flops_per_token does)."""
    _check_kind(kind)
    if kind == "encoder":
        return attention_core_flops(config, seq_len, config.num_encoder_layers)
    layers = config.num_decoder_layers
    decoder = attention_core_flops(config, seq_len, layers)
    if kind == "lm":
        return decoder
    source_len = seq_len if source_len is None else source_len
    encoder = attention_core_flops(config, source_len, config.num_encoder_layers)
    return decoder + attention_core_flops(config, source_len, layers) + (
        encoder * source_len / seq_len)


def mfu(
    tokens_per_second: float, flops_per_token: float, num_devices: int, peak_per_device: float
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' combined peak."""
    return tokens_per_second * flops_per_token / (num_devices * peak_per_device)
