"""The fused output projection + cross-entropy (tfm.kernels.fused_cross_entropy, run here in
Pallas interpret mode) against naive maths: the per-token softmax statistics and every
gradient (hidden, table, bias), ties of the largest logit, `losses.fused_cross_entropy_sums`
against `losses.cross_entropy`, whole models' loss and gradients through `loss_backend`, a
mesh, and the TPU program it lowers to (no [tokens, vocab] array)."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TINY

from tfm.checks import ConfigError
from tfm.kernels import fused_cross_entropy as fce
from tfm.nn.config import ModelConfig
from tfm.nn.families import get_family
from tfm.training import losses
from tfm.training.experiment import loss_sums

SMALL_BLOCKS = dict(blocks=fce.Blocks(128, 128, 128, 256, fce.BLOCKS.vmem_limit))


def _inputs(rng, tokens=(3, 45), d_model=24, vocab=300, dtype=jnp.float32):
    hidden = jnp.asarray(rng.normal(size=(*tokens, d_model)), dtype)
    table = jnp.asarray(rng.normal(size=(vocab, d_model)) * 0.4, jnp.float32)
    bias = jnp.asarray(rng.normal(size=(vocab,)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, size=tokens), jnp.int32)
    return hidden, table, bias, targets


def _naive_statistics(hidden, table, bias, targets):
    """float64 numpy: (lse, target logit, logit sum, first argmax)."""
    logits = np.asarray(hidden, np.float64) @ np.asarray(table, np.float64).T
    if bias is not None:
        logits = logits + np.asarray(bias, np.float64)
    top = logits.max(-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(-1, keepdims=True)))[..., 0]
    target = np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
    return lse, target, logits.sum(-1), logits.argmax(-1)


def _reference_statistics(hidden, table, bias, targets):
    """The same in jax (differentiable), logits written out."""
    logits = jnp.einsum("...d,vd->...v", hidden, table.astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
    if bias is not None:
        logits = logits + bias
    target = jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return (jax.nn.logsumexp(logits, -1), target, logits.sum(-1),
            jnp.argmax(logits, -1).astype(jnp.int32))


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_statistics_and_gradients_equal_the_naive_maths(dtype, with_bias):
    """135 tokens (two token blocks, the last part padding) x 300 words (three vocabulary
    blocks, the last part padding): values against float64 numpy; gradients of a random
    combination of lse, target logit and logit sum against autodiff of the written-out
    logits."""
    rng = np.random.default_rng(0)
    hidden, table, bias, targets = _inputs(rng, dtype=jnp.dtype(dtype))
    bias = bias if with_bias else None
    stats = fce.softmax_statistics(hidden, table, bias, targets, **SMALL_BLOCKS)
    table_in_dtype = table.astype(hidden.dtype)  # what both compute with
    want = _naive_statistics(hidden, table_in_dtype, bias, targets)
    tolerance = 2e-5 if dtype == "float32" else 2e-3
    for name, got, expected in zip(("lse", "target", "sum"), stats[:3], want[:3], strict=True):
        np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance, err_msg=name)
    np.testing.assert_array_equal(stats.argmax, want[3])

    weights = [jnp.asarray(rng.normal(size=targets.shape), jnp.float32) for _ in range(3)]

    def combined(statistics, hidden, table, bias):
        values = statistics(hidden, table, bias, targets)
        return sum(jnp.sum(w * v) for w, v in zip(weights, values[:3], strict=True))

    fused = functools.partial(fce.softmax_statistics, **SMALL_BLOCKS)
    args = (hidden, table, bias if with_bias else jnp.zeros((table.shape[0],)))
    got = jax.grad(functools.partial(combined, fused), (0, 1, 2))(*args)
    expected = jax.grad(functools.partial(combined, _reference_statistics), (0, 1, 2))(*args)
    for name, g, e in zip(("hidden", "table", "bias"), got, expected, strict=True):
        g, e = np.asarray(g, np.float32), np.asarray(e, np.float32)
        scale = np.abs(e).max()
        assert scale > 0, name
        # bf16: the kernel rounds each block's exponentials (forward) and logit gradients
        # (d table) to bf16 for the MXU.
        np.testing.assert_allclose(g, e, atol=(1e-5 if dtype == "float32" else 1e-2) * scale,
                                   err_msg=name)


def test_the_largest_logit_is_the_first_one_across_and_within_blocks():
    """Ties: words 5, 70 (same block) and 200 (a later block) share the largest logit; the
    answer is 5, as jnp.argmax says. A later block's strictly larger logit wins."""
    rng = np.random.default_rng(1)
    hidden, table, _, targets = _inputs(rng, tokens=(2, 8))
    table = table.at[70].set(table[5] * 1).at[200].set(table[5] * 1)
    table = table.at[5].multiply(50.0).at[70].multiply(50.0).at[200].multiply(50.0)
    hidden = hidden.at[1].set(jnp.abs(hidden[1]) * jnp.sign(table[5]))  # row 1: 5 is largest
    stats = fce.softmax_statistics(hidden, table, None, targets, **SMALL_BLOCKS)
    np.testing.assert_array_equal(stats.argmax[1], 5)
    np.testing.assert_array_equal(stats.argmax, _reference_statistics(hidden, table, None,
                                                                      targets)[3])
    later = table.at[260].set(table[5] * 2.0)
    stats = fce.softmax_statistics(hidden, later, None, targets, **SMALL_BLOCKS)
    np.testing.assert_array_equal(stats.argmax[1], 260)


def test_confident_predictions_keep_the_hidden_gradient_exact():
    """Targets of probability 1 - 1e-7 .. 1 - 1e-4 (hidden along the target's row, scaled
    to it): d nll / d hidden = sum_{v != target} p_v (W_v - W_target) is ~1e-4 of the rows it
    is made of at most. The kernel sums the words other than the target (and their
    probability) in the forward pass, so in float32 each token's gradient stays within 1e-4 of
    float64's (1.2e-5 here); p_target - 1 taken from the log-sum-exp, as autodiff of the
    written-out logits takes it, is off by up to 67% (the kernel's earlier backward: 190%)."""
    rng = np.random.default_rng(7)
    _, table, _, targets = _inputs(rng, tokens=(2, 40))
    table64, flat_targets = np.asarray(table, np.float64), np.asarray(targets).reshape(-1)
    rows = table64[flat_targets]  # [tokens, d]
    alignment = rows @ table64.T  # logits per unit of scale
    wanted = np.logspace(-7, -4, flat_targets.size)  # 1 - p_target per token

    def rest(scale):  # 1 - p_target at hidden = scale * the target's row
        logits = scale[:, None] * alignment
        exps = np.exp(logits - logits.max(-1, keepdims=True))
        return 1 - exps[np.arange(flat_targets.size), flat_targets] / exps.sum(-1)

    low, high = np.zeros(flat_targets.size), np.full(flat_targets.size, 200.0)
    for _ in range(100):  # bisection: rest falls as the scale grows
        middle = (low + high) / 2
        low, high = np.where(rest(middle) > wanted, middle, low), np.where(
            rest(middle) > wanted, high, middle)
    np.testing.assert_allclose(rest(high), wanted, rtol=1e-3)
    hidden = jnp.asarray((high[:, None] * rows).reshape(*targets.shape, -1), jnp.float32)
    logits = np.asarray(hidden, np.float64) @ table64.T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)

    def nll(hidden):
        stats = fce.softmax_statistics(hidden, table, None, targets, **SMALL_BLOCKS)
        return jnp.sum(stats.lse - stats.target_logit)

    got = np.asarray(jax.grad(nll)(hidden), np.float64)
    onehot = np.eye(table.shape[0])[np.asarray(targets)]
    want = (probs - onehot) @ table64
    error = np.linalg.norm(got - want, axis=-1) / np.linalg.norm(want, axis=-1)  # per token
    assert error.max() < 1e-4, error.max()


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_fused_sums_equal_cross_entropy_of_the_logits(label_smoothing):
    """Every sum (loss, kl, nll, correct, weight) and the gradients of loss_sum, with padding
    weights and label smoothing."""
    rng = np.random.default_rng(2)
    hidden, table, bias, targets = _inputs(rng)
    weights = jnp.asarray(rng.random(targets.shape) > 0.3, jnp.float32)

    def reference(hidden, table, bias):
        logits = jnp.einsum("btd,vd->btv", hidden, table) + bias
        return losses.cross_entropy(logits, targets, weights, label_smoothing=label_smoothing)

    def fused(hidden, table, bias):
        return losses.fused_cross_entropy_sums(hidden, table, bias, targets, weights,
                                               label_smoothing=label_smoothing)

    want, got = reference(hidden, table, bias), fused(hidden, table, bias)
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    assert float(got["correct_sum"]) > 0
    loss = lambda f: lambda *a: f(*a)["loss_sum"]  # noqa: E731
    for g, w in zip(jax.grad(loss(fused), (0, 1, 2))(hidden, table, bias),
                    jax.grad(loss(reference), (0, 1, 2))(hidden, table, bias), strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5 * float(jnp.abs(w).max()))


def _batch(mode, rng, vocab):
    shape = (2, 20)
    ids = lambda: jnp.asarray(rng.integers(4, vocab, size=shape), jnp.int32)  # noqa: E731
    # Two packed examples per row: 12 and 8 tokens.
    segment_ids = jnp.asarray([[1] * 12 + [2] * 8] * shape[0], jnp.int32)
    positions = jnp.asarray([list(range(12)) + list(range(8))] * shape[0], jnp.int32)
    batch = {"inputs": ids(), "targets": ids(), "positions": positions,
             "segment_ids": segment_ids,
             "weights": jnp.asarray(rng.random(shape) > 0.2, jnp.float32)}
    if mode == "seq2seq":
        batch.update(source=ids(), source_positions=positions, source_segment_ids=segment_ids)
    return batch


@pytest.mark.parametrize("mode,changes", [
    ("lm", dict(num_encoder_layers=0)),  # tied output
    ("seq2seq", dict(tie_output=False, lm_head_bias=True, output_scale=0.5)),
])
def test_models_loss_and_gradients_equal_the_reference(mode, changes):
    """`loss_sums` of a tiny model with loss_backend="fused" equals "reference": the sums and
    every parameter's gradient (the tied table's two uses, an untied kernel and its bias)."""
    rng = np.random.default_rng(3)
    config = {backend: ModelConfig(**{**TINY, **changes, "loss_backend": backend})
              for backend in ("reference", "fused")}
    family = get_family(mode)
    batch = _batch(mode, rng, config["fused"].vocab_size)
    params = family.init(family.model(config["fused"]), jax.random.key(0), batch)

    def loss(backend, params):
        sums = loss_sums(family.model(config[backend]), params, batch, batch["weights"],
                         mode=mode, deterministic=True, label_smoothing=0.1)
        return sums["loss_sum"], sums

    (want, want_sums), want_grads = jax.value_and_grad(
        functools.partial(loss, "reference"), has_aux=True)(params)
    (got, got_sums), got_grads = jax.value_and_grad(
        functools.partial(loss, "fused"), has_aux=True)(params)
    for key in want_sums:
        np.testing.assert_allclose(got_sums[key], want_sums[key], rtol=1e-5, err_msg=key)
    flat_want = jax.tree_util.tree_leaves_with_path(want_grads)
    flat_got = jax.tree.leaves(got_grads)
    head = "embedding" if mode == "lm" else "output_projection"
    assert any(head in jax.tree_util.keystr(path) for path, _ in flat_want)
    scale = max(float(jnp.abs(w).max()) for _, w in flat_want)  # (a key bias's is ~0)
    for (path, w), g in zip(flat_want, flat_got, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


def test_under_a_mesh_each_device_takes_its_rows_and_the_table_gradient_is_summed():
    """Data x fsdp x tensor mesh (2 x 2 x 2): rows split over data and fsdp; values and the
    table's and bias's gradients equal the unsharded maths."""
    from tfm.parallel import sharding

    mesh = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, jax.devices()[:8])
    rng = np.random.default_rng(4)
    hidden, table, bias, targets = _inputs(rng, tokens=(8, 40))
    probe = jnp.asarray(rng.normal(size=targets.shape), jnp.float32)

    def loss(statistics, hidden, table, bias):
        stats = statistics(hidden, table, bias, targets)
        return jnp.sum(probe * (stats.lse - stats.target_logit)) + 0.3 * jnp.sum(stats[2])

    def reference(hidden, table, bias, targets):
        return fce.SoftmaxStatistics(*_reference_statistics(hidden, table, bias, targets))

    want, want_grads = jax.value_and_grad(functools.partial(loss, reference), (0, 1, 2))(
        hidden, table, bias)
    with sharding.sharding_context(mesh):
        grad = jax.jit(jax.value_and_grad(
            functools.partial(loss, functools.partial(fce.softmax_statistics, **SMALL_BLOCKS)),
            (0, 1, 2)))
        traced = grad.trace(hidden, table, bias)
        got, got_grads = grad(hidden, table, bias)
    assert "shard_map" in str(traced.jaxpr)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for name, g, w in zip(("hidden", "table", "bias"), got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=2e-5 * float(jnp.abs(w).max()), err_msg=name)


def test_block_sizes_and_shapes_are_checked():
    rng = np.random.default_rng(5)
    hidden, table, bias, targets = _inputs(rng, tokens=(2, 4))
    with pytest.raises(ValueError, match="blocks.vocab=100 must be a positive multiple of 128"):
        fce.softmax_statistics(hidden, table, bias, targets,
                               blocks=fce.Blocks(128, 100, 128, 128, 0))
    with pytest.raises(ValueError, match="targets"):
        fce.softmax_statistics(hidden, table, bias, targets[:, :3])
    with pytest.raises(ConfigError, match="loss_backend='pallas' is unknown"):
        ModelConfig(**{**TINY, "loss_backend": "pallas"})


def _lowered_step(platform: str, backend: str, mesh_devices) -> str:
    """The optimised program of a tiny LM's loss gradient for `platform`'s devices."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    config = ModelConfig(**{**TINY, "num_encoder_layers": 0, "vocab_size": 2048,
                            "loss_backend": backend, "dtype": "bfloat16"})
    family = get_family("lm")
    model = family.model(config)
    mesh = Mesh(np.asarray(mesh_devices[:1]), ("data",))
    replicated = NamedSharding(mesh, PartitionSpec())
    keys = ("inputs", "targets", "weights", "positions", "segment_ids")
    batch = {key: jax.ShapeDtypeStruct((4, 256), jnp.float32 if key == "weights" else jnp.int32,
                                       sharding=replicated) for key in keys}
    params = jax.eval_shape(lambda: family.init(
        model, jax.random.key(0), {k: jnp.zeros(v.shape, v.dtype) for k, v in batch.items()}))
    params = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=replicated),
                          params)

    def grad(params, batch):
        return jax.grad(lambda p: loss_sums(model, p, batch, batch["weights"], mode="lm",
                                            deterministic=True)["loss_sum"])(params)

    with jax.set_mesh(mesh), jax.default_matmul_precision("default"):  # (bf16 on the MXU)
        return jax.jit(grad).lower(params, batch).compile().as_text()


def test_the_tpu_program_holds_no_tokens_by_vocabulary_array():
    """Compiled for a TPU v5e (libtpu): with the fused loss ("auto" at 2,048 words) no array of
    1,024 tokens x 2,048 words (the logits, their softmax or gradient) is in the program, and
    its kernels are Pallas calls; the reference's program has them."""
    pytest.importorskip("libtpu")
    from tfm.training.compile_report import target_devices

    _, devices = target_devices("v5e-4")
    logits_shaped = re.compile(r"\[(4,256|1024),2048\]")
    fused = _lowered_step("tpu", "auto", devices)
    assert "tfm_cross_entropy" in fused
    assert not logits_shaped.search(fused)
    assert logits_shaped.search(_lowered_step("tpu", "reference", devices))


@pytest.mark.parametrize("platform,vocab_size,resolved", [
    ("tpu", 2048, "fused"), ("tpu", 50_304, "fused"), ("tpu", 2047, "reference"),
    ("gpu", 50_304, "reference"), ("cpu", 50_304, "reference")])
def test_auto_resolves_per_platform_and_vocabulary_and_a_named_backend_stays(
        platform, vocab_size, resolved):
    config = ModelConfig(**{**TINY, "vocab_size": vocab_size})
    assert config.for_platform(platform).loss_backend == resolved
    for named in ("fused", "reference"):
        config = ModelConfig(**{**TINY, "vocab_size": vocab_size, "loss_backend": named})
        assert config.for_platform(platform).loss_backend == named


@pytest.mark.parametrize("tokens", [1, 127, 128, 1000, 4096, 5000, 8192, 12_345, 40_000])
def test_fitted_blocks_cover_the_tokens_with_little_padding(tokens):
    """Every block size a multiple of 128 lanes and dividing the padded length; padding under
    128 tokens per token block; no block larger than the input needs."""
    blocks, padded = fce.fit_blocks(fce.BLOCKS_BY_CHIP["TPU v5 lite"], tokens, 50_304)
    limit = fce.BLOCKS_BY_CHIP["TPU v5 lite"]
    for size in (blocks.tokens, blocks.grad_tokens, blocks.vocab, blocks.grad_vocab):
        assert size % 128 == 0 and size > 0
    assert padded % blocks.tokens == 0 and padded % blocks.grad_tokens == 0
    assert blocks.tokens <= limit.tokens and blocks.grad_tokens <= limit.grad_tokens
    assert tokens <= padded < tokens + 128 * (padded // blocks.tokens)
    assert blocks.tokens <= -(-tokens // 128) * 128


@pytest.mark.parametrize("d_model,tokens,grad_vocab", [(768, 4096, 3968), (1024, 2048, 3200),
                                                     (1600, 1024, 1152), (1664, 2048, 2304)])
def test_blocks_shrink_until_their_vmem_fits(d_model, tokens, grad_vocab):
    """v5e's blocks over GPT-2's 8 x 1,024 tokens and 50,304 words: GPT-2 small (768) keeps
    statistics blocks of 4,096 tokens and d table blocks of 3,968 words; GPT-2 medium's 1,024
    needs smaller ones (at 3,968 words Mosaic asked 76.9e6 bytes of the 64 MiB the d table call
    may take; at 4,096 tokens 104.7 MiB of the statistics call's 96, CompileTimeScopedVmemOom),
    halving the token block so that 8,192 tokens need no padding; GPT-2 XL's 1,600, whose last
    lane tile is partial, is sized as twice 1,664 (`_vmem_width`: 2,304 words took 94.5 MB
    there); every call fits its estimate."""
    chip = fce.BLOCKS_BY_CHIP["TPU v5 lite"]
    blocks, padded = fce.fit_blocks(chip, 8192, 50_304, d_model, 2)
    assert (blocks.tokens, blocks.grad_vocab, padded) == (tokens, grad_vocab, 8192)
    assert blocks.grad_vocab % 128 == 0 and blocks.tokens % 128 == 0
    width = fce._vmem_width(d_model)
    assert fce._vmem_bytes(blocks.grad_vocab, blocks.grad_tokens, width, 2) <= chip.vmem_limit
    assert (fce._statistics_vmem_bytes(blocks.tokens, blocks.vocab, width, 2)
            <= chip.limit("statistics"))
    assert fce._vmem_bytes(3968, 1024, 1024, 2) > chip.vmem_limit
    assert fce._statistics_vmem_bytes(4096, 512, 1024, 2) > chip.limit("statistics")


@pytest.mark.parametrize("target", ["v5e-4", "v5p-8"])
def test_gpt2_xls_loss_compiles_for_tpu(target):
    """Compiled for TPU (libtpu): the loss and its gradient over 8,192 tokens, 50,304 words and
    GPT-2 XL's d_model 1,600, whose partial last lane tile took Mosaic 1.5-1.8 times the VMEM
    of 1,664 (CompileTimeScopedVmemOom on v5e, register spills past v5p's 64 MiB, before
    `_vmem_width`)."""
    pytest.importorskip("libtpu")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tfm.training.compile_report import target_devices

    _, devices = target_devices(target)
    mesh = Mesh(np.asarray(devices[:1]), ("data",))
    one = NamedSharding(mesh, PartitionSpec())
    hidden = jax.ShapeDtypeStruct((8192, 1600), jnp.bfloat16, sharding=one)
    table = jax.ShapeDtypeStruct((50_304, 1600), jnp.bfloat16, sharding=one)
    targets = jax.ShapeDtypeStruct((8192,), jnp.int32, sharding=one)

    def loss(hidden, table, targets):
        stats = fce.softmax_statistics(hidden, table, None, targets)
        return jnp.sum(stats.lse - stats.target_logit)

    with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
        program = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, table, targets)
        assert "tfm_cross_entropy_table_grad" in program.compile().as_text()


def test_auto_keeps_the_reference_where_the_mesh_splits_the_vocabulary():
    """The fused kernel takes the whole table on every device: with a tensor axis over the
    vocabulary "auto" keeps XLA's split logits; a named backend stays as asked."""
    from tfm.parallel import sharding
    from tfm.training import experiment

    rules = sharding.resolve_rules()
    resolved = ModelConfig(**{**TINY, "vocab_size": 4096}).for_platform("tpu")
    assert resolved.loss_backend == "fused"
    split = sharding.make_mesh({"data": 2, "fsdp": 1, "tensor": 2}, jax.devices()[:4])
    whole = sharding.make_mesh({"data": 2, "fsdp": 2, "tensor": 1}, jax.devices()[:4])
    assert experiment._loss_backend("auto", "tpu", 4096, split, rules) == "reference"
    assert experiment._loss_backend("auto", "tpu", 4096, whole, rules) == "auto"  # then fused
    assert experiment._loss_backend("fused", "tpu", 4096, split, rules) == "fused"


def test_sharded_inputs_without_the_mesh_set_are_one_clear_error():
    """Rows on 8 devices, no mesh set while tracing: one error naming what to add (on TPU the
    kernel would fail to lower: "Mosaic kernels cannot be automatically partitioned")."""
    from jax.sharding import NamedSharding, PartitionSpec

    from tfm.kernels.per_device import MeshContextError
    from tfm.parallel import sharding

    mesh = sharding.make_mesh({"data": 8, "fsdp": 1, "tensor": 1})
    hidden, table, bias, targets = _inputs(np.random.default_rng(6), tokens=(8, 40))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    hidden, targets = jax.device_put(hidden, rows), jax.device_put(targets, rows)
    statistics = jax.jit(functools.partial(fce.softmax_statistics, **SMALL_BLOCKS))
    with pytest.raises(MeshContextError, match=r"^loss_backend='fused' runs a Pallas kernel"
                       r".*sharding_context\(mesh\).* or set loss_backend='reference'"):
        statistics(hidden, table, bias, targets)
    with sharding.sharding_context(mesh):
        statistics(hidden, table, bias, targets)  # with the mesh set it runs
