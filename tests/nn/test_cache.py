"""KV-cache decoding equals the full forward pass, for every position scheme."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TINY, TINY_LM

from tfm.kernels.cache_layouts import MODEL_AXES, REFERENCE
from tfm.kernels.cpu_cache import CPU_LAYOUT
from tfm.nn.cache import grow, init_cache, reorder_beams
from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM, EncoderDecoder, output_kernel
from tfm.nn.positions import POSITION_SCHEMES

TOKENS = jax.random.randint(jax.random.PRNGKey(0), (2, 8), 3, 13)
PROMPT_LENGTHS = np.array([3, 5])


def config_for(scheme: str, **changes) -> ModelConfig:
    """A decoder-only LM's config (TINY_LM); changes may add encoder layers (TINY's)."""
    return ModelConfig(**{**TINY_LM, "position_scheme": scheme, **changes})


SEQ2SEQ = dict(num_encoder_layers=TINY["num_encoder_layers"])


# Every scheme unrolled with the CPU kernels ("auto" here); the scanned cache path and the
# reference backend (the model-layout cache) on two schemes each, to keep the suite fast.
# "cpu+reference": the CPU attention kernel reading the model-layout cache, with the reference
# matmul (the three choices made separately).
@pytest.mark.parametrize(
    "scheme,scan,backend",
    [(scheme, False, "auto") for scheme in POSITION_SCHEMES]
    + [("rope", True, "auto"), ("t5_bias", True, "auto")]
    + [("relative", False, "reference"), ("alibi", True, "reference")]
    + [("rope", False, "cpu+reference"), ("t5_bias", True, "cpu+reference")],
)
def test_lm_prefill_then_steps_equal_full_forward(scheme, scan, backend):
    choices = dict(attention_backend=backend)
    if backend == "cpu+reference":
        choices = dict(attention_backend="cpu", cache_layout="reference", matmul="reference")
    config = config_for(scheme, scan_layers=scan, local_window=4 if scheme == "alibi" else None,
                        **choices)
    model = DecoderLM(config)
    params = model.init(jax.random.PRNGKey(1), TOKENS)["params"]
    full = model.apply({"params": params}, TOKENS)  # [batch, 8, vocab]

    # Prompts of different lengths, right-padded to 5; each row continues from its own end.
    prompts = jnp.where(jnp.arange(5)[None] < PROMPT_LENGTHS[:, None], TOKENS[:, :5], 0)
    cache = init_cache(config, batch_size=2, max_len=10)
    logits, cache = model.apply({"params": params}, prompts, cache=cache)
    for row, length in enumerate(PROMPT_LENGTHS):
        np.testing.assert_allclose(logits[row, :length], full[row, :length], atol=1e-5)
    cache = cache.replace(lengths=jnp.asarray(PROMPT_LENGTHS, jnp.int32))
    for _ in range(3):
        step_tokens = TOKENS[jnp.arange(2), cache.lengths][:, None]
        expected = full[jnp.arange(2), cache.lengths]
        logits, cache = model.apply({"params": params}, step_tokens, cache=cache)
        np.testing.assert_allclose(logits[:, 0], expected, atol=1e-5)
    np.testing.assert_array_equal(cache.lengths, PROMPT_LENGTHS + 3)


@pytest.mark.parametrize(
    "scheme,backend",
    [(scheme, "auto") for scheme in POSITION_SCHEMES] + [("t5_bias", "reference")],
)
def test_encoder_decoder_cached_decoding_equals_full_forward(scheme, backend):
    config = config_for(scheme, share_embeddings=False, source_vocab_size=11,
                        attention_backend=backend, **SEQ2SEQ)
    model = EncoderDecoder(config)
    source = jnp.array([[3, 4, 5, 6, 7, 0], [8, 9, 10, 4, 5, 6]])  # row 0 padded
    params = model.init(jax.random.PRNGKey(2), source, TOKENS)["params"]
    full = model.apply({"params": params}, source, TOKENS, source_valid=source != 0)

    encoded = model.apply(
        {"params": params}, source, source_valid=source != 0, method=EncoderDecoder.encode
    )
    cache = init_cache(config, batch_size=2, max_len=8, source_len=6)
    # A multi-token first call projects cross-attention keys/values into the cache ...
    logits, cache = model.apply(
        {"params": params},
        TOKENS[:, :3],
        encoded=encoded,
        source_valid=source != 0,
        cache=cache,
        method=EncoderDecoder.decode,
    )
    np.testing.assert_allclose(logits, full[:, :3], atol=1e-5)
    # ... and later steps read them from the cache without the encoder output.
    for step in range(3, 8):
        logits, cache = model.apply(
            {"params": params},
            TOKENS[:, step : step + 1],
            encoded=None,
            cache=cache,
            method=EncoderDecoder.decode,
        )
        np.testing.assert_allclose(logits[:, 0], full[:, step], atol=1e-5)


def test_cache_from_another_config_is_rejected():
    config = config_for("rope")
    model = DecoderLM(config)
    params = model.init(jax.random.PRNGKey(1), TOKENS)["params"]
    wrong = init_cache(config.replace(num_kv_heads=4), batch_size=2, max_len=10)
    with pytest.raises(ValueError, match="another model config"):
        model.apply({"params": params}, TOKENS[:, :2], cache=wrong)
    other_layout = init_cache(config.replace(attention_backend="reference"), 2, 10)
    layout_error = "'reference' layout but the model .attention_backend='auto'"
    with pytest.raises(ValueError, match=layout_error):
        model.apply({"params": params}, TOKENS[:, :2], cache=other_layout)


def test_prompt_longer_than_cache_is_rejected():
    config = config_for("rope")
    model = DecoderLM(config)
    params = model.init(jax.random.PRNGKey(1), TOKENS)["params"]
    with pytest.raises(ValueError, match="longer than the cache"):
        model.apply({"params": params}, TOKENS, cache=init_cache(config, 2, max_len=4))


def test_tokens_past_the_cache_end_raise_or_give_nan():
    """6 of 8 slots filled, then 4 more tokens: a clear error when lengths are known; under jit
    (lengths traced) NaN logits for that row rather than a silently clamped write."""
    config = config_for("rope")
    model = DecoderLM(config)
    params = model.init(jax.random.PRNGKey(1), TOKENS)["params"]
    cache = init_cache(config, batch_size=2, max_len=8)
    _, cache = model.apply({"params": params}, TOKENS[:, :6], cache=cache)
    cache = cache.replace(lengths=jnp.array([6, 2], jnp.int32))  # row 1 still has room
    with pytest.raises(ValueError, match=r"do not fit the cache: rows \[0\] already hold \[6\]"):
        model.apply({"params": params}, TOKENS[:, 2:6], cache=cache)

    step = jax.jit(lambda tokens, cache: model.apply({"params": params}, tokens, cache=cache))
    logits, _ = step(TOKENS[:, 2:6], cache)
    assert np.isnan(logits[0]).all()
    assert np.isfinite(logits[1]).all()
    # Row 1's tokens at positions 2..5 equal the full forward pass.
    full = model.apply({"params": params}, TOKENS)
    np.testing.assert_allclose(logits[1], full[1, 2:6], atol=1e-5)


def test_cache_form_per_layer_or_stacked_and_both_decode_exactly():
    """Per-layer buffers at batch >= 2 unrolled; one stacked array under scan_layers and at
    batch 1. A batch-1 (stacked) and a batch-2 (per-layer) cache decode the same row alike."""
    config = config_for("alibi")
    per_layer = init_cache(config, batch_size=2, max_len=8)
    assert isinstance(per_layer.keys, tuple) and len(per_layer.keys) == config.num_decoder_layers
    head_dim = config.d_model // config.num_heads
    assert per_layer.keys[0].shape == (2, config.resolved_num_kv_heads, head_dim, 8)
    assert per_layer.values[0].shape == (2, config.resolved_num_kv_heads, 8, head_dim)
    stacked = init_cache(config, batch_size=1, max_len=8)
    assert stacked.keys.shape == (1, config.num_decoder_layers, config.resolved_num_kv_heads,
                                  head_dim, 8)
    assert not isinstance(init_cache(config.replace(scan_layers=True), 2, 8).keys, tuple)

    model = DecoderLM(config)
    params = model.init(jax.random.PRNGKey(1), TOKENS)["params"]
    full = model.apply({"params": params}, TOKENS)
    step = jax.jit(lambda tokens, cache: model.apply({"params": params}, tokens, cache=cache))
    for cache, rows in ((per_layer, TOKENS), (stacked, TOKENS[:1])):
        logits, cache = step(rows[:, :4], cache)
        for position in range(4, 8):
            logits, cache = step(rows[:, position : position + 1], cache)
            np.testing.assert_allclose(logits[:, 0], full[: len(rows), position], atol=1e-5)


@pytest.mark.parametrize("batch, scan", [(2, False), (1, False), (2, True)])
def test_grown_cache_decodes_like_a_full_size_one(batch, scan):
    """A cache with room for the prompt only, grown slot block by slot block (per-layer and
    stacked layouts), decodes exactly like one built at full size; grow keeps what was filled."""
    config = config_for("rope", scan_layers=scan)
    model = DecoderLM(config)
    params = model.init(jax.random.PRNGKey(1), TOKENS)["params"]
    full = model.apply({"params": params}, TOKENS)[:batch]
    step = jax.jit(lambda tokens, cache: model.apply({"params": params}, tokens, cache=cache))
    logits, cache = step(TOKENS[:batch, :4], init_cache(config, batch, max_len=4))
    before = jax.tree.leaves(cache)
    cache = grow(cache, 2)
    assert cache.max_len == 6 and bool(cache.valid.all())
    for old, new in zip(before, jax.tree.leaves(cache), strict=True):
        if old.shape != new.shape:  # slots: the old ones kept, the new ones empty
            axis = next(a for a in range(old.ndim) if old.shape[a] != new.shape[a])
            np.testing.assert_array_equal(jnp.take(new, jnp.arange(4), axis=axis), old)
            added = jnp.take(new, jnp.arange(4, 6), axis=axis)
            assert added.all() if new.dtype == bool else not added.any()  # valid / empty
    for position in range(4, 8):
        if position == 6:
            cache = grow(cache, 2)
        logits, cache = step(TOKENS[:batch, position : position + 1], cache)
        np.testing.assert_allclose(logits[:, 0], full[:, position], atol=1e-5)
    with pytest.raises(ValueError, match="extra_slots=-1"):
        grow(cache, -1)


def test_output_kernel_gives_the_tied_tables_logits_and_checks_its_use():
    """Decoding passes the tied table's transpose, made once, as output_kernel: the logits of
    a prefill and of cached steps are the table's own, for both model kinds."""
    source = jnp.array([[3, 4, 5, 6, 7, 0], [8, 9, 10, 4, 5, 6]])
    for model_class in (DecoderLM, EncoderDecoder):
        seq2seq = model_class is EncoderDecoder
        config = config_for("rope", **(SEQ2SEQ if seq2seq else {}))
        model = model_class(config)
        inputs = (source, TOKENS) if seq2seq else (TOKENS,)
        params = model.init(jax.random.PRNGKey(3), *inputs)["params"]
        kernel = output_kernel(params, config)
        assert kernel.shape == (config.d_model, config.vocab_size)
        extra = {}
        if seq2seq:
            encoded = model.apply({"params": params}, source, method=EncoderDecoder.encode)
            extra = dict(encoded=encoded, method=EncoderDecoder.decode)
        caches = [init_cache(config, 2, 8, source_len=6 if seq2seq else None) for _ in range(2)]
        for start, stop in ((0, 3), (3, 4), (4, 5)):
            chunk = TOKENS[:, start:stop]
            plain, caches[0] = model.apply({"params": params}, chunk, cache=caches[0], **extra)
            fast, caches[1] = model.apply({"params": params}, chunk, cache=caches[1],
                                          output_kernel=kernel, **extra)
            np.testing.assert_allclose(fast, plain, atol=1e-6, rtol=1e-6)
            extra.pop("encoded", None)
            if seq2seq:
                extra["encoded"] = None
        with pytest.raises(ValueError, match=r"\[d_model, vocab\]"):
            model.apply({"params": params}, TOKENS[:, :1], cache=caches[0],
                        output_kernel=kernel.T, **extra)

    untied = config_for("rope", tie_output=False)
    params = DecoderLM(untied).init(jax.random.PRNGKey(3), TOKENS)["params"]
    assert output_kernel(params, untied) is None
    with pytest.raises(ValueError, match="untied"):
        DecoderLM(untied).apply({"params": params}, TOKENS, output_kernel=kernel)


@pytest.mark.parametrize("scan", [False, True])
def test_reorder_beams_moves_self_attention_rows_and_keeps_cross_attention(scan):
    config = config_for("rope", scan_layers=scan)
    cache = init_cache(config, batch_size=4, max_len=5, source_len=3)
    rng = np.random.default_rng(0)
    fill = lambda leaf: jnp.asarray(rng.normal(size=leaf.shape), leaf.dtype)
    cache = cache.replace(
        keys=jax.tree.map(fill, cache.keys), values=jax.tree.map(fill, cache.values),
        cross_keys=jax.tree.map(fill, cache.cross_keys),
        cross_values=jax.tree.map(fill, cache.cross_values),
        lengths=jnp.array([1, 2, 3, 4], jnp.int32),
        valid=jnp.asarray(rng.random((4, 5)) < 0.5),
        source_valid=jnp.asarray(rng.random((4, 3)) < 0.5),
    )
    parents = jnp.array([[1, 1], [1, 0]])  # each beam's parent among its source's two beams
    index = jnp.array([1, 1, 3, 2])  # the same as rows of the cache
    moved = reorder_beams(cache, parents)
    for name in ("keys", "values"):
        for old, new in zip(jax.tree.leaves(getattr(cache, name)),
                            jax.tree.leaves(getattr(moved, name)), strict=True):
            np.testing.assert_array_equal(new, np.asarray(old)[np.asarray(index)])
    np.testing.assert_array_equal(moved.lengths, [2, 2, 4, 3])
    np.testing.assert_array_equal(moved.valid, np.asarray(cache.valid)[np.asarray(index)])
    for name in ("cross_keys", "cross_values", "source_valid"):
        for old, new in zip(jax.tree.leaves(getattr(cache, name)),
                            jax.tree.leaves(getattr(moved, name)), strict=True):
            assert new is old


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("layout", [REFERENCE, CPU_LAYOUT], ids=["reference", "cpu"])
@pytest.mark.parametrize("is_key", [True, False], ids=["keys", "values"])
def test_layout_write_puts_each_rows_new_slots_at_its_own_start(dtype, stacked, layout, is_key):
    """Per-row starts, every cache dtype (the CPU layout writes bf16 through a uint16 view of
    the same bits), every layout: the written slots equal the new values bit for bit, read back
    in the model's layout, and every other slot is untouched."""
    batch, heads, max_len, head_dim, new_len, layers = 3, 2, 8, 4, 2, 2
    rng = np.random.default_rng(0)
    old_model = rng.normal(size=(layers, batch, max_len, heads, head_dim)).astype(np.float32)
    to_layout = [MODEL_AXES.index(axis) for axis in layout.axes(is_key)]
    from_layout = [layout.axes(is_key).index(axis) for axis in MODEL_AXES]
    old = np.stack([layer.transpose(to_layout) for layer in old_model])
    new = jnp.asarray(rng.normal(size=(batch, new_len, heads, head_dim)), dtype)
    start = jnp.asarray([0, 3, 6], jnp.int32)
    slots = (jnp.asarray(np.moveaxis(old, 0, 1), dtype) if stacked
             else tuple(jnp.asarray(layer_old, dtype) for layer_old in old))
    written = layout.write(slots, new, 1, start, is_key)
    read = lambda layer: np.asarray(layout.read(written, layer)).astype(np.float32).transpose(
        from_layout)
    want = np.asarray(jnp.asarray(old_model[1], dtype)).astype(np.float32)
    new_np = np.asarray(new).astype(np.float32)
    for row, row_start in enumerate(np.asarray(start)):
        want[row, row_start:row_start + new_len] = new_np[row]
    np.testing.assert_array_equal(read(1), want)
    np.testing.assert_array_equal(read(0), np.asarray(jnp.asarray(old_model[0], dtype)).astype(
        np.float32))


def test_cache_for_another_batch_or_length_is_one_clear_error():
    """A cache built for 2 rows fed 4 (prefill or step, eager or jitted), or whose valid flags
    do not match its slots: one error naming the leaf and both sizes, not a vmap error."""
    config = config_for("rope")
    model = DecoderLM(config)
    params = model.init(jax.random.PRNGKey(1), TOKENS)["params"]
    four = jnp.concatenate([TOKENS, TOKENS])
    message = (r"^cache.keys\[0\] has shape \(2, .*\): the cache holds 2 rows but the tokens "
               r"have 4; build it for this batch with tfm.nn.cache.init_cache\(config, "
               r"batch_size=4, max_len=...\)")
    for tokens in (four[:, :3], four[:, :1]):
        with pytest.raises(ValueError, match=message):
            model.apply({"params": params}, tokens, cache=init_cache(config, 2, 10))
        with pytest.raises(ValueError, match=message):
            jax.jit(lambda tokens, cache: model.apply({"params": params}, tokens, cache=cache))(
                tokens, init_cache(config, 2, 10))
    cache = init_cache(config, 2, 10)
    with pytest.raises(ValueError, match=r"cache.valid has shape \(2, 12\) but the keys hold 10"):
        model.apply({"params": params}, TOKENS[:, :3],
                    cache=cache.replace(valid=jnp.ones((2, 12), bool)))
