"""Parameter and FLOP counts from a ModelConfig, accelerator peaks, and model FLOPs utilisation.

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

import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from tfm.checks import ConfigError
from tfm.nn.config import ModelConfig

KINDS = ("lm", "seq2seq", "encoder")

# Dense bf16 peak FLOP/s per device (vendor figures, no sparsity), matched as case-insensitive
# substrings of jax's `device.device_kind`; the longest matching key wins (so "TPU v5 lite",
# v5e's device kind, beats "TPU v5", v5p's, and "H100 PCIe" beats "H100").
PEAK_FLOPS: dict[str, float] = {
    "H100": 989e12,  # SXM
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "A100": 312e12,
    "V100": 125e12,
    "NVIDIA L4": 121e12,
    "NVIDIA L40S": 362e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5": 459e12,  # v5p
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
}
CPU_BENCHMARK_SIZE = 2048


def cpu_features() -> dict[str, Any]:
    """This host's CPU model and whether it computes bfloat16 natively (AMX or AVX512-BF16
    units); without them XLA and torch emulate bf16, which then runs slower than float32."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:  # not Linux: unknown
        pass
    native = sorted(flags & {"amx_bf16", "avx512_bf16"})
    return {
        "model": model,
        "cores": os.cpu_count(),
        "bf16_native": bool(native),
        "bf16_units": native or ["none: bfloat16 is emulated (slower than float32)"],
        "isa": sorted(flags & {"avx2", "avx512f", "amx_tile", "fma"}),
    }


def cpu_line(info: dict[str, Any]) -> str:
    """"CPU: <model>, <cores> cores; bf16 units: <units>" from `cpu_features()`, for reports."""
    return f"CPU: {info['model']}, {info['cores']} cores; bf16 units: " + ", ".join(
        info["bf16_units"]
    )


def bf16_warning(config: ModelConfig) -> str | None:
    """A one-line warning when `config` computes in bfloat16 on a CPU without bf16 units."""
    if config.dtype != "bfloat16" or jax.default_backend() != "cpu":
        return None
    features = cpu_features()
    if features["bf16_native"]:
        return None
    return (
        f"model.dtype='bfloat16' on a CPU without bfloat16 units ({features['model']}: no AMX "
        "or AVX512-BF16): bf16 is emulated here and runs slower than float32; use "
        "model.dtype='float32' for speed on this machine"
    )


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
    _check_kind(kind)
    qo, kv, _ = _attention_counts(config)
    mlp, _ = _mlp_counts(config)
    if kind == "encoder":
        layers = config.num_encoder_layers
        return 6.0 * layers * (qo + kv + mlp) + attention_core_flops(config, seq_len, layers)
    layers = config.num_decoder_layers
    decoder = 6.0 * (layers * (qo + kv + mlp) + config.d_model * config.vocab_size)
    decoder += attention_core_flops(config, seq_len, layers)
    if kind == "lm":
        return decoder
    source_len = seq_len if source_len is None else source_len
    decoder += 6.0 * layers * qo + attention_core_flops(config, source_len, layers)  # cross
    encoder = flops_per_token(config, source_len, "encoder")
    encoder += 6.0 * layers * kv  # cross-attention keys/values of every source token
    return decoder + encoder * source_len / seq_len


def mfu(
    tokens_per_second: float, flops_per_token: float, num_devices: int, peak_per_device: float
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' combined peak."""
    return tokens_per_second * flops_per_token / (num_devices * peak_per_device)


def _cache_path() -> Path:
    root = os.environ.get("TFM_CACHE_DIR") or Path.home() / ".cache" / "tfm"
    return Path(root) / "peak_flops.json"


def measure_matmul_flops(
    dtype: Any = jnp.float32, size: int = CPU_BENCHMARK_SIZE, repeats: int = 5,
    device: jax.Device | None = None,
) -> float:
    """Best-of-`repeats` FLOP/s of a [size, size] x [size, size] matmul on `device` (float32
    accumulation, as training matmuls ask for)."""
    device = device or jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    b = jax.device_put(jnp.ones((size, size), dtype), device)
    matmul = jax.jit(
        lambda a, b: jax.lax.dot(
            a, b, precision=jax.lax.Precision.DEFAULT, preferred_element_type=jnp.float32
        )
    )
    matmul(a, b).block_until_ready()  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def device_peak_flops(device: jax.Device | None = None, dtype: Any = jnp.bfloat16) -> float | None:
    """Peak FLOP/s of one device. Accelerators: the dense bf16 figure from PEAK_FLOPS whatever
    `dtype` (MFU is quoted against it by convention); None for an unknown accelerator. CPU: the
    host's matmul speed in `dtype`, measured once per CPU model and cached in $TFM_CACHE_DIR
    (default ~/.cache/tfm)/peak_flops.json, divided by the number of local CPU devices (so
    simulated devices share the host and `mfu(..., num_devices=jax.device_count(), ...)` stays
    right)."""
    device = device or jax.devices()[0]
    if device.platform != "cpu":
        kind = device.device_kind.lower()
        matches = [key for key in PEAK_FLOPS if key.lower() in kind]
        return PEAK_FLOPS[max(matches, key=len)] if matches else None
    dtype_name = jnp.dtype(dtype).name
    # The CPU model is part of the key: a home directory can outlive the machine under it.
    key = f"{device.device_kind}/{cpu_features()['model']}/{os.cpu_count()}cpus/{dtype_name}"
    path = _cache_path()
    try:
        cache = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        cache = {}
    if key not in cache:
        cache[key] = measure_matmul_flops(dtype, device=device)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: concurrent readers never see half a file
    return cache[key] / len(jax.local_devices(backend="cpu"))
