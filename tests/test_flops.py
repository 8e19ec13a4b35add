import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.checks import ConfigError
from tfm.kernels import hardware
from tfm.nn.config import ModelConfig
from tfm.training import flops

# A: the paper's block shape, tiny. B: GQA + SwiGLU + pre-RMSNorm, no biases, untied, two vocabs.
CONFIG_A = ModelConfig(vocab_size=100, d_model=16, num_heads=4, d_ff=32, num_encoder_layers=2,
                       num_decoder_layers=2)
CONFIG_B = ModelConfig(vocab_size=50, source_vocab_size=60, share_embeddings=False,
                       tie_output=False, d_model=32, num_heads=4, num_kv_heads=2, d_ff=64,
                       num_encoder_layers=1, num_decoder_layers=2, activation="swiglu",
                       norm_type="rmsnorm", norm_placement="pre", use_bias=False,
                       position_scheme="learned", max_len=16)


def test_config_a_lm_by_hand():
    counts = flops.count_params_from_config(CONFIG_A, "lm")
    # embedding 100*16; per layer: attention 4*16*16 + biases 3*16+16, FFN 2*16*32 + 32+16,
    # two LayerNorms 2*(16+16).
    assert counts["embedding"] == 1600 and counts["output"] == 0
    assert counts["attention"] == 2 * (1024 + 64)
    assert counts["mlp"] == 2 * (1024 + 48)
    assert counts["norm"] == 2 * 64
    assert counts["total"] == 1600 + 2176 + 2144 + 128 == 6048
    assert counts["matmul"] == 2 * (1024 + 1024) + 16 * 100  # tied output still multiplies
    # 6N + 12 * L * T * d_attn with T = 8: 6 * 5696 + 12 * 2 * 8 * 16.
    assert flops.flops_per_token(CONFIG_A, 8, "lm") == 34176 + 3072


def test_config_b_seq2seq_by_hand():
    counts = flops.count_params_from_config(CONFIG_B, "seq2seq")
    # attention: q, o 32x32; k, v 32x(2*8); SwiGLU 3 * 32 * 64; RMSNorm 32 per norm.
    assert counts["attention"] == (1 + 2 * 2) * 3072  # encoder self + decoder self and cross
    assert counts["mlp"] == 3 * 6144
    assert counts["norm"] == (2 + 1) * 32 + (2 * 3 + 1) * 32  # + final norm per stack
    assert counts["position"] == 2 * 16 * 32  # a learned table per stack
    assert counts["embedding"] == 50 * 32 + 60 * 32 and counts["output"] == 32 * 50
    assert counts["total"] == 40256
    assert counts["matmul"] == 15360 + 18432 + 1600
    # Per target token, T=8, S=12: decoder 6*(2*(2048+1024+6144)+1600) + 12*2*8*32
    # + cross queries/outputs 6*2*2048 + cross scores 12*2*12*32; encoder per source token
    # 6*(3072+6144) + 12*12*32 + cross keys/values 6*2*1024, times S/T = 12/8.
    decoder = 120192 + 6144 + 24576 + 9216
    encoder = (55296 + 4608 + 12288) * 12 / 8
    assert flops.flops_per_token(CONFIG_B, 8, "seq2seq", source_len=12) == decoder + encoder
    encoder_only = flops.count_params_from_config(CONFIG_B, "encoder")
    assert encoder_only["embedding"] == 60 * 32 and encoder_only["output"] == 0
    assert flops.flops_per_token(CONFIG_B, 12, "encoder") == 55296 + 4608


def test_seq2seq_equal_lengths_is_6n_plus_attention():
    counts = flops.count_params_from_config(CONFIG_B, "seq2seq")
    d_attn, length = 32, 10
    attention = 12 * length * d_attn * (1 + 2 * 2)  # encoder self, decoder self and cross
    assert flops.flops_per_token(CONFIG_B, length, "seq2seq") == pytest.approx(
        6 * counts["matmul"] + attention, rel=1e-12)


def test_gqa_and_swiglu_differences():
    mha = CONFIG_A.replace(num_heads=4)
    gqa = CONFIG_A.replace(num_kv_heads=1)
    layers, d, head_dim = 2, 16, 4
    weight_diff = layers * 2 * d * (4 - 1) * head_dim  # k and v lose 3 of 4 heads
    bias_diff = layers * 2 * (4 - 1) * head_dim
    params = flops.count_params_from_config
    assert params(mha)["total"] - params(gqa)["total"] == weight_diff + bias_diff
    assert flops.flops_per_token(mha, 8) - flops.flops_per_token(gqa, 8) == 6 * weight_diff
    swiglu = CONFIG_A.replace(activation="swiglu")
    assert params(swiglu)["total"] - params(mha)["total"] == layers * (d * 32 + 32)
    assert flops.flops_per_token(swiglu, 8) - flops.flops_per_token(mha, 8) == 6 * layers * d * 32


def _model_param_count(model, *args):
    shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), *args))
    return sum(int(np.prod(leaf.shape)) for leaf in jax.tree.leaves(shapes["params"]))


@pytest.mark.parametrize("config", [
    CONFIG_A, CONFIG_A.replace(position_scheme="relative", num_kv_heads=2),
    CONFIG_B.replace(position_scheme="t5_bias", t5_shared_across_layers=False),
])
def test_counts_match_the_models(config):
    models = pytest.importorskip("tfm.nn.models")
    tokens = jnp.ones((1, 8), jnp.int32)
    lm = _model_param_count(models.DecoderLM(config.replace(num_encoder_layers=0)), tokens)
    assert lm == flops.count_params_from_config(config, "lm")["total"]
    seq2seq = _model_param_count(models.EncoderDecoder(config), tokens, tokens)
    assert seq2seq == flops.count_params_from_config(config, "seq2seq")["total"]


def test_bad_kind():
    with pytest.raises(ConfigError, match="kind='decoder'"):
        flops.flops_per_token(CONFIG_A, 8, "decoder")


def test_peak_table_lookup():
    def device(kind):
        return types.SimpleNamespace(platform="gpu", device_kind=kind)

    assert hardware.device_peak_flops(device("NVIDIA H100 80GB HBM3")) == 989e12
    assert hardware.device_peak_flops(device("NVIDIA H100 PCIe")) == 756e12
    assert hardware.device_peak_flops(device("NVIDIA H200")) == 989e12
    assert hardware.device_peak_flops(device("NVIDIA A100-SXM4-40GB")) == 312e12
    assert hardware.device_peak_flops(device("NVIDIA L4")) == 121e12
    assert hardware.device_peak_flops(device("NVIDIA L40S")) == 362e12
    assert hardware.device_peak_flops(device("TPU v5 lite")) == 197e12
    assert hardware.device_peak_flops(device("TPU v5")) == 459e12
    assert hardware.device_peak_flops(device("TPU v6 lite")) == 918e12
    assert hardware.device_peak_flops(device("Mystery chip")) is None


def test_cpu_peak_measured_once_and_cached(tmp_path, monkeypatch):
    calls = []

    def fake_measure(dtype, device=None):
        calls.append(jnp.dtype(dtype).name)
        return 8e9 if jnp.dtype(dtype) == jnp.float32 else 16e9

    monkeypatch.setenv("TFM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(hardware, "measure_matmul_flops", fake_measure)
    cpu = jax.devices("cpu")[0]
    per_device = 8e9 / len(jax.local_devices(backend="cpu"))
    assert hardware.device_peak_flops(cpu, jnp.float32) == per_device
    assert hardware.device_peak_flops(cpu, jnp.float32) == per_device
    assert calls == ["float32"]
    hardware.device_peak_flops(cpu, jnp.bfloat16)
    hardware.device_peak_flops(cpu, jnp.bfloat16)
    assert calls == ["float32", "bfloat16"]
    cached = json.loads((tmp_path / "peak_flops.json").read_text())
    assert sorted(cached.values()) == [8e9, 16e9]
    assert all(key.startswith(cpu.device_kind) for key in cached)


def test_real_micro_benchmark_and_mfu():
    measured = hardware.measure_matmul_flops(jnp.float32, size=64, repeats=2)
    assert np.isfinite(measured) and measured > 0
    # 1000 tokens/s * 1e9 FLOPs/token on 2 devices of 1e12 peak = 0.5.
    assert flops.mfu(1000.0, 1e9, 2, 1e12) == pytest.approx(0.5)


def test_bf16_warning_only_for_bfloat16_on_a_cpu_without_bf16_units(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    original_path = hardware.Path

    def fake_path(path, *rest):
        return cpuinfo if str(path) == "/proc/cpuinfo" else original_path(path, *rest)

    monkeypatch.setattr(hardware, "Path", fake_path)
    cpuinfo.write_text("model name\t: Emulating CPU\nflags\t\t: fpu avx2 fma\n")
    features = hardware.cpu_features()
    assert features["model"] == "Emulating CPU" and not features["bf16_native"]
    assert hardware.bf16_warning(ModelConfig().dtype) is None  # float32
    warning = hardware.bf16_warning("bfloat16")
    assert "Emulating CPU" in warning and "slower than float32" in warning
    cpuinfo.write_text("model name\t: AMX CPU\nflags\t\t: avx512f avx512_bf16 amx_bf16 amx_tile\n")
    assert hardware.cpu_features()["bf16_units"] == ["amx_bf16", "avx512_bf16"]
    assert hardware.bf16_warning("bfloat16") is None
