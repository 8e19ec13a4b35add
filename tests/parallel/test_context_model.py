"""Context parallelism in the model (tfm/nn/context_split.py, tfm/parallel/sharding.py's
context axis) on 8 simulated CPU devices, against the same model on one device in float32
(relative 1e-5): a tiny decoder-only LM's loss and every parameter gradient under
mesh.context = 2, 4 (all_gather, ring; alone, with data and with tensor) for RoPE, ALiBi, T5,
FIRE, learned positions and Shaw's (all_gather; with and without relative values), plain and
packed rows (documents crossing the chunk boundaries) with
padding, and a local window; a tiny encoder-decoder's (padded and packed sources and targets,
all_gather and ring, reference and flex per chunk); the train step's loss and gradients on the
data pipeline's packed rows under fsdp=2 x context=4 (LM and encoder-decoder); setup's refusal
of what context parallelism cannot run; greedy translation and LM generation under a context
mesh (the LM's prefill split over it, or in chunks run whole)."""

import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attention_cases import lowered_lm_grad, lowered_seq2seq_grad
from jax._src.mesh import AbstractDevice  # no public constructor: a device kind without chips
from tiny_model import TINY, TINY_LM

from configs import synthetic_lm, synthetic_seq2seq
from tfm.checks import ConfigError
from tfm.decode.generate import lm_generate, translate
from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM, EncoderDecoder
from tfm.parallel import sharding
from tfm.training import train
from tfm.training.experiment import context_attention_backend, setup

LENGTH = 16
SEGMENTS = np.array([[1] * LENGTH, [1] * 5 + [2] * 7 + [3] * 2 + [0] * 2], np.int32)


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, TINY_LM["vocab_size"], size=(2, LENGTH + 1)).astype(np.int32)
    # Next-token targets are shifted on the whole row, before any split.
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:],
                positions=_segment_positions(SEGMENTS),
                segment_ids=SEGMENTS, weights=(SEGMENTS > 0).astype(np.float32))


def _seq2seq_batch(packed):
    """Source and decoder rows of LENGTH tokens: padded (valid masks, rows of 16 and 11 source
    and 16 and 9 target tokens), or packed (two examples in the second row, both sides, then
    padding), the segments crossing the chunk boundaries of context 2 and 4."""
    rng = np.random.default_rng(1)
    source, tokens = (rng.integers(1, TINY["vocab_size"], size=(2, length)).astype(np.int32)
                      for length in (LENGTH, LENGTH + 1))
    batch = dict(source=source, inputs=tokens[:, :-1], targets=tokens[:, 1:])
    if packed:
        source_ids = np.array([[1] * LENGTH, [1] * 6 + [2] * 7 + [0] * 3], np.int32)
        target_ids = np.array([[1] * LENGTH, [1] * 5 + [2] * 8 + [0] * 3], np.int32)
        batch.update(source_segment_ids=source_ids, segment_ids=target_ids,
                     source_positions=_segment_positions(source_ids),
                     positions=_segment_positions(target_ids))
        return dict(batch, weights=(target_ids > 0).astype(np.float32))
    index = np.arange(LENGTH)
    valid = index < np.array([[LENGTH], [9]])
    batch.update(source_valid=index < np.array([[LENGTH], [11]]), valid=valid)
    return dict(batch, weights=valid.astype(np.float32))


def _segment_positions(segment_ids):  # [batch, len] -> each token's place in its segment
    positions = np.zeros_like(segment_ids)
    for t in range(1, segment_ids.shape[1]):
        same = segment_ids[:, t] == segment_ids[:, t - 1]
        positions[:, t] = np.where(same, positions[:, t - 1] + 1, 0)
    return positions


def _model(config):
    return (EncoderDecoder if config.num_encoder_layers else DecoderLM)(config)


def _init(config, batch):
    """The model's parameters (unboxed) for `batch` (_batch's or _seq2seq_batch's)."""
    inputs = [batch[key] for key in ("source", "inputs") if key in batch]
    return nn.meta.unbox(_model(config).init(jax.random.key(0), *inputs)["params"])


def _loss_and_grads(config, mesh_sizes, batch, params):
    """Loss and gradients on one device (mesh_sizes None) or on a mesh of those sizes."""
    model = _model(config)
    run = jax.jit(jax.value_and_grad(functools.partial(_loss_sum, model)))
    if mesh_sizes is None:
        return run(params, batch)
    sizes = {"data": 1, **mesh_sizes}
    mesh = sharding.make_mesh(sizes, devices=jax.devices()[:math.prod(sizes.values())])
    with sharding.sharding_context(mesh):
        return run(params, batch)


def _loss_sum(model, params, batch):
    inputs = [batch[key] for key in ("source", "inputs") if key in batch]
    features = {key: value for key, value in batch.items()
                if key not in ("source", "inputs", "targets", "weights")}
    logits = model.apply({"params": params}, *inputs, **features)
    log_probs = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum(nll * batch["weights"])


# The context axis alone and with data (rows split) or tensor (heads and the T5 table's rows
# split inside the shard_map); layers under nn.scan with full rematerialisation.
@pytest.mark.parametrize("scheme, strategy, mesh_sizes, window, changes", [
    ("rope", "ring", {"context": 4}, None, {}),
    ("alibi", "all_gather", {"data": 2, "context": 2}, 3, {}),
    ("t5_bias", "ring", {"context": 2, "tensor": 2}, 5, {}),
    ("learned", "all_gather", {"context": 4, "tensor": 2}, None, {}),
    ("fire", "all_gather", {"context": 2}, None, {}),  # a learned bias per layer
    # context 8: chunks of 2 tokens, halves of 1, every packed document crossing boundaries
    ("t5_bias", "all_gather", {"context": 8}, 3, {}),
    ("alibi", "ring", {"context": 8}, None, {}),
    ("rope", "ring", {"context": 2}, None,
     {"num_decoder_layers": 2, "scan_layers": True, "remat": "full"}),
    # Shaw: the relative logit term from each device's queries, the value term from the same
    # weights (TINY's max_distance 3 clips inside a chunk, so a local index would show)
    ("relative", "all_gather", {"context": 2}, None, {"relative_values": False}),
    ("relative", "all_gather", {"context": 4}, None, {"relative_values": True}),
    ("relative", "all_gather", {"data": 2, "context": 2}, None,
     {"relative_max_distance": 6, "relative_values": True}),
    ("relative", "all_gather", {"context": 2, "tensor": 2}, None,
     {"num_decoder_layers": 2, "scan_layers": True, "remat": "full"}),
], ids=["rope-ring-context4", "alibi-all_gather-data2-context2-window",
        "t5-ring-context2-tensor2-window", "learned-all_gather-context4-tensor2",
        "fire-all_gather-context2", "t5-all_gather-context8-window", "alibi-ring-context8",
        "rope-ring-context2-scan-remat", "shaw-keys-context2",
        "shaw-values-context4", "shaw-values-data2-context2",
        "shaw-values-context2-tensor2-scan-remat"])
def test_context_parallel_loss_and_gradients_equal_one_device(scheme, strategy, mesh_sizes,
                                                              window, changes):
    config = ModelConfig(**{**TINY_LM, "num_decoder_layers": 1, **changes},
                         position_scheme=scheme, context_parallel=strategy,
                         local_window=window, attention_backend="reference")
    batch = {key: jnp.asarray(value) for key, value in _batch().items()}
    params = nn.meta.unbox(DecoderLM(config).init(jax.random.key(0), batch["inputs"])["params"])
    want_loss, want_grads = _loss_and_grads(config, None, batch, params)
    got_loss, got_grads = _loss_and_grads(config, mesh_sizes, batch, params)
    _assert_close(got_loss, got_grads, want_loss, want_grads)


# The encoder-decoder: the encoder's rows in contiguous chunks (bidirectional), the decoder's
# load balanced, its cross-attention against the gathered source; padded or packed rows,
# local windows (bidirectional in the encoder, causal in the decoder); each
# chunk by the reference maths or the flex kernel (Pallas interpret mode), against the
# reference on one device.
@pytest.mark.parametrize("scheme, strategy, context, packed, backend, window", [
    ("t5_bias", "all_gather", 2, True, "reference", None),
    ("rope", "ring", 4, False, "reference", None),
    ("learned", "all_gather", 4, False, "reference", None),
    ("alibi", "ring", 2, True, "reference", 3),
    ("t5_bias", "all_gather", 2, True, "flex", 5),
    ("relative", "all_gather", 4, True, "reference", None),
    ("t5_bias", "ring", 2, True, "flex", 5),
], ids=["t5-all_gather-context2-packed", "rope-ring-context4-padded",
        "learned-all_gather-context4-padded", "alibi-ring-context2-packed-window",
        "t5-flex-context2-packed-window", "shaw-values-all_gather-context4-packed",
        "t5-ring-flex-context2-packed-window"])
def test_encoder_decoder_under_context_parallelism_equals_one_device(scheme, strategy, context,
                                                                      packed, backend, window):
    config = ModelConfig(**{**TINY, "num_encoder_layers": 1, "num_decoder_layers": 1},
                         position_scheme=scheme, context_parallel=strategy,
                         attention_backend="reference", local_window=window)
    batch = {key: jnp.asarray(value) for key, value in _seq2seq_batch(packed).items()}
    params = _init(config, batch)
    want_loss, want_grads = _loss_and_grads(config, None, batch, params)
    got_loss, got_grads = _loss_and_grads(config.replace(attention_backend=backend),
                                          {"context": context}, batch, params)
    _assert_close(got_loss, got_grads, want_loss, want_grads)


def _assert_close(got_loss, got_grads, want_loss, want_grads):
    """Losses equal to 1e-5 relative, and every gradient relative to the largest gradient:
    some are zero but for rounding (a key bias shifts every logit of a query alike, which the
    softmax ignores)."""
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    scale = max(float(jnp.max(jnp.abs(leaf))) for leaf in jax.tree.leaves(want_grads))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(got_grads),
                                 jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got / scale, want / scale, rtol=1e-5, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))


# The flex kernel per chunk (all_gather; Pallas interpret mode on CPU) against the reference
# on one device: the packed row's documents cross the chunk boundaries at both sizes.
@pytest.mark.parametrize("scheme, context, window", [
    ("rope", 4, None), ("alibi", 2, 3), ("t5_bias", 4, 5)])
def test_the_flex_kernel_per_chunk_equals_the_reference_on_one_device(scheme, context, window):
    config = ModelConfig(**{**TINY_LM, "num_decoder_layers": 1}, position_scheme=scheme,
                         local_window=window, attention_backend="reference")
    batch = {key: jnp.asarray(value) for key, value in _batch().items()}
    params = nn.meta.unbox(DecoderLM(config).init(jax.random.key(0), batch["inputs"])["params"])
    want = _loss_and_grads(config, None, batch, params)
    flex = config.replace(attention_backend="flex")
    got = _loss_and_grads(flex, {"context": context}, batch, params)
    _assert_close(*got, *want)


# The ring on the flex kernel (tfm.kernels.ring_flex; interpret mode on CPU) against the
# reference on one device: RoPE, ALiBi with a window, T5 (its table's gradient summed over the
# ring), the packed row's documents crossing the chunk boundaries.
@pytest.mark.parametrize("scheme, context, window", [
    ("rope", 4, None), ("alibi", 2, 3), ("t5_bias", 4, 5), ("t5_bias", 2, None)])
def test_the_ring_on_the_flex_kernel_equals_the_reference_on_one_device(scheme, context, window):
    config = ModelConfig(**{**TINY_LM, "num_decoder_layers": 1}, position_scheme=scheme,
                         local_window=window, attention_backend="reference",
                         context_parallel="ring")
    batch = {key: jnp.asarray(value) for key, value in _batch().items()}
    params = nn.meta.unbox(DecoderLM(config).init(jax.random.key(0), batch["inputs"])["params"])
    want = _loss_and_grads(config, None, batch, params)
    got = _loss_and_grads(config.replace(attention_backend="flex"), {"context": context}, batch,
                          params)
    _assert_close(*got, *want)


# (platform lowered for, device kind and platform of the abstract mesh, the kernel's call)
ACCELERATORS = {"tpu": ("tpu", "TPU v5 lite", "tpu", "tpu_custom_call"),
                "gpu": ("cuda", "NVIDIA H100", "gpu", "__gpu$xla.gpu.triton")}


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_the_accelerator_program_runs_the_kernel_per_chunk_and_holds_no_chunk_by_row_array(
        accelerator):
    """The train gradient lowered for TPU (Mosaic) or GPU (Triton) without a device over an
    abstract mesh with context=4: with flex, each device's two query halves call the Pallas
    kernel (forward, dq, dk/dv: 6 calls) and no [.., chunk, T] (nor [.., T, T]) array is
    left, where the reference per chunk writes its [.., 128, 512] scores out."""
    platform, kind, mesh_platform, kernel_call = ACCELERATORS[accelerator]
    length, context = 512, 4
    chunk_by_row = re.compile(rf"x{length // context}x{length}x|x{length}x{length}x")
    mesh = jax.sharding.AbstractMesh((1, 1, context, 1), sharding.MESH_AXES,
                                     abstract_device=AbstractDevice(kind, None, mesh_platform))

    def lowered(backend):
        config = ModelConfig(**{**TINY_LM, "num_decoder_layers": 1},
                             position_scheme="t5_bias", attention_backend=backend)
        with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(
                sharding.DEFAULT_LOGICAL_RULES):
            return lowered_lm_grad(config, length, platform)

    flex_text = lowered("flex")
    assert flex_text.count(kernel_call) == 6
    assert not chunk_by_row.search(flex_text)
    assert chunk_by_row.search(lowered("reference"))


@pytest.mark.parametrize("accelerator", ACCELERATORS)
def test_the_ring_on_accelerators_runs_the_kernel_per_pair_and_holds_no_block_scores(
        accelerator):
    """The ring's train gradient lowered for TPU (Mosaic) or GPU (Triton) over an abstract
    context=4 mesh with flex: each of a step's 4 pairs of query and key halves is one kernel
    call forward and two backward (dq, dk/dv): 8 + 16 kernels (the unrolled steps call the
    same lowered functions); the ring's 3 rotations are unrolled on accelerators
    (ring_flex.unrolled: XLA's cost analysis counts a loop body once), so no while loop is
    left; no [.., half, half] (nor [.., chunk, chunk]) score array is left, where the
    reference ring's blocks write theirs out."""
    platform, kind, mesh_platform, kernel_call = ACCELERATORS[accelerator]
    length, context = 512, 4
    chunk = length // context
    block_scores = re.compile(rf"x{chunk // 2}x{chunk // 2}x|x{chunk}x{chunk}x")
    mesh = jax.sharding.AbstractMesh((1, 1, context, 1), sharding.MESH_AXES,
                                     abstract_device=AbstractDevice(kind, None, mesh_platform))

    def lowered(backend):
        config = ModelConfig(**{**TINY_LM, "num_decoder_layers": 1}, context_parallel="ring",
                             position_scheme="t5_bias", attention_backend=backend)
        with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(
                sharding.DEFAULT_LOGICAL_RULES):
            return lowered_lm_grad(config, length, platform)

    flex_text = lowered("flex")
    assert flex_text.count(kernel_call) == 8 + 16
    assert "stablehlo.while" not in flex_text
    assert not block_scores.search(flex_text)
    assert block_scores.search(lowered("reference"))


def test_the_tpu_program_of_an_encoder_decoder_runs_the_kernel_per_chunk():
    """The encoder-decoder's train gradient lowered for TPU over an abstract context=4 mesh
    with flex: the encoder's chunk (one run: forward, dq, dk/dv), the cross-attention's chunk
    (one run) and the decoder's two load-balanced halves call the Pallas kernel 3 + 3 + 6
    times, each attention under shard_map, and no [.., chunk, T] (nor [.., T, T]) array is
    left."""
    platform, kind, mesh_platform, kernel_call = ACCELERATORS["tpu"]
    length, context = 512, 4
    chunk_by_row = re.compile(rf"x{length // context}x{length}x|x{length}x{length}x")
    mesh = jax.sharding.AbstractMesh((1, 1, context, 1), sharding.MESH_AXES,
                                     abstract_device=AbstractDevice(kind, None, mesh_platform))
    config = ModelConfig(**{**TINY, "num_encoder_layers": 1, "num_decoder_layers": 1},
                         position_scheme="t5_bias", attention_backend="flex")
    with jax.sharding.use_abstract_mesh(mesh), nn.logical_axis_rules(
            sharding.DEFAULT_LOGICAL_RULES):
        text = lowered_seq2seq_grad(config, length, platform)
    assert text.count(kernel_call) == 12
    # the three attentions' forward and backward passes run under shard_map, each on the
    # device's queries only (the first operand split over the context axis)
    split_queries = re.compile(r'manual_computation\([^)]*\) in_shardings=\[<@mesh, '
                               r'\[\{"data", "fsdp"\}, \{"context"\}')
    assert len(split_queries.findall(text)) == 6
    assert not chunk_by_row.search(text)


def _experiment(data_dir, mesh, devices, configs=synthetic_lm):
    """A tiny experiment of `configs` (synthetic_lm, or synthetic_seq2seq with one encoder
    layer) on packed rows of 16 tokens."""
    config = configs.get_config("runlocal")
    config.model.update(d_model=16, num_heads=4, num_kv_heads=2, d_ff=32, num_decoder_layers=1,
                        position_scheme="t5_bias", context_parallel="ring", dropout_rate=0.0,
                        attention_dropout_rate=0.0)
    if config.model.num_encoder_layers:  # all_gather: the ring's is the LM's (compile time)
        config.model.update(num_encoder_layers=1, context_parallel="all_gather")
    config.data.update(batch_size=4, seq_len=16, packing=True, num_train_examples=100,
                       num_eval_examples=8, train_lengths=(1, 3), data_dir=str(data_dir))
    config.mesh.update(mesh)
    return setup(config, data_dir / "workdir", devices=devices)


def _step_grads(exp, params, host_batch):
    """The train step's loss sums and parameter gradients (train._grads_and_sums) on `exp`'s
    mesh, the parameters and the batch sharded as the loop shards them."""
    grads_of = functools.partial(train._grads_and_sums, total_weight=1.0,
                                 model=exp.model, mode=exp.mode,
                                 label_smoothing=0.0)
    boxed = jax.eval_shape(lambda: exp.family.init(exp.model, jax.random.key(0), host_batch))
    params = jax.device_put(params, sharding.param_shardings(boxed, exp.mesh, exp.rules))
    with sharding.sharding_context(exp.mesh, exp.rules):
        batch = sharding.shard_batch(host_batch, exp.mesh, rules=exp.rules)
        return jax.jit(grads_of)(params, batch, None)


@pytest.mark.parametrize("configs", [synthetic_lm, synthetic_seq2seq], ids=["lm", "seq2seq"])
def test_train_step_under_context_parallelism_equals_one_device(tmp_path, configs):
    """Loss and gradients of the train step on packed rows (documents across chunk boundaries;
    the decoder's targets shifted by the pipeline on whole rows) with T5 bias: fsdp=2 x
    context=4 (ring, 'auto' meaning the reference per chunk) against one device ('auto'
    meaning the CPU kernels); an LM, and an encoder-decoder whose sources are packed too."""
    one = _experiment(tmp_path, {"data": 1}, jax.devices()[:1], configs)
    split = _experiment(tmp_path, {"data": 1, "fsdp": 2, "context": 4}, jax.devices(), configs)
    assert split.model_config.attention_backend == "reference"
    host_batch = next(one.data.train_iterator())
    # several documents in a row, which chunks of 2 tokens (2 x 4 per row of 16) cut
    for key in ("segment_ids", "source_segment_ids"):
        assert key not in host_batch or max(len(np.unique(row))
                                            for row in host_batch[key]) > 2
    params = nn.meta.unbox(one.family.init(one.model, jax.random.key(0), host_batch))
    want_grads, want_sums = _step_grads(one, params, host_batch)
    got_grads, got_sums = _step_grads(split, params, host_batch)
    _assert_close(got_sums["loss_sum"], got_grads, want_sums["loss_sum"], want_grads)


def test_setup_refuses_context_parallelism_it_cannot_run(tmp_path):
    config = synthetic_lm.get_config("runlocal")
    config.model.update(position_scheme="relative", context_parallel="ring")
    config.data.update(seq_len=16, data_dir=str(tmp_path), num_train_examples=100,
                       num_eval_examples=8, batch_size=8)
    config.mesh.update({"data": 1, "context": 8})
    with pytest.raises(ConfigError, match=r"^model.position_scheme='relative' with model."
                                          r"context_parallel='ring' with mesh.context=8: the "
                                          r"ring's blocks take no bias from the queries"):
        setup(config, tmp_path / "workdir")


def test_setup_warns_that_prefill_chunks_run_whole_under_a_context_mesh(tmp_path, caplog):
    config = synthetic_lm.get_config("runlocal")
    config.data.update(seq_len=16, data_dir=str(tmp_path), num_train_examples=100,
                       num_eval_examples=8, batch_size=8)
    config.generate.prefill_chunk = 4
    config.mesh.update({"data": 1, "context": 8})
    with caplog.at_level("WARNING"):
        setup(config, tmp_path / "split")
    said = [record.getMessage() for record in caplog.records if "prefill_chunk" in record.msg]
    assert said == ["generate.prefill_chunk=4 with mesh.context=8: each prefill chunk reads the "
                    "KV cache, so it runs whole on every device, [chunk, cache] scores "
                    "included; generate.prefill_chunk=0 prefills the whole prompt split over "
                    "the context axis"]
    caplog.clear()
    config.mesh.update({"data": 8, "context": 1})
    with caplog.at_level("WARNING"):
        setup(config, tmp_path / "whole")
    assert not [record for record in caplog.records if "prefill_chunk" in record.msg]


def test_auto_means_flex_per_chunk_on_tpu_and_gpu_else_the_reference():
    config = lambda **fields: ModelConfig(**{**TINY_LM, "num_decoder_layers": 1},  # noqa: E731
                                          position_scheme="t5_bias", **fields)
    assert context_attention_backend(config(), "tpu") == "flex"
    assert context_attention_backend(config(context_parallel="ring"), "tpu") == "flex"
    assert context_attention_backend(config(context_parallel="ring"), "cpu") == "reference"
    assert context_attention_backend(config(), "cpu") == "reference"
    assert context_attention_backend(config(), "gpu") == "flex"
    # flex has no attention dropout (setup then refuses it under context parallelism)
    assert context_attention_backend(config(attention_dropout_rate=0.1), "tpu") == "reference"


@pytest.mark.parametrize("backend", ["reference", "flex"])
def test_rows_load_balancing_cannot_cut_run_whole_with_the_same_logits(backend):
    """A call whose length 2 x mesh.context does not divide (initialisation, an eval length)
    runs whole on every device: the logits of 12 tokens under context=4 (8 chunks needed).
    A kernel run whole keeps the sequence whole though context (4) divides it."""
    config = ModelConfig(**{**TINY_LM, "num_decoder_layers": 1}, position_scheme="alibi",
                         attention_backend=backend)
    tokens = jnp.asarray(_batch()["inputs"][:, :12])
    model = DecoderLM(config)
    params = nn.meta.unbox(model.init(jax.random.key(0), tokens)["params"])
    apply = jax.jit(lambda params, tokens: model.apply({"params": params}, tokens))
    want = apply(params, tokens)
    mesh = sharding.make_mesh({"data": 1, "context": 4}, devices=jax.devices()[:4])
    with sharding.sharding_context(mesh):
        got = jax.jit(lambda params, tokens: model.apply({"params": params}, tokens))(params,
                                                                                     tokens)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("source_len, target_len", [(14, 16), (16, 12)],
                         ids=["source-uncut", "target-uncut"])
def test_encoder_decoder_rows_that_cannot_be_cut_run_whole_with_the_same_logits(source_len,
                                                                                 target_len):
    """Under context=4 a source of 14 tokens (4 chunks needed) runs the encoder and the
    decoder whole; a target of 12 (8 chunks needed) runs the decoder whole against the
    encoder's split output."""
    config = ModelConfig(**{**TINY, "num_encoder_layers": 1, "num_decoder_layers": 1},
                         position_scheme="t5_bias", attention_backend="reference")
    batch = _seq2seq_batch(packed=True)
    source = jnp.asarray(batch["source"][:, :source_len])
    inputs = jnp.asarray(batch["inputs"][:, :target_len])
    model = EncoderDecoder(config)
    params = _init(config, dict(source=source, inputs=inputs))
    apply = lambda params, source, inputs: model.apply({"params": params}, source,  # noqa: E731
                                                       inputs)
    want = jax.jit(apply)(params, source, inputs)
    mesh = sharding.make_mesh({"data": 1, "context": 4}, devices=jax.devices()[:4])
    with sharding.sharding_context(mesh):
        got = jax.jit(apply)(params, source, inputs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_translate_under_a_context_mesh_equals_one_device():
    """Greedy translation under context=4: the encoder splits the 16-token source into
    chunks (its padding hidden), the cached decoding steps run whole against its output; the
    tokens and their scores are the one-device run's."""
    config = ModelConfig(**{**TINY, "num_encoder_layers": 1, "num_decoder_layers": 1},
                         position_scheme="t5_bias", attention_backend="reference")
    batch = _seq2seq_batch(packed=False)
    params = _init(config, {key: jnp.asarray(batch[key]) for key in ("source", "inputs")})
    _assert_decodes_alike_under_context_4(functools.partial(
        translate, params, config, batch["source"], np.array([LENGTH, 11]), method="greedy",
        max_new_tokens=6, eos_id=None))


def _assert_decodes_alike_under_context_4(run):
    """run() (a decoding call) gives the same tokens and scores under context=4 as alone."""
    want = run()
    mesh = sharding.make_mesh({"data": 1, "context": 4}, devices=jax.devices()[:4])
    with sharding.sharding_context(mesh):
        got = run()
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5)


@pytest.mark.parametrize("backend, scheme, chunk", [
    ("reference", "t5_bias", 0), ("flex", "t5_bias", 0), ("reference", "rope", 0),
    ("reference", "alibi", 8)])
def test_lm_generation_under_a_context_mesh_equals_one_device(backend, scheme, chunk,
                                                               monkeypatch):
    """Greedy continuation of 16-token prompts (one right-padded) under context=4: a prefill
    that fills its cache splits over the context axis as a full pass does (all_gather: each
    device's queries against the gathered keys, written into the cache in token order);
    prefill chunks (decode.prefill_chunk, here 2 of 8) and the cached steps run whole on every
    device. Tokens and scores are the one-device run's."""
    from tfm.nn import context_split

    config = ModelConfig(**{**TINY_LM, "num_decoder_layers": 1}, position_scheme=scheme,
                         attention_backend=backend)
    prompts = _batch()["inputs"]
    params = _init(config, dict(inputs=jnp.asarray(prompts)))
    splits = []
    split_rows = context_split.split_rows
    monkeypatch.setattr(context_split, "split_rows",
                        lambda *args, **kwargs: splits.append(args[-1]) or split_rows(*args,
                                                                                      **kwargs))
    _assert_decodes_alike_under_context_4(functools.partial(
        lm_generate, params, config, prompts, np.array([LENGTH, 11]), method="greedy",
        max_new_tokens=6, eos_id=None, prefill_chunk=chunk))
    assert splits == ([] if chunk else [4])  # traced once, under the mesh
