import json
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.checks import ConfigError
from tfm.kernels import hardware
from tfm.nn.config import ModelConfig
from tfm.nn.families import get_family
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
    counts = flops.model_counts(CONFIG_A.replace(num_encoder_layers=0), "lm")
    # embedding 100*16; per layer: attention 4*16*16 + biases 3*16+16, FFN 2*16*32 + 32+16,
    # two LayerNorms 2*(16+16).
    assert counts.params == 1600 + 2 * (1024 + 64) + 2 * (1024 + 48) + 2 * 64 == 6048
    assert counts.target_weights == 2 * (1024 + 1024) + 16 * 100  # tied output still multiplies
    assert counts.source_weights == 0 and counts.self_width == 2 * 16
    # 6N + 12 * L * T * d_attn with T = 8: 6 * 5696 + 12 * 2 * 8 * 16.
    assert flops.flops_per_token(CONFIG_A.replace(num_encoder_layers=0), 8, "lm") == 34176 + 3072


def test_config_b_seq2seq_by_hand():
    counts = flops.model_counts(CONFIG_B, "seq2seq")
    # attention: q, o 32x32; k, v 32x(2*8) (+ no biases); SwiGLU 3 * 32 * 64; RMSNorm 32 a norm
    # (+ a final norm per stack: pre-norm); a learned table per stack; two vocabularies, untied.
    attention, mlp = (1 + 2 * 2) * 3072, 3 * 6144
    norms = (2 + 1) * 32 + (2 * 3 + 1) * 32
    assert counts.params == attention + mlp + norms + 2 * 16 * 32 + 50 * 32 + 60 * 32 + 32 * 50
    assert counts.params == 40256
    # Per source token: the encoder's 3072 + 6144 and the decoder's cross k, v 2 * 2 * 512.
    assert counts.source_weights == 9216 + 2048
    assert counts.target_weights == 2 * (3072 + 2048 + 6144) + 1600
    # Per target token, T=8, S=12: decoder 6*(2*(2048+1024+6144)+1600) + 12*2*8*32
    # + cross queries/outputs 6*2*2048 + cross scores 12*2*12*32; encoder per source token
    # 6*(3072+6144) + 12*12*32 + cross keys/values 6*2*1024, times S/T = 12/8.
    decoder = 120192 + 6144 + 24576 + 9216
    encoder = (55296 + 4608 + 12288) * 12 / 8
    assert flops.flops_per_token(CONFIG_B, 8, "seq2seq", source_len=12) == decoder + encoder
    encoder_only = flops.model_counts(CONFIG_B, "encoder")  # BERT's family: no output layer
    assert encoder_only.params == 60 * 32 + 16 * 32 + 3072 + 6144 + 3 * 32
    assert flops.flops_per_token(CONFIG_B, 12, "encoder") == 55296 + 4608


def test_seq2seq_equal_lengths_is_6n_plus_attention():
    counts = flops.model_counts(CONFIG_B, "seq2seq")
    d_attn, length = 32, 10
    attention = 12 * length * d_attn * (1 + 2 * 2)  # encoder self, decoder self and cross
    matmul = counts.target_weights + counts.source_weights
    assert flops.flops_per_token(CONFIG_B, length, "seq2seq") == pytest.approx(
        6 * matmul + attention, rel=1e-12)


def test_gqa_and_swiglu_differences():
    mha = CONFIG_A.replace(num_heads=4, num_encoder_layers=0)
    gqa = mha.replace(num_kv_heads=1)
    layers, d, head_dim = 2, 16, 4
    weight_diff = layers * 2 * d * (4 - 1) * head_dim  # k and v lose 3 of 4 heads
    bias_diff = layers * 2 * (4 - 1) * head_dim
    params = flops.count_params
    assert params(mha) - params(gqa) == weight_diff + bias_diff
    assert flops.flops_per_token(mha, 8) - flops.flops_per_token(gqa, 8) == 6 * weight_diff
    swiglu = mha.replace(activation="swiglu")
    assert params(swiglu) - params(mha) == layers * (d * 32 + 32)
    assert flops.flops_per_token(swiglu, 8) - flops.flops_per_token(mha, 8) == 6 * layers * d * 32


def _initialised_param_count(mode, config):
    """Independent of eval_shape: the parameters a real init allocates, summed."""
    family = get_family(mode)
    tokens = {key: jnp.ones((1, 8), jnp.int32) for key in family.inputs}
    params = nn.meta.unbox(family.init(family.model(config), jax.random.key(0), tokens))
    return sum(int(np.prod(np.shape(leaf))) for leaf in jax.tree.leaves(params))


BERT = ModelConfig(vocab_size=40, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=2,
                   num_decoder_layers=0, position_scheme="learned", max_len=8,
                   type_vocab_size=2, embedding_norm=True, activation="gelu",
                   norm_placement="post", scale_embeddings=False)
T5 = ModelConfig(vocab_size=40, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=2,
                 num_decoder_layers=1, position_scheme="t5_bias", norm_type="rmsnorm",
                 norm_placement="pre", use_bias=False, tie_output=False, activation="geglu")
UNTIED = ModelConfig.decoder_only(vocab_size=30, num_layers=2, d_model=16, num_heads=4,
                                  d_ff=32).replace(tie_output=False, lm_head_bias=True,
                                                   embedding_norm=True, final_norm=True)


@pytest.mark.parametrize("mode,config", [
    ("lm", CONFIG_A.replace(num_encoder_layers=0)),
    ("seq2seq", CONFIG_A.replace(position_scheme="relative", num_kv_heads=2)),
    ("seq2seq", CONFIG_B.replace(position_scheme="t5_bias", t5_shared_across_layers=False)),
    ("encoder", BERT), ("seq2seq", T5), ("lm", UNTIED), ("lm", UNTIED.replace(scan_layers=True)),
    ("lm", UNTIED.replace(type_vocab_size=3, final_norm=False)),
])
def test_counts_match_the_initialised_models(mode, config):
    assert flops.count_params(config, mode) == _initialised_param_count(mode, config)


def test_untied_head_with_bias_and_embedding_norm_by_hand():
    # embedding 30*16, embedding LayerNorm 2*16; per layer: attention 4*16*16 + 4*16 biases,
    # FFN 2*16*32 + 32 + 16, two LayerNorms 2*32; final LayerNorm 32; head 16*30 + bias 30.
    per_layer = 1024 + 64 + 1024 + 48 + 64
    assert flops.count_params(UNTIED) == 480 + 32 + 2 * per_layer + 32 + 480 + 30
    assert flops.count_params(UNTIED.replace(type_vocab_size=3)) == (
        flops.count_params(UNTIED) + 3 * 16)  # a token-type table
    counts = flops.model_counts(UNTIED)
    assert counts.target_weights == 2 * (1024 + 1024) + 480  # head once, as its own kernel


def test_bad_mode():
    with pytest.raises(ConfigError, match="mode='decoder'"):
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
