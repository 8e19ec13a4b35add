"""Layers against float64 / closed-form references: LayerNorm precision, activations, bias
switches, the attention and output scales."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TINY

from tfm.kernels import masks
from tfm.kernels.call import AttentionStructure
from tfm.nn import layers, positions
from tfm.nn.config import ModelConfig
from tfm.nn.layers import (
    AttentionInputs,
    FeedForward,
    MultiHeadAttention,
    Norm,
    PositionBias,
    PositionEmbedding,
)
from tfm.nn.models import DecoderLM


def tiny(**changes) -> ModelConfig:
    return ModelConfig(**{**TINY, **changes})


def test_layernorm_is_exact_when_the_mean_is_large_against_the_spread():
    """Mean 100, std 1: the fast E[x^2] - E[x]^2 variance is ~3e-3 off in float32."""
    rng = np.random.default_rng(0)
    x = (100.0 + rng.standard_normal((8, 256))).astype(np.float32)
    config = ModelConfig(d_model=256, num_heads=4, norm_eps=1e-5)
    norm = Norm(config)
    params = norm.init(jax.random.PRNGKey(0), jnp.asarray(x))
    got = np.asarray(norm.apply(params, jnp.asarray(x)), np.float64)
    x64 = x.astype(np.float64)
    centred = x64 - x64.mean(-1, keepdims=True)
    want = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5)
    assert np.abs(got - want).max() < 1e-4


def _feed_forward(activation: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
    config = tiny(activation=activation, use_bias=False)
    module = FeedForward(config)
    params = nn.meta.unbox(module.init(jax.random.PRNGKey(1), jnp.asarray(x))["params"])
    out = np.asarray(module.apply({"params": params}, jnp.asarray(x)), np.float64)
    weights = {k: np.asarray(v["kernel"], np.float64) for k, v in params.items()}
    return out, x.astype(np.float64), weights


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def test_gelu_tanh_is_gpt2_gelu_new():
    x = np.random.default_rng(2).standard_normal((2, 3, TINY["d_model"])).astype(np.float32) * 3
    out, x64, w = _feed_forward("gelu_tanh", x)
    np.testing.assert_allclose(out, _gelu_tanh(x64 @ w["wi"]) @ w["wo"], atol=1e-5)
    exact, _, _ = _feed_forward("gelu", x)
    assert np.abs(exact - out).max() > 1e-5  # the two GELUs are different functions


def test_geglu_is_t5_v11_gated_gelu():
    x = np.random.default_rng(3).standard_normal((2, 3, TINY["d_model"])).astype(np.float32)
    out, x64, w = _feed_forward("geglu", x)
    want = (_gelu_tanh(x64 @ w["wi_gate"]) * (x64 @ w["wi"])) @ w["wo"]
    np.testing.assert_allclose(out, want, atol=1e-5)


@pytest.mark.parametrize(
    "changes, with_bias",
    [
        (dict(use_bias=True), {"query", "key", "value", "out"}),
        (dict(use_bias=False, qkv_bias=True), {"query", "key", "value"}),
        (dict(use_bias=True, qkv_bias=False), {"out"}),
        (dict(use_bias=True, attention_out_bias=False), {"query", "key", "value"}),
    ],
)
def test_attention_bias_switches(changes, with_bias):
    config = tiny(**changes)
    x = jnp.ones((1, 3, config.d_model))
    positions = jnp.arange(3)[None]
    inputs = AttentionInputs(positions, positions, AttentionStructure())
    params = MultiHeadAttention(config).init(jax.random.PRNGKey(0), x, x, inputs)["params"]
    assert {name for name, p in params.items() if "bias" in p} == with_bias


def test_mlp_and_lm_head_bias_switches():
    config = tiny(use_bias=True, mlp_bias=False, tie_output=False, lm_head_bias=True,
                  num_encoder_layers=0)
    params = DecoderLM(config).init(jax.random.PRNGKey(0), jnp.ones((1, 3), jnp.int32))["params"]
    ffn = params["decoder"]["stack"]["layer_0"]["feed_forward"]
    assert "bias" not in ffn["wi"] and "bias" not in ffn["wo"]
    assert params["decoder"]["output_projection"]["bias"].shape == (config.vocab_size,)


def test_attention_scale_and_output_scale_change_the_logits_as_specified():
    tokens = jnp.array([[3, 4, 5, 6]])
    base = tiny(num_encoder_layers=0, num_decoder_layers=1, position_scheme="none")
    params = nn.meta.unbox(DecoderLM(base).init(jax.random.PRNGKey(0), tokens)["params"])
    logits = lambda config, p=params: DecoderLM(config).apply({"params": p}, tokens)
    # Scaling the query kernel by s with attention_scale=1 equals the default 1/sqrt(head_dim)
    # applied to a kernel scaled by s * sqrt(head_dim).
    head_dim = base.resolved_head_dim
    query = params["decoder"]["stack"]["layer_0"]["self_attention"]["query"]
    folded = jax.tree.map(lambda x: x, params)
    folded["decoder"]["stack"]["layer_0"]["self_attention"]["query"] = {
        "kernel": query["kernel"] * head_dim**-0.5, "bias": query["bias"] * head_dim**-0.5
    }
    np.testing.assert_allclose(
        logits(base.replace(attention_scale=1.0), folded), logits(base), atol=1e-5
    )
    assert np.abs(logits(base.replace(attention_scale=1.0)) - logits(base)).max() > 1e-3
    # output_scale multiplies the final hidden state before the (tied, bias-free) head.
    np.testing.assert_allclose(logits(base.replace(output_scale=0.5)), 0.5 * logits(base),
                               rtol=1e-5, atol=1e-6)


def test_final_norm_after_post_ln_normalises_the_output():
    tokens = jnp.array([[3, 4, 5, 6]])
    config = tiny(num_encoder_layers=0, final_norm=True, tie_output=False)
    model = DecoderLM(config)
    params = model.init(jax.random.PRNGKey(0), tokens)["params"]
    assert "final_norm" in params["decoder"]["stack"]
    pre = tiny(num_encoder_layers=0, norm_placement="pre", final_norm=False)
    pre_params = DecoderLM(pre).init(jax.random.PRNGKey(0), tokens)["params"]
    assert "final_norm" not in pre_params["decoder"]["stack"]


@pytest.mark.parametrize("scheme", ["none", "sinusoidal", "rope", "relative", "alibi"])
def test_position_layers_add_what_the_registry_entry_says(scheme):
    """PositionEmbedding adds the scheme's embedding (identity without one); PositionBias
    returns the scheme's logit bias by parts (None without one), whose dense and block forms
    give the same values."""
    config = tiny(position_scheme=scheme)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, config.d_model)), jnp.float32)
    token_positions = jnp.broadcast_to(jnp.arange(5), (2, 5))
    embedded = PositionEmbedding(config).apply({}, x, token_positions)
    want = x
    if scheme == "sinusoidal":
        want = x + positions.sinusoidal(token_positions, config.d_model)
    np.testing.assert_allclose(embedded, want, atol=1e-6)
    by_blocks = PositionBias(config, bidirectional=False).apply(
        {}, token_positions, token_positions)
    if scheme == "alibi":
        slopes = positions.alibi_slopes(config.num_heads)
        want = positions.alibi_bias(token_positions, token_positions, slopes)
        np.testing.assert_allclose(masks.dense_position_bias(by_blocks), want, atol=1e-6)
        np.testing.assert_array_equal(positions.dense_from_blocks(
            by_blocks.function, by_blocks.params, by_blocks.query_positions,
            by_blocks.key_positions), want)
        assert not by_blocks.learned
    else:
        assert by_blocks is None


def test_gelu_is_the_exact_gelu():
    x = np.linspace(-8.0, 8.0, 2001)
    expected = 0.5 * x * (1.0 + np.vectorize(__import__("math").erf)(x / np.sqrt(2.0)))
    np.testing.assert_allclose(layers.gelu(jnp.asarray(x, jnp.float32)), expected, atol=2e-6)
    np.testing.assert_allclose(layers.gelu(jnp.asarray(x, jnp.float32)),
                               jax.nn.gelu(jnp.asarray(x, jnp.float32), approximate=False),
                               atol=2e-6)


def test_ffn_activation_dtype_rounds_the_hidden_layer_where_asked(monkeypatch):
    """"float32" applies the activation to the float32 accumulator, "compute" to the bf16
    output (GELU of a rounded input: different values); "auto" is float32 on CPU and
    compute on TPU; with float32 compute all three agree exactly."""
    from tfm import kernels

    x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 5, 16)), jnp.float32)

    def run(dtype: str, choice: str) -> jax.Array:
        module = FeedForward(tiny(dtype=dtype, ffn_activation_dtype=choice, activation="gelu"))
        params = module.init(jax.random.key(0), x)
        return module.apply(params, x.astype(dtype)).astype(jnp.float32)

    np.testing.assert_array_equal(run("float32", "compute"), run("float32", "float32"))
    np.testing.assert_array_equal(run("bfloat16", "auto"), run("bfloat16", "float32"))
    assert float(jnp.abs(run("bfloat16", "compute") - run("bfloat16", "float32")).max()) > 0
    monkeypatch.setattr(kernels, "platform", lambda: "tpu")
    np.testing.assert_array_equal(run("bfloat16", "auto"), run("bfloat16", "compute"))
    with pytest.raises(Exception, match="ffn_activation_dtype='half' is unknown"):
        tiny(ffn_activation_dtype="half")
