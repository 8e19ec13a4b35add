"""The platform choices behind the kernel boundary (tfm.kernels), each against the reference
form it replaces: RoPE's half swap, the select-chain table lookup of fused kernels, the fused
projections, the tied output kernel of decoding, the FFN activation dtype and the loss rule."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm import kernels
from tfm.kernels import block_bias, reference

RNG = np.random.default_rng(0)


@pytest.mark.parametrize("platform", ["cpu", "tpu", "gpu"])
def test_swap_halves_is_the_roll_by_half_bit_for_bit(monkeypatch, platform):
    monkeypatch.setattr(kernels, "platform", lambda: platform)
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(RNG.standard_normal((2, 3, 4, 8)), dtype)
        swapped = kernels.swap_halves(x)
        assert swapped.dtype == jnp.float32
        np.testing.assert_array_equal(swapped, jnp.concatenate([x[..., 4:], x[..., :4]], -1)
                                      .astype(jnp.float32))


def test_row_lookup_is_a_gather_and_its_gradient_a_scatter():
    row = jnp.asarray(RNG.standard_normal((1, 7)), jnp.float32)
    indices = jnp.asarray(RNG.integers(0, 7, (5, 6)), jnp.int32)
    np.testing.assert_array_equal(block_bias.row_lookup(row, indices), row[0][indices])
    weights = jnp.asarray(RNG.standard_normal((5, 6)), jnp.float32)
    grad = jax.grad(lambda r: jnp.sum(block_bias.row_lookup(r, indices) * weights))(row)
    expected = np.zeros(7, np.float32)
    np.add.at(expected, np.asarray(indices), np.asarray(weights))
    np.testing.assert_allclose(grad[0], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("matmul", ["cpu", "fused"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_projections_equal_one_linear_each(with_bias, matmul):
    x = jnp.asarray(RNG.standard_normal((2, 5, 8)), jnp.float32)
    shapes = [(8, 2, 4), (8, 1, 4), (8, 1, 4)]
    weights = [jnp.asarray(RNG.standard_normal(shape), jnp.float32) for shape in shapes]
    biases = [jnp.asarray(RNG.standard_normal(shape[1:]), jnp.float32) for shape in shapes]
    biases = biases if with_bias else None
    assert kernels.matmul("cpu").fuses_projections and kernels.matmul("auto").fuses_projections
    assert not kernels.matmul("splash").fuses_projections  # splash's profile: the reference
    fused = kernels.projections(x, weights, biases, backend=matmul)
    for backend, matmuls in ((matmul, 1), ("reference", 3)):  # one wide matmul, or three
        jaxpr = str(jax.make_jaxpr(functools.partial(
            kernels.projections, kernels=weights, biases=biases, backend=backend))(x))
        assert jaxpr.count("dot_general") == matmuls, backend
    # Fewer rows than input features (a decoding step): "fused" keeps three matmuls, since
    # joining would copy the kernels for a few rows; "cpu" joins them still.
    step = str(jax.make_jaxpr(functools.partial(
        kernels.projections, kernels=weights, biases=biases, backend=matmul))(x[:, :1]))
    assert step.count("dot_general") == (1 if matmul == "cpu" else 3)
    separate = kernels.projections(x, weights, biases, backend="reference")
    for i, (a, b) in enumerate(zip(fused, separate, strict=True)):
        expected = np.einsum("btd,dnh->btnh", x, weights[i])
        if with_bias:
            expected = expected + np.asarray(biases[i])
        assert a.shape == b.shape == expected.shape
        np.testing.assert_allclose(a, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(b, expected, rtol=1e-5, atol=1e-5)
    two = kernels.projections(x.reshape(2, 5, 2, 4), [weights[0].reshape(2, 4, 8)],
                              backend="cpu", num_contracted=2)[0]
    np.testing.assert_allclose(two, np.einsum("btd,dk->btk", x, weights[0].reshape(8, 8)),
                               rtol=1e-5, atol=1e-5)


def test_forward_fused_joins_q_k_v_only_where_no_backward_pass_follows():
    """TPU's profile: one matmul for an input's query, key and value in a forward-only call
    (prefill, evaluation) with at least as many rows as features and rows of at most 1,024
    tokens, three otherwise (a train step, a decoding step, a long prompt's prefill); the
    values are the reference's either way. In a model, the attention layer's `deterministic`
    says forward-only."""
    from tfm.nn.config import ModelConfig
    from tfm.nn.models import DecoderLM

    x = jnp.asarray(RNG.standard_normal((2, 5, 8)), jnp.float32)
    weights = [jnp.asarray(RNG.standard_normal((8, 2, 4)), jnp.float32) for _ in range(3)]
    assert kernels.matmul("forward_fused").max_fused_len == 1024
    longest = jnp.asarray(RNG.standard_normal((1, 1024, 8)), jnp.float32)
    longer = jnp.asarray(RNG.standard_normal((1, 1025, 8)), jnp.float32)
    for rows, forward_only, matmuls in ((x, True, 1), (x, False, 3), (x[:, :1], True, 3),
                                        (longest, True, 1), (longer, True, 3)):
        call = functools.partial(kernels.projections, kernels=weights, backend="forward_fused",
                                 forward_only=forward_only)
        assert str(jax.make_jaxpr(call)(rows)).count("dot_general") == matmuls
        for got, weight in zip(call(rows), weights, strict=True):
            np.testing.assert_allclose(got, np.einsum("btd,dnh->btnh", rows, weight),
                                       rtol=1e-5, atol=1e-5)
    config = ModelConfig.decoder_only(vocab_size=11, num_layers=2, d_model=16, num_heads=2,
                                      d_ff=32, attention_backend="reference",
                                      matmul="forward_fused")
    model = DecoderLM(config)
    tokens = jnp.zeros((2, 24), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), tokens)

    def dots(deterministic):
        apply = functools.partial(model.apply, deterministic=deterministic,
                                  rngs={"dropout": jax.random.PRNGKey(1)})
        return str(jax.make_jaxpr(apply)(params, tokens)).count("dot_general")

    assert dots(False) - dots(True) == 2 * 2  # two layers: three matmuls each, or one


def test_tied_output_kernel_is_the_transpose_on_cpu_only(monkeypatch):
    table = jnp.asarray(RNG.standard_normal((11, 4)), jnp.float32)
    np.testing.assert_array_equal(kernels.tied_output_kernel(table, jnp.bfloat16),
                                  table.T.astype(jnp.bfloat16))
    monkeypatch.setattr(kernels, "platform", lambda: "tpu")
    assert kernels.tied_output_kernel(table, jnp.float32) is None


def test_ffn_activation_dtype_and_loss_backend_rules(monkeypatch):
    assert kernels.ffn_activation_dtype("compute") == "compute"
    assert kernels.ffn_activation_dtype("auto") == "float32"  # this host: cpu
    monkeypatch.setattr(kernels, "platform", lambda: "tpu")
    assert kernels.ffn_activation_dtype("auto") == "compute"
    assert kernels.ffn_activation_dtype("float32") == "float32"
    assert kernels.loss_backend_for("tpu", kernels.FUSED_LOSS_MIN_VOCAB) == "fused"
    assert kernels.loss_backend_for("tpu", kernels.FUSED_LOSS_MIN_VOCAB - 1) == "reference"
    assert kernels.loss_backend_for("gpu", 50_000) == "reference"
    assert kernels.loss_backend_for("cpu", 50_000) == "reference"
    from tfm.nn import config

    assert config.loss_backend_for is kernels.loss_backend_for  # the old path still works


def test_reference_linear_matches_einsum():
    x = jnp.asarray(RNG.standard_normal((3, 8)), jnp.float32)
    kernel = jnp.asarray(RNG.standard_normal((8, 5)), jnp.float32)
    np.testing.assert_allclose(reference.linear(x, kernel), np.asarray(x) @ np.asarray(kernel),
                               rtol=1e-5, atol=1e-5)


def test_the_three_choices_are_separate_and_auto_follows_the_profile(monkeypatch):
    from tfm.kernels.cache_layouts import REFERENCE
    from tfm.kernels.cpu_cache import CPU_LAYOUT
    from tfm.kernels.tpu_cache import TPU_LAYOUT
    from tfm.nn.config import ModelConfig

    assert kernels.matmul("auto") is kernels.MATMULS["cpu"]  # this host: the cpu profile
    assert kernels.matmul("reference") is kernels.MATMULS["reference"]
    assert kernels.cache_layout("auto") is CPU_LAYOUT
    assert kernels.cache_layout("cpu", "reference") is REFERENCE
    with pytest.raises(Exception, match="cache_layout='cpu' is read only by attention_backend"
                                        "='cpu', not by 'splash'"):
        kernels.cache_layout("splash", "cpu")
    monkeypatch.setattr(kernels, "platform", lambda: "tpu")
    assert kernels.matmul("auto") is kernels.MATMULS["forward_fused"]  # TPU's profile
    assert kernels.cache_layout("auto") is kernels.cache_layout("flex") is TPU_LAYOUT
    assert kernels.cache_layout("reference") is TPU_LAYOUT  # its einsums read any layout
    assert kernels.cache_layout("xla") is REFERENCE  # jax.nn's takes the model's only
    monkeypatch.setattr(kernels, "platform", lambda: "gpu")  # the GPU profile fuses q, k, v
    assert kernels.cache_layout("flex") is kernels.cache_layout("reference") is REFERENCE
    # (TPU's tiles are why: on TPU only)
    assert kernels.cache_layout("flex", "tpu") is TPU_LAYOUT  # named, read anywhere
    assert kernels.matmul("auto") is kernels.matmul("flex") is kernels.MATMULS["fused"]
    assert kernels.matmul("reference") is kernels.MATMULS["reference"]  # a name stays
    tiny = dict(vocab_size=11, num_layers=1, d_model=16, num_heads=2, d_ff=32)
    config = ModelConfig.decoder_only(**tiny, attention_backend="cpu", matmul="reference")
    assert config.matmul_choice == "reference" and config.cache_layout == "auto"
    assert ModelConfig.decoder_only(**tiny).matmul_choice == "fused"  # GPU's profile
    # The reference attention names no matmul: its platform's, which the matmul that shares
    # its name must not shadow (TPU's `auto` gives one-block rows to the reference).
    named = ModelConfig.decoder_only(**tiny, attention_backend="reference")
    assert named.matmul_choice == "fused"
    monkeypatch.setattr(kernels, "platform", lambda: "tpu")
    assert named.matmul_choice == ModelConfig.decoder_only(**tiny).matmul_choice
    assert named.matmul_choice == "forward_fused"
    monkeypatch.setattr(kernels, "platform", lambda: "cpu")
    assert named.matmul_choice == "reference"
    assert ModelConfig.decoder_only(**tiny).matmul_choice == "cpu"  # the cpu backend's own
    with pytest.raises(Exception, match="matmul='fast' is unknown; choose one of: auto, "
                                        "reference, cpu, fused, forward_fused"):
        ModelConfig.decoder_only(**tiny, matmul="fast")
    with pytest.raises(Exception, match="cache_layout='cpu' is read only"):
        ModelConfig.decoder_only(**tiny, attention_backend="reference", cache_layout="cpu")
