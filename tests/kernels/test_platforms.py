"""CPU tricks stay on CPU: the train step and the decoding loops of an LM and an
encoder-decoder, lowered for TPU and GPU on this machine (jax lowers for any platform without
its hardware), hold no optimization barrier and no CPU cache layout; lowered for CPU they do (so
the check can fail)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from tiny_model import TINY

from tfm import kernels
from tfm.checks import ConfigError
from tfm.decode import generate
from tfm.decode.search import DecodeConfig
from tfm.nn.cache import init_cache
from tfm.nn.config import ModelConfig
from tfm.training import train
from tfm.training.experiment import TrainState, model_for

BATCH, LENGTH = 2, 8
# jax's platform names for lowering; kernels.PLATFORMS' names for resolving "auto".
TARGETS = {"tpu": "tpu", "cuda": "gpu", "cpu": "cpu"}


def _config(mode: str, platform: str, **changes) -> ModelConfig:
    layers = dict(num_encoder_layers=0) if mode == "lm" else {}
    config = ModelConfig(**{**TINY, **layers, "dtype": "bfloat16", **changes})
    return config.for_platform(TARGETS[platform])


def _batch(mode: str) -> dict[str, jax.ShapeDtypeStruct]:
    ints = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
    keys = ["inputs", "targets", "positions", "segment_ids"]
    if mode == "seq2seq":
        keys += ["source", "source_positions", "source_segment_ids"]
    return {**{key: ints for key in keys}, "weights": jax.ShapeDtypeStruct((BATCH, LENGTH),
                                                                           jnp.float32)}


def _lowered_train_step(mode: str, platform: str, **changes) -> str:
    config = _config(mode, platform, **changes)
    model, optimizer = model_for(config, mode), optax.adamw(1e-3)
    batch = _batch(mode)

    def init(rng):
        dummy = {key: jnp.ones(value.shape, value.dtype) for key, value in batch.items()}
        args = (dummy["source"], dummy["inputs"]) if mode == "seq2seq" else (dummy["inputs"],)
        params = model.init(rng, *args)["params"]
        return TrainState(step=jnp.int32(0), params=params, opt_state=optimizer.init(params),
                          rng=jax.random.key_data(rng))

    state = jax.eval_shape(init, jax.random.key(0))
    step = functools.partial(train.train_step, model=model, mode=mode, optimizer=optimizer,
                             schedule=optax.constant_schedule(1e-3), label_smoothing=0.1)
    traced = jax.jit(step).trace(state, batch)
    return traced.lower(lowering_platforms=(platform,)).as_text()


def _lowered_decode_loop(mode: str, platform: str, method: str) -> str:
    config = _config(mode, platform)
    decode = DecodeConfig(method=method, max_new_tokens=6, beam_size=2)
    model = model_for(config, mode)
    ids = jnp.ones((BATCH, LENGTH), jnp.int32)
    args = (ids, ids) if mode == "seq2seq" else (ids,)
    params = jax.eval_shape(lambda: model.init(jax.random.key(0), *args)["params"])
    lengths = jax.ShapeDtypeStruct((BATCH,), jnp.int32)
    tokens = jax.ShapeDtypeStruct((BATCH, LENGTH), jnp.int32)
    rng = jax.random.key(0)
    if mode == "lm":
        loop = jax.jit(generate._lm_generate_jit.__wrapped__, static_argnums=(4, 5, 6))
        traced = loop.trace(params, tokens, lengths, rng, config, decode, 2)
    else:
        loop = jax.jit(generate._translate_jit.__wrapped__, static_argnums=(4, 5, 6, 7))
        traced = loop.trace(params, tokens, lengths, rng, config, decode, 1, 2)
    return traced.lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("mode", ["lm", "seq2seq"])
def test_train_step_for_accelerators_has_no_cpu_tricks(mode, platform):
    text = _lowered_train_step(mode, platform)
    assert "optimization_barrier" not in text
    assert "dot_general" in text  # it did lower the model


def test_cpu_train_step_does_have_them():
    """The same bf16 step lowered for CPU keeps its barriers (custom-VJP dense backward)."""
    assert "optimization_barrier" in _lowered_train_step("lm", "cpu")


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("mode,method", [("lm", "greedy"), ("seq2seq", "beam")])
def test_decode_loops_for_accelerators_have_no_cpu_tricks(mode, method, platform):
    text = _lowered_decode_loop(mode, platform, method)
    assert "stablehlo.while" in text
    assert "optimization_barrier" not in text
    assert "ui16" not in text  # the CPU cache writes 16-bit slots as uint16


def test_cpu_decode_loop_writes_its_cache_as_uint16():
    assert "ui16" in _lowered_decode_loop("lm", "cpu", "greedy")


def test_auto_resolves_per_platform_and_the_cache_follows():
    assert [kernels.resolve("auto", platform).name for platform in ("cpu", "gpu", "tpu")] == [
        "cpu", "cudnn", "splash"]
    for platform, layout in (("cpu", "cpu"), ("tpu", "reference"), ("cuda", "reference")):
        config = _config("lm", platform)
        assert init_cache(config, 1, 4).layout.name == layout
    assert ModelConfig(attention_backend="xla").for_platform("tpu").attention_backend == "xla"


@pytest.mark.parametrize("changes,platform,backend,reason", [
    (dict(position_scheme="rope"), "tpu", "splash", None),
    (dict(position_scheme="alibi"), "tpu", "flex", None),
    (dict(position_scheme="t5_bias"), "tpu", "flex", None),
    (dict(position_scheme="relative", relative_values=False), "tpu", "reference",
     "'flex': the position scheme adds a query logit bias"),
    (dict(attention_dropout_rate=0.1), "tpu", "reference", "attention_dropout_rate"),
    (dict(dtype="bfloat16", head_dim=8), "gpu", "cudnn", None),
    (dict(position_scheme="alibi", dtype="bfloat16", head_dim=8), "gpu", "flex", None),
    (dict(position_scheme="t5_bias", dtype="bfloat16", head_dim=8), "gpu", "flex", None),
    (dict(position_scheme="relative", relative_values=False, dtype="bfloat16", head_dim=8),
     "gpu", "reference", "'cudnn': the position scheme adds a query logit bias"),
    (dict(dtype="bfloat16"), "gpu", "reference", "head_dim=4"),
    (dict(dtype="float32"), "gpu", "reference", "dtype='float32'"),
    (dict(position_scheme="alibi"), "cpu", "cpu", None),
])
def test_auto_falls_back_to_the_reference_with_the_reason(changes, platform, backend, reason):
    """What each scheme gets on each platform: bias schemes go to the kernel that computes
    their bias per block (flex), others to the platform's first choice; fused kernels take no
    bias they cannot serve (splash: none; flex: none computed from queries; cuDNN: no learned
    one, jax-ml/jax#27184), and say why; flex serves only bias schemes under auto."""
    config = ModelConfig(**{**TINY, **changes})
    chosen, note = kernels.auto_choice(platform, **config.attention_needs)
    assert chosen.name == backend
    assert config.for_platform(platform).attention_backend == backend
    if reason is None:
        assert note is None
    else:
        assert reason in note and f"on {platform}" in note


@pytest.mark.parametrize("changes,message", [
    (dict(attention_backend="splash", position_scheme="alibi"), "fixed logit bias"),
    (dict(attention_backend="cudnn", position_scheme="t5_bias", dtype="bfloat16", head_dim=8),
     "learned"),
    (dict(attention_backend="cudnn", dtype="float32"), "dtype='float32'"),
    (dict(attention_backend="splash", attention_dropout_rate=0.1), "attention_dropout_rate"),
    (dict(attention_backend="flex", position_scheme="relative", relative_values=False),
     "query logit bias"),
])
def test_a_named_backend_that_cannot_serve_the_model_fails_in_the_config(changes, message):
    with pytest.raises(ConfigError, match=f"attention_backend='[a-z]+' cannot serve.*{message}"):
        ModelConfig(**{**TINY, **changes})


@pytest.mark.parametrize("backend", ["cpu", "xla"])
def test_every_kernel_equals_the_reference_forward_and_backward(backend):
    """Each registered attention and dense implementation against the reference maths, values
    and gradients, with GQA, a bias and a causal-padded mask (float32)."""
    rng = np.random.default_rng(0)
    length = 150  # the CPU kernel's causal blocks: 3 of them
    query = jnp.asarray(rng.normal(size=(2, length, 4, 8)), jnp.float32)
    key, value = (jnp.asarray(rng.normal(size=(2, length, 2, 8)), jnp.float32) for _ in "kv")
    bias = jnp.asarray(rng.normal(size=(1, 4, length, length)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(length), (2, length))
    mask = (positions[:, None, None, :] <= positions[:, None, :, None]) & (
        jnp.arange(length) < jnp.array([[length], [length - 30]]))[:, None, None, :]
    probe = jnp.asarray(rng.normal(size=query.shape), jnp.float32)

    def attention_loss(backend, query, key, value, bias):
        out = kernels.attention(query, key, value, bias=bias, mask=mask, backend=backend,
                                causal=True)
        return jnp.sum(jnp.sin(out) * probe)

    grad = jax.jit(jax.value_and_grad(attention_loss, (1, 2, 3, 4)), static_argnums=0)
    want, want_grads = grad("reference", query, key, value, bias)
    got, got_grads = grad(backend, query, key, value, bias)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for name, g, w in zip("qkvb", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5, err_msg=name)

    x = jnp.asarray(rng.normal(size=(3, 5, 4, 8)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(4, 8, 6)), jnp.float32)
    dense_loss = lambda backend, x, kernel: jnp.sum(jnp.cos(kernels.linear(
        x, kernel, backend=backend, num_contracted=2)))
    dense_grad = jax.jit(jax.value_and_grad(dense_loss, (1, 2)), static_argnums=0)
    want, want_grads = dense_grad("reference", x, kernel)
    got, got_grads = dense_grad(backend, x, kernel)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-4)


def test_xla_takes_a_pure_causal_mask_from_the_structure(monkeypatch):
    """Given AttentionStructure(causal=True), the xla backend passes jax.nn its own causal flag
    and no dense mask; with padding in the structure too, it writes the dense mask out. Both
    give the reference's values."""
    from tfm.kernels import jax_attention, reference
    from tfm.kernels.call import AttentionStructure

    rng = np.random.default_rng(5)
    query, key, value = (jnp.asarray(rng.normal(size=(2, 24, 2, 8)), jnp.float32)
                         for _ in "qkv")
    order = jnp.arange(24)[None]
    causal = order[:, None, None, :] <= order[:, None, :, None]
    valid = jnp.arange(24)[None] < jnp.asarray([[20], [24]])  # [2, 24]
    seen = []
    real_attention = jax_attention.attention

    def spy(*args, **options):
        seen.append((options["mask"] is None, options["is_causal"]))
        return real_attention(*args, **options)

    monkeypatch.setattr(jax_attention, "attention", spy)
    cases = [(AttentionStructure(causal=True), causal, (True, True)),
             (AttentionStructure(causal=True, key_valid=valid),
              causal & valid[:, None, None, :], (False, False))]
    for structure, mask, flags in cases:
        want = reference.dot_product_attention(query, key, value, mask=mask)
        got = kernels.attention(query, key, value, backend="xla", structure=structure)
        np.testing.assert_allclose(got, want, atol=1e-5)
        assert seen[-1] == flags


def test_setup_says_in_one_line_why_auto_takes_the_reference(caplog):
    from tfm.training import experiment

    shaw = ModelConfig(**{**TINY, "position_scheme": "relative", "relative_values": False})
    with caplog.at_level("INFO", logger=experiment.logger.name):
        resolved = experiment._model_for_platform(shaw, "tpu")
    assert resolved.attention_backend == "reference"
    notes = [record.getMessage() for record in caplog.records if "attention_backend" in
             record.getMessage()]
    assert notes == ["attention_backend='auto' uses 'reference' on tpu, not 'flex' or "
                     "'splash': 'flex': the position scheme adds a query logit bias, and it "
                     "takes fixed or learned bias; 'splash': the position scheme adds a query "
                     "logit bias, and it takes no bias"]
    caplog.clear()
    with caplog.at_level("INFO", logger=experiment.logger.name):
        assert experiment._model_for_platform(shaw.replace(position_scheme="alibi"),
                                              "cpu").attention_backend == "cpu"
        assert experiment._model_for_platform(
            shaw.replace(position_scheme="alibi", attention_backend="flex"),
            "cpu").attention_backend == "flex"
    notes = [record.getMessage() for record in caplog.records]
    assert notes == ["attention_backend='flex' runs its Pallas kernel in interpret mode on cpu: "
                     "exact but slow, for tests and debugging"]
    caplog.clear()
    with caplog.at_level("INFO", logger=experiment.logger.name):
        assert experiment._model_for_platform(shaw.replace(position_scheme="rope"),
                                              "tpu").attention_backend == "splash"
        assert experiment._model_for_platform(shaw.replace(position_scheme="t5_bias"),
                                              "tpu").attention_backend == "flex"
    assert not [r for r in caplog.records if "attention_backend" in r.getMessage()]


@pytest.mark.parametrize("changes,platform,blocked", [
    (dict(position_scheme="rope"), "tpu", "splash"),
    (dict(position_scheme="t5_bias"), "tpu", "flex"),
    (dict(position_scheme="alibi", dtype="bfloat16", head_dim=8), "gpu", "flex"),
])
def test_auto_gives_rows_within_one_kernel_block_to_the_reference(changes, platform, blocked):
    """A kernel that pads rows to 128-token blocks is "auto"'s choice only for rows longer
    than one block: 64-token rows (the paper's) go to the reference, with the reason; 129 take
    the kernel; a named kernel stays; CPU's backend pads nothing."""
    from tfm.training import experiment

    config = ModelConfig(**{**TINY, **changes})
    for longest, backend in ((64, "reference"), (128, "reference"), (129, blocked),
                             (None, blocked)):
        chosen, note = kernels.auto_choice(platform, longest, **config.attention_needs)
        assert chosen.name == backend
        assert config.for_platform(platform, longest).attention_backend == backend
        assert experiment._model_for_platform(config, platform, longest).attention_backend \
            == backend
        if backend == "reference":
            assert note == (f"attention_backend='auto' uses 'reference' on {platform}, not "
                            f"{blocked!r}: rows of at most {longest} tokens fit in one of its "
                            "128-token blocks, which it would pad them to")
        else:
            assert note is None
    named = config.replace(attention_backend=blocked)
    assert named.for_platform(platform, 64).attention_backend == blocked
    assert config.for_platform("cpu", 64).attention_backend == "cpu"


def test_auto_attention_call_within_one_block_runs_the_reference(monkeypatch):
    """kernels.attention(backend="auto") on TPU: a call whose queries and keys fit in one
    splash block runs the reference maths, a longer one splash (stand-ins record which, and
    return the reference's values); a named backend="splash" keeps splash."""
    from tfm.kernels import masks, reference
    from tfm.kernels.call import AttentionStructure

    calls = []

    def recording(name):
        def attention(query, key, value, call):
            calls.append(name)
            return masks.reference_attention(query, key, value, call)
        return attention

    monkeypatch.setattr(kernels, "platform", lambda: "tpu")
    for name in ("splash", "reference"):
        monkeypatch.setitem(kernels.BACKENDS, name, dataclasses.replace(
            kernels.BACKENDS[name], attention=recording(name)))
    rng = np.random.default_rng(0)
    for length, backend in ((64, "auto"), (128, "auto"), (200, "auto"), (64, "splash")):
        query, key, value = (jnp.asarray(rng.normal(size=(1, length, 2, 8)), jnp.float32)
                             for _ in "qkv")
        calls.clear()
        got = kernels.attention(query, key, value, backend=backend,
                                structure=AttentionStructure(causal=True))
        want = reference.dot_product_attention(
            query, key, value, mask=np.tril(np.ones((1, 1, length, length), bool)))
        np.testing.assert_allclose(got, want, atol=1e-5)
        expected = "splash" if length > 128 or backend == "splash" else "reference"
        assert calls == [expected], (length, backend)


def test_the_longest_row_counts_training_source_and_eval_rows(tmp_path):
    """What decides "auto" for a run (experiment.longest_row): its training rows, their
    source rows, and eval rows where data.eval_seq_len sets them."""
    from tfm.data import DataConfig, build_data
    from tfm.training import experiment

    def longest(**changes):
        config = DataConfig(**{**dict(
            kind="synthetic", task="addition", train_lengths=(1, 3), eval_lengths=(4, 5),
            num_train_examples=8, num_eval_examples=4, seq_len=24, batch_size=4,
            data_dir=str(tmp_path), read_threads=0, prefetch=0), **changes})
        return experiment.longest_row(build_data(config))

    assert longest() == 24
    assert longest(source_seq_len=40) == 40
    assert longest(eval_seq_len=200) == 200
