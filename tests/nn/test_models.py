"""Model-level invariants: causality, padding and segment isolation, cross-attention, backends,
scan vs unrolled, bf16, and the paper-base parameter count."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TINY, TINY_LM

from tfm.nn.config import ModelConfig, paper_base
from tfm.nn.models import DecoderLM, Encoder, EncoderDecoder, stack_layer_params
from tfm.nn.positions import POSITION_SCHEMES


def tiny(**changes) -> ModelConfig:
    return ModelConfig(**{**TINY, **changes})


def tiny_lm(**changes) -> ModelConfig:
    return ModelConfig(**{**TINY_LM, **changes})


def tokens_from(seed: int, shape: tuple[int, int], low: int = 3) -> jnp.ndarray:
    return jax.random.randint(jax.random.PRNGKey(seed), shape, low, TINY["vocab_size"])


def init(model: nn.Module, *args, **kwargs):
    return model.init(jax.random.PRNGKey(0), *args, **kwargs)["params"]


@pytest.mark.parametrize("scheme", POSITION_SCHEMES)
def test_decoder_is_causal_by_gradients(scheme):
    """d logits_i / d embedding_j is zero exactly when j > i, under every position scheme."""
    config = tiny_lm(position_scheme=scheme, t5_shared_across_layers=scheme != "t5_bias")
    model = DecoderLM(config)
    tokens = tokens_from(1, (1, 6))
    variables = model.init(jax.random.PRNGKey(0), tokens)

    def logits_sum(perturbation):
        logits = model.apply({**variables, "perturbations": perturbation}, tokens)
        return logits.sum(-1)[0]  # [len]

    jacobian = jax.jacrev(logits_sum)(variables["perturbations"])
    jacobian = jax.tree.leaves(jacobian)[0]  # [len(out), 1, len(in), d_model]
    influence = np.abs(np.asarray(jacobian)).sum(axis=(1, 3))  # [out, in]
    future = np.triu(np.ones_like(influence, bool), k=1)
    assert np.all(influence[future] == 0.0)
    assert np.all(influence[~future] > 0.0)


@pytest.mark.parametrize("scheme", POSITION_SCHEMES)
def test_encoder_real_tokens_ignore_padding(scheme):
    config = tiny(position_scheme=scheme)
    model = Encoder(config)
    real = tokens_from(2, (1, 5))
    short = jnp.pad(real, ((0, 0), (0, 2)), constant_values=7)  # padding marked by `valid`
    long = jnp.pad(real, ((0, 0), (0, 6)), constant_values=9)
    params = init(model, long)
    valid = lambda x: jnp.arange(x.shape[1])[None] < 5
    out_short = model.apply({"params": params}, short, valid=valid(short))
    out_long = model.apply({"params": params}, long, valid=valid(long))
    np.testing.assert_allclose(out_short[:, :5], out_long[:, :5], atol=1e-5)


@pytest.mark.parametrize(
    "scheme", ["sinusoidal", "learned", "rope", "relative", "t5_bias", "alibi"]
)
def test_packed_segments_match_separate_runs(scheme):
    """Two examples packed in one row (positions restart) give the same logits as run alone;
    changing one segment never changes the other."""
    config = tiny_lm(position_scheme=scheme)
    model = DecoderLM(config)
    first, second = tokens_from(3, (1, 4)), tokens_from(4, (1, 5))
    packed = jnp.concatenate([first, second], axis=1)
    segment_ids = jnp.array([[1] * 4 + [2] * 5])
    positions = jnp.array([list(range(4)) + list(range(5))])
    params = init(model, packed)
    apply = lambda tokens: model.apply(
        {"params": params}, tokens, positions=positions, segment_ids=segment_ids
    )
    packed_logits = apply(packed)
    alone_first = model.apply({"params": params}, first)
    alone_second = model.apply({"params": params}, second)
    np.testing.assert_allclose(packed_logits[:, :4], alone_first, atol=1e-5)
    np.testing.assert_allclose(packed_logits[:, 4:], alone_second, atol=1e-5)
    changed = apply(packed.at[:, 5:].set(7))
    np.testing.assert_allclose(changed[:, :4], packed_logits[:, :4], atol=1e-6)
    assert not np.allclose(changed[:, 5:], packed_logits[:, 5:])


def test_decoder_sees_source_only_through_cross_attention():
    config = tiny(position_scheme="sinusoidal")
    model = EncoderDecoder(config)
    source, inputs = tokens_from(5, (2, 7)), tokens_from(6, (2, 5))
    params = init(model, source, inputs)
    logits = model.apply({"params": params}, source, inputs)
    other_source = model.apply({"params": params}, source.at[:, 3].set(4), inputs)
    assert np.abs(np.asarray(other_source - logits)).max() > 1e-4
    # With cross-attention outputs zeroed, the source can no longer reach the decoder.
    zeroed = jax.tree_util.tree_map_with_path(
        lambda path, x: (
            jnp.zeros_like(x)
            if "cross_attention" in jax.tree_util.keystr(path)
            and "'out'" in jax.tree_util.keystr(path)
            else x
        ),
        params,
    )
    a = model.apply({"params": zeroed}, source, inputs)
    b = model.apply({"params": zeroed}, source.at[:, 3].set(4), inputs)
    np.testing.assert_allclose(a, b, atol=1e-6)
    # Source padding is masked: changing what sits behind it changes nothing.
    padded = source.at[:, 5:].set(0)
    real = lambda x: jnp.broadcast_to(jnp.arange(x.shape[1]) < 5, x.shape)
    c = model.apply({"params": params}, padded, inputs, source_valid=real(padded))
    longer = jnp.pad(padded[:, :5], ((0, 0), (0, 4)), constant_values=3)
    d = model.apply({"params": params}, longer, inputs, source_valid=real(longer))
    np.testing.assert_allclose(c, d, atol=1e-5)


@pytest.mark.parametrize("scheme", ["rope", "alibi", "t5_bias"])
def test_backends_agree_in_float32(scheme):
    model_ref = DecoderLM(tiny_lm(position_scheme=scheme, local_window=3))
    model_xla = DecoderLM(tiny_lm(position_scheme=scheme, local_window=3, attention_backend="xla"))
    tokens = tokens_from(7, (2, 8))
    params = init(model_ref, tokens)
    np.testing.assert_allclose(
        model_ref.apply({"params": params}, tokens),
        model_xla.apply({"params": params}, tokens),
        atol=1e-5,
    )


@pytest.mark.parametrize(
    "changes",
    [
        dict(position_scheme="t5_bias", t5_shared_across_layers=False, norm_placement="pre"),
        dict(position_scheme="relative", activation="swiglu", norm_type="rmsnorm"),
    ],
)
def test_scanned_and_unrolled_layers_agree(changes):
    unrolled = EncoderDecoder(tiny(**changes))
    scanned = EncoderDecoder(tiny(scan_layers=True, **changes))
    source, inputs = tokens_from(8, (2, 6)), tokens_from(9, (2, 5))
    params = nn.meta.unbox(init(unrolled, source, inputs))
    stacked = stack_layer_params(params)
    expected_shapes = jax.tree.map(jnp.shape, nn.meta.unbox(init(scanned, source, inputs)))
    assert jax.tree.map(jnp.shape, stacked) == expected_shapes
    np.testing.assert_allclose(
        unrolled.apply({"params": params}, source, inputs),
        scanned.apply({"params": stacked}, source, inputs),
        atol=1e-5,
    )


def test_bfloat16_compute_runs_close_to_float32():
    source, inputs = tokens_from(10, (2, 6)), tokens_from(11, (2, 5))
    model32 = EncoderDecoder(tiny(position_scheme="rope"))
    model16 = EncoderDecoder(tiny(position_scheme="rope", dtype="bfloat16"))
    params = init(model32, source, inputs)
    logits32 = model32.apply({"params": params}, source, inputs)
    logits16 = model16.apply({"params": params}, source, inputs)
    assert logits16.dtype == jnp.float32  # logits always come out in float32
    assert np.all(np.isfinite(logits16))
    np.testing.assert_allclose(logits16, logits32, atol=0.1)
    assert not np.array_equal(logits16, logits32)  # bf16 really was used


def test_dropout_is_active_only_when_not_deterministic():
    model = DecoderLM(tiny_lm(dropout_rate=0.5))
    tokens = tokens_from(12, (1, 6))
    params = init(model, tokens)
    eval_a = model.apply({"params": params}, tokens)
    eval_b = model.apply({"params": params}, tokens)
    train = model.apply(
        {"params": params}, tokens, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)}
    )
    np.testing.assert_array_equal(eval_a, eval_b)
    assert not np.allclose(train, eval_a)


def test_learned_positions_past_max_len_raise():
    model = DecoderLM(tiny_lm(position_scheme="learned", max_len=8))
    params = init(model, tokens_from(13, (1, 8)))
    with pytest.raises(ValueError, match="max_len"):
        model.apply({"params": params}, tokens_from(13, (1, 9)))


def test_paper_base_parameter_count():
    """Vaswani et al. report 65M parameters for the base model (Table 3)."""
    config = paper_base(vocab_size=37000)
    model = EncoderDecoder(config)
    shapes = jax.eval_shape(
        model.init, jax.random.PRNGKey(0), jnp.ones((1, 4), jnp.int32), jnp.ones((1, 4), jnp.int32)
    )
    count = sum(np.prod(x.shape) for x in jax.tree.leaves(nn.meta.unbox(shapes["params"])))
    d, f, n, v = 512, 2048, 6, 37000
    attention_params = 4 * (d * d + d)
    ffn_params = d * f + f + f * d + d
    norm_params = 2 * d
    expected = (
        v * d
        + n * (attention_params + ffn_params + 2 * norm_params)
        + n * (2 * attention_params + ffn_params + 3 * norm_params)
    )
    assert count == expected
    assert 60e6 < count < 66e6


def _decode_step_by_step(model, params, config, tokens, valid, prefill):
    """Cached decoding: prefill the first `prefill` tokens in one call, then one token a step."""
    from tfm.nn.cache import init_cache

    cache = init_cache(config, tokens.shape[0], tokens.shape[1])
    logits, cache = model.apply(
        {"params": params}, tokens[:, :prefill], valid=valid[:, :prefill], cache=cache
    )
    steps = [logits]
    for i in range(prefill, tokens.shape[1]):
        logits, cache = model.apply(
            {"params": params}, tokens[:, i : i + 1], valid=valid[:, i : i + 1], cache=cache
        )
        steps.append(logits)
    return jnp.concatenate(steps, axis=1)


@pytest.mark.parametrize("scheme", ["learned", "rope", "alibi"])
def test_real_token_equal_to_pad_id_is_attended_like_any_other(scheme):
    """pad_id=0 and 0 is a real token (GPT-2's "!"): the full forward pass and cached decoding
    agree, and the logits differ from a model told those tokens are padding."""
    config = tiny_lm(position_scheme=scheme, pad_id=0)
    model = DecoderLM(config)
    tokens = jnp.array([[5, 0, 7, 0, 0, 3], [0, 4, 0, 8, 9, 0]])
    params = init(model, tokens)
    full = model.apply({"params": params}, tokens)
    valid = jnp.ones(tokens.shape, bool)
    cached = _decode_step_by_step(model, params, config, tokens, valid, prefill=2)
    np.testing.assert_allclose(cached, full, atol=1e-5)
    no_pad = DecoderLM(config.replace(pad_id=None)).apply({"params": params}, tokens)
    np.testing.assert_array_equal(no_pad, full)  # pad_id never enters the computation
    masked = model.apply({"params": params}, tokens, valid=tokens != 0)
    assert np.abs(np.asarray(masked - full))[:, 2:].max() > 1e-3


@pytest.mark.parametrize("scheme", ["learned", "rope", "t5_bias", "alibi"])
def test_left_padding_matches_the_unpadded_rows_in_full_and_cached_decoding(scheme):
    """Left-padded rows (pad token = a real token id 0, marked by `valid`) give the unpadded
    rows' logits, in the full forward pass and in cached decoding; the fully masked padding
    queries read nothing (no NaN, nothing from the future)."""
    config = tiny_lm(position_scheme=scheme, pad_id=0)
    model = DecoderLM(config)
    rows = [[0, 4, 6, 0, 9], [3, 0, 8]]  # 0 is also a real token
    width = 7
    tokens = jnp.array([[0] * (width - len(r)) + r for r in rows])
    valid = jnp.array([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    params = init(model, tokens)
    full = model.apply({"params": params}, tokens, valid=valid)
    assert np.isfinite(np.asarray(full)).all()
    for row, real in enumerate(rows):
        alone = model.apply({"params": params}, jnp.array([real]))
        np.testing.assert_allclose(full[row, width - len(real) :], alone[0], atol=1e-5)
    cached = _decode_step_by_step(model, params, config, tokens, valid, prefill=4)
    np.testing.assert_allclose(
        np.where(valid[..., None], cached, 0), np.where(valid[..., None], full, 0), atol=1e-5
    )


def test_decoder_only_config_and_decoder_lm_refuses_encoder_layers():
    """ModelConfig() stays the paper's 6 + 6-layer encoder-decoder; decoder_only() is a
    decoder-only LM's config (no encoder, every other default kept), and DecoderLM refuses
    encoder layers it would ignore, when it is built (before init or jit)."""
    from tfm.checks import ConfigError

    assert (ModelConfig().num_encoder_layers, ModelConfig().num_decoder_layers) == (6, 6)
    config = ModelConfig.decoder_only(vocab_size=13, num_layers=2, d_model=16, num_heads=4,
                                      d_ff=32)
    assert (config.num_encoder_layers, config.num_decoder_layers) == (0, 2)
    assert config == ModelConfig(vocab_size=13, num_encoder_layers=0, num_decoder_layers=2,
                                 d_model=16, num_heads=4, d_ff=32)
    tokens = tokens_from(9, (2, 5))
    params = init(DecoderLM(config), tokens)
    assert set(params) == {"embed", "decoder"}
    assert len(params["decoder"]["stack"]) == 2
    with pytest.raises(ConfigError, match=(
            r"^DecoderLM has no encoder, but model.num_encoder_layers=6 \(ModelConfig's default "
            r"is the paper's 6 \+ 6-layer encoder-decoder\); set model.num_encoder_layers=0")):
        DecoderLM(ModelConfig(vocab_size=13))
    with pytest.raises(ConfigError, match="num_encoder_layers=2"):
        DecoderLM(config.replace(num_encoder_layers=2))
    with pytest.raises(ConfigError, match=r"decoder_only\(\) sets num_encoder_layers itself"):
        ModelConfig.decoder_only(vocab_size=13, num_encoder_layers=1)
    with pytest.raises(ConfigError, match="num_layers= sets the decoder's depth"):
        ModelConfig.decoder_only(vocab_size=13, num_decoder_layers=1)


def test_attention_takes_few_arguments_and_blocks_no_lambdas():
    """MultiHeadAttention takes its cache plumbing as one value (tfm.nn.cache.CacheSlot) and its
    masks, bias and positions as another (AttentionInputs); Block calls its sublayers directly."""
    import ast
    import inspect
    import textwrap

    from tfm.nn.layers import MultiHeadAttention
    from tfm.nn.models import Block

    assert len(inspect.signature(MultiHeadAttention.__call__).parameters) - 1 <= 6
    source = textwrap.dedent(inspect.getsource(Block.__call__))
    assert not [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Lambda)]


@pytest.mark.parametrize("lm_head_bias", [False, True])
def test_untied_head_goes_through_kernels_linear(monkeypatch, lm_head_bias):
    from tfm import kernels

    config = ModelConfig(**{**TINY, "num_encoder_layers": 0, "tie_output": False,
                            "lm_head_bias": lm_head_bias, "num_decoder_layers": 1})
    tokens = jnp.asarray([[1, 2, 3]])
    model = DecoderLM(config)
    params = nn.meta.unbox(model.init(jax.random.PRNGKey(0), tokens)["params"])
    head = params["decoder"]["output_projection"]
    assert head["kernel"].shape == (config.d_model, config.vocab_size)
    assert ("bias" in head) == lm_head_bias
    kernels_used = []
    real_linear = kernels.linear

    def linear(x, kernel, **options):
        kernels_used.append(tuple(kernel.shape))
        return real_linear(x, kernel, **options)

    monkeypatch.setattr(kernels, "linear", linear)
    logits = model.apply({"params": params}, tokens)
    assert (config.d_model, config.vocab_size) in kernels_used
    hidden = model.apply({"params": params}, tokens, return_hidden=True)
    want = np.asarray(hidden) @ np.asarray(head["kernel"]) + np.asarray(head.get("bias", 0.0))
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)


def test_logits_at_gives_each_rows_logits_at_its_index_only():
    """logits_at (a prefill's last tokens) returns [batch, 1, vocab]: the full pass's logits at
    each row's index, with and without a cache."""
    from tfm.nn.cache import init_cache

    config = tiny_lm()
    model = DecoderLM(config)
    tokens = jnp.asarray(np.random.default_rng(3).integers(1, 13, (3, 9)), jnp.int32)
    params = init(model, tokens)
    full = model.apply({"params": params}, tokens)
    at = jnp.asarray([8, 0, 4])
    picked = model.apply({"params": params}, tokens, logits_at=at)
    assert picked.shape == (3, 1, full.shape[-1])
    np.testing.assert_allclose(picked[:, 0], full[jnp.arange(3), at], atol=1e-6)
    cached, _ = model.apply({"params": params}, tokens, cache=init_cache(config, 3, 9),
                            logits_at=at)
    np.testing.assert_allclose(cached[:, 0], full[jnp.arange(3), at], atol=2e-5)
