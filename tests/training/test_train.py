"""The training system end to end (tfm/training/train.py): tiny runs of the config families, exact
resume,
SIGTERM, the NaN guard, incompatible or corrupt checkpoints, label smoothing through the real
loop, and config validation before anything compiles. (configs/synthetic_lm.py learns end to end
through ./launch.sh in tests/test_launch.py.)

Runs share work: one reference run of a tiny synthetic seq2seq model (module fixture) serves the
resume, signal, NaN, checkpoint and label-smoothing tests, and jax's persistent compilation cache
(module fixture) lets every later run of the same model skip XLA compilation, since each
`train_and_evaluate` call jits its steps afresh.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gzip
import math
import os
import random
import re
import shutil
import signal
from collections.abc import Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from child_flags import uses_older_emitters
from compile_cache import persistent_compilation_cache
from run_records import assert_trees_equal, saved_state, train_losses

from configs import char_lm, context_extension, synthetic_lm, synthetic_seq2seq, translate
from tfm.checks import ConfigError
from tfm.kernels import cpu_compile
from tfm.training import checkpoint, metrics, train
from tfm.training import state as state_module
from tfm.training.config import parse_config
from tfm.training.evaluate import (
    PromptError,
    evaluate,
    evaluate_checkpoint,
    generate_from_checkpoint,
)
from tfm.training.experiment import compute_logits, required_lengths, setup
from tfm.training.state import TrainingError, init_state, restore_params, state_shardings

NUM_STEPS = 16  # the reference run
LABEL_SMOOTHING = 0.1


# ------------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module", autouse=True)
def compilation_cache_dir(tmp_path_factory):
    """jax's persistent compilation cache for this module's runs, restored afterwards."""
    with persistent_compilation_cache(tmp_path_factory.mktemp("jax_cache")):
        yield


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Prepared datasets and trained tokenizers, shared by the module's runs."""
    return tmp_path_factory.mktemp("data")


@contextlib.contextmanager
def count_compilations() -> Iterator[list[str]]:
    """Collects jax's lowering and XLA compilation events inside the block (tracing alone, e.g.
    jax.eval_shape, compiles nothing)."""
    events: list[str] = []

    def listener(name: str, duration: float, **kwargs) -> None:
        if name in ("/jax/core/compile/backend_compile_duration",
                    "/jax/core/compile/jaxpr_to_mlir_module_duration"):
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def tiny_model(config: ml_collections.ConfigDict, encoder_layers: int = 1) -> None:
    config.model.update(
        d_model=32, num_heads=2, d_ff=64, num_encoder_layers=encoder_layers, num_decoder_layers=1
    )


def seq2seq_config(data_dir, **train_overrides) -> ml_collections.ConfigDict:
    """The reference experiment: synthetic reverse, encoder-decoder, dropout and smoothing on
    (so resuming must reproduce the dropout RNG), evaluated and checkpointed every 8 steps."""
    config = synthetic_seq2seq.get_config("runlocal")
    tiny_model(config)
    config.model.dropout_rate = 0.1
    config.data.update(
        data_dir=str(data_dir),
        batch_size=16,
        seq_len=12,
        train_lengths=(1, 6),
        eval_lengths=(7, 9),
        num_train_examples=512,
        num_eval_examples=16,
    )
    config.optimizer.update(total_steps=NUM_STEPS, warmup_steps=4)
    config.train.update(
        num_steps=NUM_STEPS,
        log_every=1,
        eval_every=8,
        checkpoint_every=8,
        max_to_keep=1,
        label_smoothing=LABEL_SMOOTHING,
        keep_best_metric="eval_loss",
        best_mode="min",
        progress_bar=False,
    )
    config.eval.update(splits=("validation",), max_generation_examples=8)
    config.train.update(**train_overrides)
    return config


def assert_loss_falls(losses: list[float], factor: float) -> None:
    """The mean of the last quarter of logged losses is below `factor` x the first quarter's."""
    quarter = max(1, len(losses) // 4)
    early, late = np.mean(losses[:quarter]), np.mean(losses[-quarter:])
    assert all(math.isfinite(x) for x in losses), losses
    assert late < factor * early, f"loss did not fall: {early:.3f} -> {late:.3f} ({losses})"


def patch_train_batches(monkeypatch, on_batch) -> None:
    """Calls on_batch(index, batch) -> batch for every training batch the loop shards
    (eval batches, which carry example_weights, pass untouched)."""
    original = train.sharding.shard_batch
    count = [0]

    def shard_batch(host_batch, *args, **kwargs):
        if "example_weights" not in host_batch:
            count[0] += 1
            host_batch = on_batch(count[0], dict(host_batch))
        return original(host_batch, *args, **kwargs)

    monkeypatch.setattr(train.sharding, "shard_batch", shard_batch)


# ------------------------------------------------------------------- the reference seq2seq run


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """NUM_STEPS steps in one go: (config, workdir, returned metrics)."""
    workdir = tmp_path_factory.mktemp("reference")
    config = seq2seq_config(data_dir)
    result = train.train_and_evaluate(config, workdir)
    return config, workdir, result


def test_seq2seq_learns_and_keeps_last_and_best(reference):
    config, workdir, result = reference
    losses = train_losses(workdir)
    assert sorted(losses) == list(range(1, NUM_STEPS + 1))  # log_every=1
    assert_loss_falls(list(losses.values()), factor=0.85)  # (smoothed: its floor is higher)
    assert result["step"] == NUM_STEPS and "stopped_by" not in result
    records = metrics.read_metrics(workdir)
    eval_losses = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(eval_losses) == [8, 16]
    assert result["eval_loss"] == eval_losses[NUM_STEPS]
    assert 0.0 <= result["eval_exact_match"] <= 100.0
    # max_to_keep=1 plus the best step by eval_loss (min) among the evaluated checkpoints.
    best = min(eval_losses, key=eval_losses.get)
    with checkpoint.Checkpointer(workdir / "checkpoints") as checkpointer:
        assert set(checkpointer.all_steps()) == {best, NUM_STEPS}
        assert checkpointer.saved_config()["model"]["d_model"] == 32
    state = saved_state(workdir, NUM_STEPS)
    assert set(state) == {"step", "params", "opt_state", "rng"} and int(state["step"]) == NUM_STEPS
    assert (workdir / "checkpoints" / str(NUM_STEPS) / "data").is_dir()  # the data position
    assert (workdir / "config.json").exists()


def test_label_smoothing_in_the_loop_matches_hand_computation(reference, data_dir, tmp_path):
    """One more step after the reference run: the train_loss the loop logs is the smoothed
    cross-entropy with the configured epsilon, computed here by hand from the saved params, the
    next batch of the restored data iterator and the dropout key derived from (seed, step);
    train_nll is the unsmoothed loss of the same logits. (Not at step 1: near-uniform initial
    predictions make the smoothed and unsmoothed losses almost equal.)"""
    _, reference_dir, _ = reference
    workdir = tmp_path / "run"
    shutil.copytree(reference_dir, workdir)
    config = seq2seq_config(data_dir, num_steps=NUM_STEPS + 1, eval_every=0)
    experiment = setup(config, workdir)
    assert experiment.train.label_smoothing == LABEL_SMOOTHING
    abstract, _ = state_shardings(experiment)
    iterator = experiment.data.train_iterator()
    with checkpoint.Checkpointer(workdir / "checkpoints") as checkpointer:
        state = checkpointer.restore(NUM_STEPS, abstract_state=abstract, data_iterator=iterator)
    batch = {k: jnp.asarray(v) for k, v in next(iterator).items()}
    logits_fn = jax.jit(
        functools.partial(
            compute_logits, experiment.model, mode=experiment.mode, deterministic=False
        )
    )
    logits = logits_fn(state.params, batch, dropout_rng=jax.random.fold_in(state.rng, NUM_STEPS))
    logits = np.asarray(logits, np.float64)
    log_probs = logits - logits.max(-1, keepdims=True)
    log_probs -= np.log(np.exp(log_probs).sum(-1, keepdims=True))
    vocab = logits.shape[-1]
    targets, weights = np.asarray(batch["targets"]), np.asarray(batch["weights"], np.float64)
    smoothed = (1 - LABEL_SMOOTHING) * np.eye(vocab)[targets] + LABEL_SMOOTHING / vocab
    loss = -(smoothed * log_probs).sum(-1)
    nll = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    expected_loss = (weights * loss).sum() / weights.sum()
    expected_nll = (weights * nll).sum() / weights.sum()
    assert expected_loss - expected_nll > 0.01  # smoothing visibly changes this loss

    train.train_and_evaluate(config, workdir)
    logged = metrics.read_metrics(workdir)
    step = next(r for r in logged if r["step"] == NUM_STEPS + 1 and "train_loss" in r)
    assert step["train_loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert step["train_nll"] == pytest.approx(expected_nll, rel=1e-5)
    assert step["train_tokens"] == weights.sum()  # real tokens only, padding excluded
    assert weights.sum() < weights.size  # (the batch has padding)


def test_resume_after_a_final_save_and_a_sigterm_is_exact(reference, data_dir, tmp_path,
                                                         monkeypatch):
    """5 steps (num_steps=5: the final save at a step that is no checkpoint multiple), a
    restart that SIGTERM stops at step 11 (a forced save), and a last restart to N give the
    same losses and the same final state, bit for bit, as N steps in one run."""
    config, reference_dir, reference_result = reference
    workdir = tmp_path / "run"
    first = train.train_and_evaluate(seq2seq_config(data_dir, num_steps=5), workdir)
    assert first["step"] == 5 and "stopped_by" not in first
    with checkpoint.Checkpointer(workdir / "checkpoints") as checkpointer:
        assert checkpointer.latest_step() == 5

    handler_before = signal.getsignal(signal.SIGTERM)

    def terminate_at_step_11(index, batch):  # index counts this run's batches: 6, 7, ...
        if index == 11 - 5:
            os.kill(os.getpid(), signal.SIGTERM)
        return batch

    with monkeypatch.context() as patch:
        patch_train_batches(patch, terminate_at_step_11)
        stopped = train.train_and_evaluate(config, workdir)
    assert stopped["stopped_by"] == "SIGTERM" and stopped["step"] == 11
    assert signal.getsignal(signal.SIGTERM) == handler_before  # the handler is restored
    with checkpoint.Checkpointer(workdir / "checkpoints") as checkpointer:
        assert checkpointer.latest_step() == 11
    assert int(saved_state(workdir, 11)["step"]) == 11

    last = train.train_and_evaluate(config, workdir)
    assert last["step"] == NUM_STEPS and "stopped_by" not in last
    expected, resumed = train_losses(reference_dir), train_losses(workdir)
    assert sorted(resumed) == list(range(1, NUM_STEPS + 1))  # no step lost or logged twice
    assert resumed == expected  # exact float equality, every step
    assert last["eval_loss"] == reference_result["eval_loss"]
    assert_trees_equal(saved_state(workdir, NUM_STEPS), saved_state(reference_dir, NUM_STEPS))


def test_stop_request_handles_sigint():
    """SIGINT (Ctrl-C) takes the same path as SIGTERM: a flag the loop reads between steps."""
    before = signal.getsignal(signal.SIGINT)
    with train._StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.signal_name == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before


def test_nonfinite_loss_stops_without_overwriting(reference, data_dir, tmp_path, monkeypatch):
    """NaN weights from step N + 2 on poison the loss and the params; logging is rare, so the
    first check is the save at step N + 4, which must raise instead of saving."""
    _, reference_dir, _ = reference
    workdir = tmp_path / "run"
    shutil.copytree(reference_dir, workdir)
    before = saved_state(workdir, NUM_STEPS)

    def poison(index, batch):
        if index >= 2:
            batch["weights"] = batch["weights"] * np.float32("nan")
        return batch

    patch_train_batches(monkeypatch, poison)
    config = seq2seq_config(
        data_dir, num_steps=NUM_STEPS + 8, log_every=100, checkpoint_every=4, eval_every=0
    )
    with pytest.raises(TrainingError) as error:
        train.train_and_evaluate(config, workdir)
    message = str(error.value)
    assert "non-finite" in message and f"steps {NUM_STEPS + 1}-{NUM_STEPS + 4}" in message
    assert f"last good checkpoint is step {NUM_STEPS}" in message
    with checkpoint.Checkpointer(workdir / "checkpoints") as checkpointer:
        assert checkpointer.latest_step() == NUM_STEPS
    assert_trees_equal(saved_state(workdir, NUM_STEPS), before)


def test_incompatible_model_config_names_the_field(reference, data_dir, tmp_path):
    _, reference_dir, _ = reference
    workdir = tmp_path / "run"
    shutil.copytree(reference_dir, workdir)
    config = seq2seq_config(data_dir, num_steps=NUM_STEPS + 8)
    config.model.d_model = 48
    with count_compilations() as compiled, pytest.raises(ValueError) as error:
        train.train_and_evaluate(config, workdir)
    assert "model.d_model: saved 32, current 48" in str(error.value)
    assert f"workdir {workdir} " in str(error.value) and "--workdir" in str(error.value)
    assert not compiled
    assert (workdir / "config.json").read_text() == (reference_dir / "config.json").read_text()


def test_incompatible_optimizer_state_names_the_field(reference, data_dir, tmp_path):
    """Dropping gradient clipping changes the optimizer-state tree: the error says so."""
    _, reference_dir, _ = reference
    workdir = tmp_path / "run"
    shutil.copytree(reference_dir, workdir)
    config = seq2seq_config(data_dir, num_steps=NUM_STEPS + 8)
    config.optimizer.grad_clip_norm = 0.0
    with pytest.raises(TrainingError, match=r"optimizer.grad_clip_norm: saved 1.0, current"):
        train.train_and_evaluate(config, workdir)


# After a failed read, orbax's restore closes its event loop while tensorstore callbacks are
# still in flight; they report "Event loop is closed" as unraisable exceptions (harmless).
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["garble_arrays", "remove_state"])
def test_corrupt_checkpoint_names_the_path(reference, data_dir, tmp_path, damage):
    _, reference_dir, _ = reference
    workdir = tmp_path / "run"
    shutil.copytree(reference_dir, workdir)
    step_dir = workdir / "checkpoints" / str(NUM_STEPS)
    if damage == "garble_arrays":
        garble_arrays(step_dir)
    else:
        shutil.rmtree(step_dir / "state")
    with pytest.raises(checkpoint.CheckpointError, match=str(step_dir)) as error:
        train.train_and_evaluate(seq2seq_config(data_dir, num_steps=NUM_STEPS + 8), workdir)
    # One line, not tensorstore's JSON spec; with no readable step nothing is moved.
    assert "\n" not in str(error.value) and len(str(error.value)) < 800, str(error.value)
    assert step_dir.is_dir() and not (workdir / "checkpoints_corrupt").exists()


def garble_arrays(step_dir) -> None:
    """Truncates every array chunk file of a saved step."""
    chunks = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert chunks
    for path in chunks:
        path.write_bytes(path.read_bytes()[:7])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_latest_checkpoint_falls_back_and_is_moved_aside(
    reference, data_dir, tmp_path, caplog
):
    """Steps 8 and 16 saved, 16 truncated: the restart warns naming step 16, moves it to
    checkpoints_corrupt/16 (kept, not deleted), resumes from 8, and reaches the reference
    state at 16 again."""
    _, reference_dir, _ = reference
    workdir = tmp_path / "run"
    config = seq2seq_config(data_dir, max_to_keep=3, keep_best_metric=None)
    train.train_and_evaluate(config, workdir)
    garble_arrays(workdir / "checkpoints" / str(NUM_STEPS))
    bad_files = sorted(p.name for p in (workdir / "checkpoints" / str(NUM_STEPS)).rglob("*"))

    with caplog.at_level("WARNING", logger="tfm.training.train"):
        result = train.train_and_evaluate(config, workdir)
    warnings = [r.getMessage() for r in caplog.records if r.name == "tfm.training.train"]
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert warnings[0].startswith(f"checkpoint step {NUM_STEPS} could not be read")
    assert "training resumes from step 8" in warnings[0]
    moved = workdir / "checkpoints_corrupt" / str(NUM_STEPS)
    assert str(moved) in warnings[0]
    assert sorted(p.name for p in moved.rglob("*")) == bad_files  # kept whole
    assert result["step"] == NUM_STEPS
    with checkpoint.Checkpointer(workdir / "checkpoints") as checkpointer:
        assert checkpointer.all_steps() == [8, NUM_STEPS]
    assert_trees_equal(saved_state(workdir, NUM_STEPS), saved_state(reference_dir, NUM_STEPS))


@pytest.mark.parametrize(
    "overrides, match",
    [
        # Eval decoding: source width 7 (6 symbols + eos) + eval.extra_len 50 + bos = 58.
        (dict(max_len=20), r"eval decoding of split 'validation' \(source length 7 \+ "
                           r"eval.extra_len=50 \+ bos\) needs 58;"),
        (dict(max_len=60), r"generate.max_new_tokens=64 \(\+ 1\) needs 65$"),
        (dict(max_len=11), r"data.seq_len=12 \(training rows\) needs 12"),
    ],
)
def test_learned_positions_shorter_than_a_needed_length_fail_before_compiling(
    data_dir, tmp_path, overrides, match
):
    """Every length the run needs (train rows, eval rows, eval decoding, generation) is checked
    against model.max_len at setup, not at the first evaluation after training."""
    config = seq2seq_config(data_dir)
    config.model.update(position_scheme="learned", **overrides)
    with count_compilations() as compiled, pytest.raises(ConfigError) as error:
        setup(config, tmp_path)
    assert not compiled
    message = str(error.value)
    assert message.startswith(f"model.max_len={overrides['max_len']} is too short")
    assert re.search(match, message.split(". Set model.max_len")[0]), message
    assert "\n" not in message
    config.model.max_len = 65  # exactly long enough
    setup(config, tmp_path)


def test_an_error_during_training_saves_the_last_step_and_resumes_exactly(
    reference, data_dir, tmp_path, monkeypatch, capsys
):
    """An exception in the first evaluation (step 8) saves step 8 before it propagates, and one
    inside a step (its batch taken, step 12 unfinished) saves step 11 with the data position
    before that batch: resuming from either reaches the uninterrupted run's state bit for bit."""
    _, reference_dir, reference_result = reference
    workdir = tmp_path / "run"
    config = seq2seq_config(data_dir)

    def failing_evaluate(*args, **kwargs):
        raise RuntimeError("evaluation broke")

    with monkeypatch.context() as patch:
        patch.setattr(train, "evaluate", failing_evaluate)
        with pytest.raises(RuntimeError, match="evaluation broke"):
            train.train_and_evaluate(config, workdir)
    with checkpoint.Checkpointer(workdir / "checkpoints") as checkpointer:
        assert checkpointer.all_steps() == [8]
    assert capsys.readouterr().out.splitlines()[-1] == (
        f"saved step 8 in {workdir / 'checkpoints'} before stopping on the error below")

    def fail_at_step_12(index, batch):  # index counts this run's batches: 9, 10, ...
        if index == 12 - 8:
            raise RuntimeError("input broke")
        return batch

    with monkeypatch.context() as patch:
        patch_train_batches(patch, fail_at_step_12)
        with pytest.raises(RuntimeError, match="input broke"):
            train.train_and_evaluate(config, workdir)
    with checkpoint.Checkpointer(workdir / "checkpoints") as checkpointer:
        assert checkpointer.latest_step() == 11

    last = train.train_and_evaluate(config, workdir)
    assert last["step"] == NUM_STEPS
    assert train_losses(workdir) == train_losses(reference_dir)
    assert last["eval_loss"] == reference_result["eval_loss"]
    assert_trees_equal(saved_state(workdir, NUM_STEPS), saved_state(reference_dir, NUM_STEPS))


def test_eval_from_checkpoint_reproduces_training_eval(reference):
    """`./launch.sh eval` (in process) gives the metrics logged at the last training step.
    (`generate` runs end to end in tests/test_launch.py.)"""
    config, workdir, result = reference
    evaluated = evaluate_checkpoint(config, workdir)
    assert evaluated["step"] == NUM_STEPS
    assert evaluated["eval_loss"] == pytest.approx(result["eval_loss"], rel=1e-6)
    assert evaluated["eval_exact_match"] == result["eval_exact_match"]


def test_prompt_characters_outside_the_vocabulary(reference, caplog):
    """'12a4' is an error naming 'a' (it used to become '1 2 <unk> 4' silently); with
    generate.map_unknown=True it is generated from, and a prompt longer than the training
    source rows of sinusoidal positions gets a one-line warning, not an error."""
    config, workdir, _ = reference
    with pytest.raises(PromptError) as error:
        generate_from_checkpoint(config, workdir, ["123", "12a4"])
    assert str(error.value) == (
        "prompt 2 '12a4' has characters outside the vocabulary: 'a' (the vocabulary: "
        "'0123456789+='); remove them, or pass --config.generate.map_unknown=True to map them "
        "to <unk>")
    config = ml_collections.ConfigDict(config.to_dict())
    config.generate.map_unknown = True
    long_prompt = "0123456789012345"  # 16 symbols + eos: longer than data.seq_len=12
    with caplog.at_level("WARNING", logger="tfm.training.train"):
        outputs = generate_from_checkpoint(config, workdir, ["12a4", long_prompt])
    assert len(outputs) == 2 and all(isinstance(o, str) for o in outputs)
    warnings = [r.getMessage() for r in caplog.records if r.name == "tfm.training.train"]
    assert warnings == [
        f"prompt 2 {long_prompt!r} is 17 tokens, longer than the 12 of the training rows; "
        "position_scheme='sinusoidal' runs at any length, but quality past the trained lengths "
        "may drop"]


def test_eval_decoding_shows_progress(reference, capsys):
    """Eval decoding (minutes for BLEU on a real split) shows a bar over its batches when
    train.progress_bar is on, and nothing when it is off."""
    config, workdir, _ = reference
    experiment = setup(config, workdir)
    params, _ = restore_params(experiment)
    capsys.readouterr()
    evaluate(experiment, params)
    assert "decode validation" not in capsys.readouterr().err
    experiment.train = dataclasses.replace(experiment.train, progress_bar=True)
    evaluate(experiment, params)
    err = capsys.readouterr().err
    assert "decode validation:" in err and "/1 [" in err and "batch/s" in err, err


# -------------------------------------------------------------------- the other config families


def write_text_corpus(path, num_paragraphs: int = 240) -> None:
    lines = ["the cat sat on the mat.", "a dog ran in the fog.", "the sun is hot.",
             "we like tea and cake.", "it is a red hat."]
    rng = random.Random(0)
    paragraphs = ["\n".join(rng.choice(lines) for _ in range(2)) for _ in range(num_paragraphs)]
    path.write_text("\n\n".join(paragraphs) + "\n")


def test_char_lm_learns(data_dir, tmp_path):
    corpus = tmp_path / "corpus.txt"
    write_text_corpus(corpus)
    config = char_lm.get_config("runlocal")
    tiny_model(config, encoder_layers=0)
    config.data.update(data_dir=str(data_dir), path=str(corpus), seq_len=32, eval_seq_len=32,
                       batch_size=16, eval_batch_size=16)
    config.optimizer.update(total_steps=24, warmup_steps=4, learning_rate=3e-3)
    config.train.update(num_steps=24, log_every=3, eval_every=0, checkpoint_every=24,
                        progress_bar=False)
    config.eval.max_batches = 2
    result = train.train_and_evaluate(config, tmp_path / "run")
    losses_seen = list(train_losses(tmp_path / "run").values())
    # The LM init starts at ~ln(vocab) (not above it), so 24 steps take off less than 20%.
    assert_loss_falls(losses_seen, factor=0.9)
    vocab_size = len(set(corpus.read_text())) + 4
    assert abs(losses_seen[0] - math.log(vocab_size)) < 0.25
    assert result["eval_loss"] < 0.9 * math.log(vocab_size)
    assert "eval_bleu" not in result and "eval_exact_match" not in result


def test_char_lm_extrapolation_fits_learned_positions_at_context_128(data_dir, tmp_path):
    """The extrapolation variant keeps the chosen scheme, trains on contiguous blocks, and
    everything the run itself needs (train and eval rows, generation) fits max_len=128, so
    learned positions train and are n/a only at longer `eval --eval_seq_len` lengths."""
    corpus = tmp_path / "corpus.txt"
    write_text_corpus(corpus)
    assert char_lm.get_config("alibi,extrapolation").model.position_scheme == "alibi"
    config = char_lm.get_config("extrapolation,learned")
    # batch_size 16: the tests' 8 host devices split the batch (the recipe's 12 is for 1 CPU).
    config.data.update(data_dir=str(data_dir), path=str(corpus), batch_size=16)
    with count_compilations() as compiled:
        experiment = setup(config, tmp_path / "run")
    assert not compiled
    assert experiment.model_config.max_len == 128
    assert max(length for length, _ in required_lengths(experiment)) <= 128
    windows = experiment.data.eval_examples("validation")
    assert {len(w["inputs"]) for w in windows} == {128}


@pytest.mark.parametrize("scheme", ["alibi", "t5_bias"])
def test_char_lm_extrapolation_with_flex_attention_gives_the_reference_metrics(
        data_dir, tmp_path, scheme):
    """The extrapolation recipe, shrunk, trained with the fused bias kernel (interpret mode
    here) and with the reference maths: the same train losses at every step and the same
    eval loss at twice the training context."""
    corpus = tmp_path / "corpus.txt"
    write_text_corpus(corpus)
    results, losses = {}, {}
    for backend in ("reference", "flex"):
        config = char_lm.get_config(f"{scheme},extrapolation")
        tiny_model(config, encoder_layers=0)
        config.model.update(attention_backend=backend, dropout_rate=0.0)
        config.data.update(data_dir=str(data_dir), path=str(corpus), batch_size=16,
                           eval_seq_len=256, eval_batch_size=16)
        config.optimizer.update(total_steps=6, warmup_steps=2)
        config.train.update(num_steps=6, log_every=1, eval_every=0, checkpoint_every=6,
                            progress_bar=False)
        config.eval.max_batches = 1
        config.generate.max_new_tokens = 4
        results[backend] = train.train_and_evaluate(config, tmp_path / backend)
        losses[backend] = train_losses(tmp_path / backend)
    assert losses["flex"].keys() == losses["reference"].keys() and len(losses["flex"]) == 6
    np.testing.assert_allclose(list(losses["flex"].values()),
                               list(losses["reference"].values()), rtol=1e-5)
    np.testing.assert_allclose(results["flex"]["eval_loss"], results["reference"]["eval_loss"],
                               rtol=1e-5)


def write_parallel_corpus(directory, num_train: int = 320, num_eval: int = 16) -> dict[str, str]:
    """German -> English word-for-word sentences (a learnable task); plain and gzipped files."""
    subjects = [("der hund", "the dog"), ("die katze", "the cat"), ("der mann", "the man"),
                ("die frau", "the woman"), ("das kind", "the child")]
    verbs = [("sieht", "sees"), ("mag", "likes"), ("ruft", "calls")]
    objects = [("den ball", "the ball"), ("das haus", "the house"), ("den baum", "the tree"),
               ("das auto", "the car")]
    rng = random.Random(0)

    def pairs(count):
        chosen = [(rng.choice(subjects), rng.choice(verbs), rng.choice(objects))
                  for _ in range(count)]
        return ([f"{s[0]} {v[0]} {o[0]}." for s, v, o in chosen],
                [f"{s[1]} {v[1]} {o[1]}." for s, v, o in chosen])

    paths = {}
    for split, count in (("train", num_train), ("val", num_eval)):
        source, target = pairs(count)
        for field, lang, lines in (("source", "de", source), ("target", "en", target)):
            path = directory / f"{split}.{lang}.gz"
            with gzip.open(path, "wt") as file:
                file.write("\n".join(lines) + "\n")
            prefix = "" if split == "train" else "eval_"
            paths[f"{prefix}{field}_path"] = str(path)
    return paths


def test_translate_learns(data_dir, tmp_path):
    config = translate.get_config("runlocal")
    tiny_model(config)
    config.data.update(data_dir=str(data_dir), vocab_size=64, seq_len=24, batch_size=16,
                       **write_parallel_corpus(tmp_path))
    config.optimizer.update(warmup_steps=10)
    config.train.update(num_steps=24, log_every=3, eval_every=0, checkpoint_every=24,
                        progress_bar=False)
    config.eval.update(max_generation_examples=4, extra_len=8)
    result = train.train_and_evaluate(config, tmp_path / "run")
    assert_loss_falls(list(train_losses(tmp_path / "run").values()), factor=0.8)
    assert 0.0 <= result["eval_bleu"] <= 100.0
    assert math.isfinite(result["eval_loss"])


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_rbg_dropout_keys_are_reproducible_and_drop_at_the_configured_rate(impl):
    base = jax.random.PRNGKey(7)
    key = train.dropout_key(base, jnp.int32(3), impl)
    assert str(jax.random.key_impl(key)) == impl
    again = train.dropout_key(base, jnp.int32(3), impl)
    later = train.dropout_key(base, jnp.int32(4), impl)
    np.testing.assert_array_equal(jax.random.key_data(key), jax.random.key_data(again))
    assert not np.array_equal(jax.random.key_data(key), jax.random.key_data(later))
    rate, n = 0.25, 400_000
    dropped = nn.Dropout(rate).apply({}, jnp.ones(n), deterministic=False, rngs={"dropout": key})
    dropped = np.asarray(dropped)
    assert abs((dropped == 0).mean() - rate) < 5 * math.sqrt(rate * (1 - rate) / n)
    np.testing.assert_allclose(dropped[dropped != 0], 1 / (1 - rate), rtol=1e-6)


# XLA's own fusion emitters where the suite's XLA_FLAGS turn them off (conftest.py): the two
# threefry programs differ, and only these emitters, which tfm's steps compile with, fuse them
# into bit-identical updates (the older ones differ by float rounding, 5e-5).
XLA_EMITTERS = {"xla_cpu_use_fusion_emitters": True} if uses_older_emitters() else None


def test_the_dropout_generator_is_reproducible_in_the_train_step(data_dir, tmp_path):
    """The same state and batch give bit-identical steps with each generator; tfm's fused
    threefry draws jax's threefry masks (the same step as jax's own lowering), rbg other masks
    (so a different loss), from the same checkpointed state."""
    experiment = setup(seq2seq_config(data_dir), tmp_path)
    _, shardings = state_shardings(experiment)
    state = init_state(experiment, shardings)
    batch = {k: jnp.asarray(v) for k, v in next(experiment.data.train_iterator()).items()}
    losses, params = {}, {}
    for impl in ("rbg", "threefry", "threefry2x32"):
        step = jax.jit(functools.partial(
            train.train_step, model=experiment.model, mode=experiment.mode,
            optimizer=experiment.optimizer, schedule=experiment.schedule, label_smoothing=0.0,
            dropout_rng_impl=impl), compiler_options=XLA_EMITTERS)
        first, out = step(state, batch)
        second, out_again = step(state, batch)
        assert_trees_equal(first.params, second.params)
        assert float(out["loss_sum"]) == float(out_again["loss_sum"])
        losses[impl], params[impl] = float(out["loss_sum"]), first.params
    assert losses["rbg"] != losses["threefry"]
    assert losses["threefry"] == losses["threefry2x32"]
    assert_trees_equal(params["threefry"], params["threefry2x32"])


def _small_char_lm_config(data_dir, corpus):
    """char_lm.py:small (learned positions, normal(0.02) embeddings) at test size."""
    write_text_corpus(corpus)
    config = char_lm.get_config("small")
    tiny_model(config, encoder_layers=0)
    config.data.update(data_dir=str(data_dir), path=str(corpus), seq_len=32, eval_seq_len=32,
                       batch_size=16, eval_batch_size=16)
    return config


@pytest.fixture
def run_once_options_unforced(monkeypatch):
    """The suite's XLA_FLAGS set -O0 for every program (faster compiles), which tfm's options
    then leave alone; without it in $XLA_FLAGS, run_once_options asks for -O1."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    cpu_compile.run_once_options.cache_clear()
    cpu_compile.compiler_options.cache_clear()
    yield
    cpu_compile.run_once_options.cache_clear()
    cpu_compile.compiler_options.cache_clear()


@pytest.mark.parametrize("kind", ["seq2seq", "char_lm_small"])
def test_init_compiled_for_one_run_gives_the_same_parameters_bit_for_bit(
    kind, data_dir, tmp_path, run_once_options_unforced
):
    """init_state compiles with cpu_compile.run_once_options (LLVM -O1 on CPU, to compile
    faster): the parameters and optimizer state must equal those of the init program compiled
    at XLA's default -O3, bit for bit, or a run's numbers would depend on the option (at -O0
    the normal(0.02) embeddings differ in the last bit)."""
    config = (seq2seq_config(data_dir) if kind == "seq2seq"
              else _small_char_lm_config(data_dir, tmp_path / "corpus.txt"))
    experiment = setup(config, tmp_path / "run")
    if jax.default_backend() == "cpu":  # else: XLA's defaults both ways
        assert cpu_compile.run_once_options() == cpu_compile.RUN_ONCE_OPTIONS
    _, shardings = state_shardings(experiment)
    state = init_state(experiment, shardings)
    init = state_module._init_fn(experiment)
    default_level = {**(cpu_compile.compiler_options() or {}), cpu_compile.LLVM_LEVEL: 3}
    with train.sharding.sharding_context(experiment.mesh, experiment.rules):
        reference = jax.jit(lambda rng: nn.meta.unbox(init(rng)), out_shardings=shardings,
                            compiler_options=default_level)(
            jax.random.PRNGKey(experiment.train.seed))
    assert_trees_equal(state, reference)


def _one_step(config, workdir):
    """(params before, state after one compiled train step on the first batch, its metrics),
    on the config's mesh (all 8 test devices, data parallel)."""
    experiment = setup(config, workdir)
    _, shardings = state_shardings(experiment)
    state = init_state(experiment, shardings)
    batch = train.sharding.shard_batch(
        next(experiment.data.train_iterator()), experiment.mesh,
        train.sharding.batch_sharding(experiment.mesh, experiment.rules), experiment.rules,
    )
    jit_train, _ = train.jit_steps(experiment, shardings)
    before = jax.tree.map(np.asarray, state.params)
    return (before, *jit_train(state, batch))


def test_microbatches_give_the_whole_batch_update(data_dir, tmp_path):
    """train.microbatches=2 splits each device's share of the (padded, seq2seq) batch in two
    and sums the halves' gradients: without dropout, the whole batch's loss sums, gradient norm
    and updated params, up to float summation order; with dropout, a reproducible step."""
    config = seq2seq_config(data_dir)
    config.model.dropout_rate = 0.0
    # Adam's first step is nearly sign(g); with eps = 1 it is nearly linear in g, so the
    # summation-order differences of near-zero gradient entries stay near zero in the update;
    # a large rate makes the update large beside the params' float32 rounding.
    config.optimizer.update(eps=1.0, learning_rate=1000.0)
    before, whole, whole_metrics = _one_step(config, tmp_path / "whole")
    config.train.microbatches = 2
    _, split, split_metrics = _one_step(config, tmp_path / "split")
    for name in ("loss_sum", "nll_sum", "weight_sum", "correct_sum", "grad_norm"):
        np.testing.assert_allclose(split_metrics[name], whole_metrics[name], rtol=1e-5)
    assert float(whole_metrics["weight_sum"]) < 16 * 12  # padding: weights are not all 1
    whole_update = jax.tree.map(lambda new, old: np.asarray(new) - old, whole.params, before)
    split_update = jax.tree.map(lambda new, old: np.asarray(new) - old, split.params, before)
    scale = max(np.abs(update).max() for update in jax.tree.leaves(whole_update))
    assert scale > 1e-3  # the step moved the params
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * scale),
                 split_update, whole_update)

    config.model.dropout_rate = 0.1
    _, first, first_metrics = _one_step(config, tmp_path / "dropout")
    _, again, again_metrics = _one_step(config, tmp_path / "dropout_again")
    assert float(first_metrics["loss_sum"]) == float(again_metrics["loss_sum"])
    assert_trees_equal(first.params, again.params)
    assert float(first_metrics["loss_sum"]) != float(split_metrics["loss_sum"])


# --------------------------------------------------------------------------- config validation


def _set(config: ml_collections.ConfigDict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for name in parents:
        config = config[name]
    with config.unlocked():
        config[leaf] = value


@pytest.mark.parametrize(
    "path, value, match",
    [
        ("foo", ml_collections.ConfigDict({"x": 1}), "config.foo is unknown; known config fields"),
        ("model.foo", 1, "foo"),
        ("data.foo", 1, "data.foo"),
        ("optimizer.foo", 1, "optimizer.foo"),
        ("train.foo", 1, "train.foo"),
        ("eval.foo", 1, "eval.foo"),
        ("generate.foo", 1, "generate.foo"),
        ("model.num_heads", 3, "num_heads=3"),
        ("model.position_scheme", "rotary", "position_scheme='rotary' is unknown; choose one of"),
        ("model.remat", "everything", "model.remat='everything' is unknown; choose one of: none"),
        ("model.remat", "offload", "model.remat='offload' moves saved activations to host"),
        ("train.num_steps", 0, "train.num_steps=0"),
        ("train.label_smoothing", 1.0, "train.label_smoothing=1.0"),
        ("train.max_to_keep", 0, "train.max_to_keep=0"),
        ("optimizer.name", "sgd", "optimizer.name='sgd'"),
        ("data.kind", "csv", "data.kind='csv'"),
        ("eval.generation_metric", "rouge", "eval.generation_metric='rouge'"),
        ("eval.method", "nucleus", "eval.method='nucleus'"),
        ("generate.method", "beam_search", "generate.method='beam_search'"),
        ("generate.temperature", 0.0, "generate.temperature=0.0"),
        ("train.keep_best_metric", "eval_bleu", "train.keep_best_metric='eval_bleu'"),
        ("train.dropout_rng", "philox", "train.dropout_rng='philox'"),
        ("train.microbatches", 0, "train.microbatches=0"),
        ("train.cpu_kernels", "mkl", "train.cpu_kernels='mkl'"),
        ("train.compilation_cache_dir", " ", "train.compilation_cache_dir=' ' must be a folder"),
        ("train.compilation_cache_dir", "/dev/null/xla", "cannot create or use that folder"),
        # batch_size 16 over 8 devices leaves 2 rows per device
        ("train.microbatches", 4, "train.microbatches=4 must divide each device's share"),
    ],
)
def test_config_errors_name_the_field_before_compiling(data_dir, tmp_path, path, value, match):
    config = seq2seq_config(data_dir)
    _set(config, path, value)
    with count_compilations() as compiled, pytest.raises(ConfigError, match=match):
        setup(config, tmp_path)
    assert not compiled


def test_valid_config_sets_up_without_compiling(data_dir, tmp_path):
    with count_compilations() as compiled:
        experiment = setup(seq2seq_config(data_dir), tmp_path)
    assert not compiled
    assert experiment.mode == "seq2seq"
    assert experiment.model_config.vocab_size == experiment.data.vocab_size


def test_setup_parses_each_section_once(data_dir, tmp_path, monkeypatch):
    """One pass over the config: setup and the compiled steps resolve the optimizer section
    once, and the experiment carries the frozen sections (the decode config hashable)."""
    from tfm.training import optim

    calls = []
    resolve = optim.resolve_optimizer_config
    monkeypatch.setattr(
        optim, "resolve_optimizer_config",
        lambda section, num_steps=None: calls.append(1) or resolve(section, num_steps),
    )
    experiment = setup(seq2seq_config(data_dir), tmp_path)
    train.jit_steps(experiment, state_shardings(experiment)[1])
    assert len(calls) == 1
    assert experiment.mode == experiment.data.mode == "seq2seq"
    with pytest.raises(dataclasses.FrozenInstanceError):
        experiment.train.num_steps = 1  # type: ignore[misc]
    decode = experiment.generate.decode_config(experiment.mode)
    assert hash(decode) == hash(dataclasses.replace(decode))


SCHEMES = ("none", "sinusoidal", "learned", "rope", "relative", "t5_bias", "alibi")


@pytest.mark.parametrize(
    "module, variants",
    [
        (synthetic_seq2seq, ("copy", "reverse", "sort", "addition", "runlocal", "sort,alibi")),
        (synthetic_lm, ("copy", "reverse", "sort", "addition", "runlocal", "reverse,t5_bias")),
        (char_lm, ("runlocal", "bf16", "alibi,runlocal", "extrapolation", "alibi,extrapolation")),
        (translate, ("small", "runlocal", "wmt", "relative,small")),
        (context_extension, ("runlocal", "fire", "kerple_log,runlocal")),
    ],
)
def test_every_config_variant_is_valid(module, variants):
    """Each config file, plain and with each variant (and every position scheme), passes the
    validation `setup` runs before building anything."""
    for arg in (None, *variants, *SCHEMES):
        config = module.get_config(arg)
        parse_config(config)
        if arg in SCHEMES:
            assert config.model.position_scheme == arg


def test_unknown_variant_lists_the_choices():
    with pytest.raises(ValueError, match="config variant 'rotary' is unknown; choose from: "):
        synthetic_lm.get_config("rotary")
