"""Training: the pure, jit-compiled train step and the loop that resumes, logs, evaluates and
saves.

Data flows one way: config -> data pipeline -> model -> loss -> optimizer -> checkpoint/metrics.
`train_and_evaluate(config, workdir)` is what `./launch.sh train` runs. The config's sections
live in tfm/training/config.py, the experiment's setup in tfm/training/experiment.py, the train
state and its restore in tfm/training/state.py, the loss in tfm/training/losses.py, evaluation
and generation in tfm/training/evaluate.py.
"""

from __future__ import annotations

import functools
import json
import math
import signal
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from tfm.kernels import cpu_compile, cpu_memory, hardware
from tfm.parallel import sharding
from tfm.training import (
    checkpoint,
    diagnostics,
    flops,
    losses,
    metrics,
    optim,
    prng,
    profiling,
    trackers,
)
from tfm.training import workdir as workdir_record
from tfm.training.config import ExperimentConfig, TrainConfig, parse_config
from tfm.training.evaluate import evaluate, jit_eval_step
from tfm.training.experiment import Experiment, setup
from tfm.training.losses import loss_sums
from tfm.training.state import (
    InShardingContext,
    TrainingError,
    TrainState,
    init_state,
    make_checkpointer,
    optimizer_differences,
    restore_newest_readable,
    state_shardings,
)


def dropout_key(base_rng: jax.Array, step: jax.Array, impl: str = "threefry") -> jax.Array:
    """The dropout key of one step: the run's base key (uint32[2], threefry, as checkpointed)
    folded with the step, so a resumed run draws the same masks.

    impl "threefry": a `prng.FUSED_THREEFRY` key, jax's threefry masks bit for bit, hashed in
    fused elementwise code. Any jax generator name ("threefry2x32": jax's own lowering of the
    same masks; "rbg"/"unsafe_rbg": XLA's RngBitGenerator, other masks) gives a typed key of that
    generator seeded from the folded key's bits; the checkpointed state is the same for all."""
    key = jax.random.fold_in(base_rng, step)
    if impl == "threefry":
        return prng.fused_threefry_key(key)
    if impl == "threefry2x32":
        return jax.random.wrap_key_data(key, impl=impl)
    return jax.random.wrap_key_data(jax.random.bits(key, (4,), jnp.uint32), impl=impl)


def train_step(
    state: TrainState,
    batch: Mapping[str, jax.Array],
    *,
    model: nn.Module,
    mode: str,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    label_smoothing: float,
    grad_accum_steps: int = 1,
    dropout_rng_impl: str = "threefry",
    microbatches: int = 1,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One step on `batch` (pure); with grad_accum_steps = k the optimizer (optax.MultiSteps)
    applies an update every k-th call. The loss is the token-weighted mean over real tokens.
    dropout_rng_impl: the generator of the dropout masks (train.dropout_rng).
    microbatches = m > 1 (train.microbatches) computes the same gradient as m slices of the
    batch in a lax.scan, summing their gradients: activation memory / m, and on CPU faster,
    since a slice's activations stay in cache. Slice i holds rows i, i + m, i + 2m, ... (so each
    device's rows stay on it) and draws its dropout masks from fold_in(step key, i)."""
    dropout_rng = dropout_key(state.rng, state.step, dropout_rng_impl)
    # The mean's denominator is the whole batch's weight, so slices' gradients just add up.
    total_weight = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1.0)
    grads_of = functools.partial(
        _grads_and_sums, total_weight=total_weight, model=model, mode=mode,
        label_smoothing=label_smoothing,
    )
    if microbatches == 1:
        grads, sums = grads_of(state.params, batch, dropout_rng)
    else:
        sliced = jax.tree.map(  # [batch, ...] -> [microbatches, batch // microbatches, ...]
            lambda x: x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(
                0, 1),
            dict(batch),
        )

        def accumulate(grads, inputs):
            microbatch, index = inputs
            slice_grads, slice_sums = grads_of(
                state.params, microbatch, jax.random.fold_in(dropout_rng, index)
            )
            return jax.tree.map(jnp.add, grads, slice_grads), slice_sums

        grads, sums = jax.lax.scan(
            accumulate, jax.tree.map(jnp.zeros_like, state.params),
            (sliced, jnp.arange(microbatches)),
        )
        sums = jax.tree.map(lambda x: jnp.sum(x, axis=0), sums)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    step_metrics = {
        **sums,
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": schedule(state.step // grad_accum_steps),
    }
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), step_metrics


def _grads_and_sums(
    params: Any,
    batch: Mapping[str, jax.Array],  # a batch or a slice of one, every entry [rows, ...]
    dropout_rng: jax.Array,
    *,
    total_weight: jax.Array,  # [] the whole batch's token weight (>= 1)
    model: nn.Module,
    mode: str,
    label_smoothing: float,
) -> tuple[Any, dict[str, jax.Array]]:
    """(gradient of loss_sum / total_weight, the loss sums) of `batch`."""

    def loss_fn(params):
        sums = loss_sums(model, params, batch, batch["weights"], mode=mode, deterministic=False,
                         label_smoothing=label_smoothing, dropout_rng=dropout_rng)
        return sums["loss_sum"] / total_weight, sums

    (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return grads, sums


def step_gradients(
    state: TrainState,
    batch: Mapping[str, jax.Array],
    *,
    model: nn.Module,
    mode: str,
    label_smoothing: float,
    dropout_rng_impl: str = "threefry",
) -> Any:
    """The gradient train_step takes at `state` on `batch`, without updating (diagnostics): the
    whole batch at once, so with train.microbatches > 1 its dropout masks and summation order
    differ."""
    total_weight = jnp.maximum(jnp.sum(batch["weights"].astype(jnp.float32)), 1.0)
    grads, _ = _grads_and_sums(
        state.params, batch, dropout_key(state.rng, state.step, dropout_rng_impl),
        total_weight=total_weight, model=model, mode=mode, label_smoothing=label_smoothing,
    )
    return grads


def jit_diagnostics(experiment: Experiment, shardings: Any) -> Callable | None:
    """`diagnose(state, batch) -> {"diagnostics/...": float}` of the step `state` is about to
    take on `batch` (tfm/training/diagnostics.py), or None when train.diagnostics_every is 0;
    call it before the train step donates `state`."""
    if not experiment.train.diagnostics_every:
        return None
    gradients = functools.partial(
        step_gradients, model=experiment.model, mode=experiment.mode,
        label_smoothing=experiment.train.label_smoothing,
        dropout_rng_impl=experiment.train.dropout_rng,
    )
    return diagnostics.jit_diagnostics(experiment, shardings, gradients)


def jit_steps(experiment: Experiment, shardings: Any) -> tuple[Callable, Callable]:
    """(train_step, eval_step) jit-compiled with explicit shardings, the same code from 1 device
    to N processes: the state as `shardings` (from state_shardings), batches split over the
    "batch" rule's mesh axes (data x fsdp), metrics replicated. The train step donates its
    state. Both also have `.lower(*args)` (e.g. `.lower(...).compile().memory_analysis()`).

    `train(state, batch) -> (state, metrics)`; `eval(params, batch) -> loss sums`.
    """
    mesh = experiment.mesh
    step_fn = functools.partial(
        train_step,
        model=experiment.model,
        mode=experiment.mode,
        optimizer=experiment.optimizer,
        schedule=experiment.schedule,
        label_smoothing=experiment.train.label_smoothing,
        grad_accum_steps=experiment.optimizer_config.grad_accum_steps,
        dropout_rng_impl=experiment.train.dropout_rng,
        microbatches=experiment.train.microbatches,
    )
    jit_train = cpu_compile.jit(
        step_fn,
        cpu_kernels=cpu_compile.resolve_cpu_kernels(
            experiment.train.cpu_kernels, experiment.model_config.compute_dtype
        ),
        in_shardings=(shardings, sharding.batch_sharding(mesh, experiment.rules)),
        out_shardings=(shardings, sharding.replicated(mesh)),
        donate_argnums=(0,),
        platform=experiment.platform,
    )
    return InShardingContext(jit_train, experiment), jit_eval_step(experiment, shardings.params)


def train_and_evaluate(
    config: ml_collections.ConfigDict | ExperimentConfig, workdir: str | Path
) -> dict[str, Any]:
    """Trains `config` in `workdir`, resuming from its latest checkpoint; returns final metrics."""
    sections = config if isinstance(config, ExperimentConfig) else parse_config(config)
    trackers.TRACKERS[sections.train.tracker].check_installed()  # before data and compiling
    experiment = setup(sections, workdir)
    _prepare_host(experiment)
    options = experiment.train
    abstract, shardings = state_shardings(experiment)
    experiment.workdir.mkdir(parents=True, exist_ok=True)
    checkpointer = make_checkpointer(experiment)
    _record_run(experiment, checkpointer)
    train_iter = experiment.data.train_iterator()
    state = _start_state(experiment, checkpointer, abstract, shardings, train_iter)
    jit_train, jit_eval = jit_steps(experiment, shardings)
    batch_sharding = sharding.batch_sharding(experiment.mesh, experiment.rules)
    step = int(state.step)
    log = _Log(experiment, step)
    for line in _start_lines(experiment, checkpointer, step):
        log.say(line)
    jit_train, diagnose, trace = _instrumented(experiment, jit_train, abstract, shardings, log)
    pending: list[dict[str, jax.Array]] = []  # step metrics not yet fetched from the devices

    def save(step: int, state: TrainState, eval_metrics: dict | None, force: bool) -> None:
        checkpointer.save(step, state, config_json=experiment.config_json(),
                          data_state=train_iter, metrics=eval_metrics, force=force)

    # After an error the loop saves `state` (the last completed step); data_position is the
    # iterator state to save with it while a step has taken its batch but not finished.
    data_position = None
    try:
        with _StopRequest() as stop:
            while step < options.num_steps:
                data_position = train_iter.get_state()
                with trace.annotate(step):
                    batch = sharding.shard_batch(
                        next(train_iter), experiment.mesh, batch_sharding, experiment.rules
                    )
                    if diagnose and (step + 1) % options.diagnostics_every == 0:
                        log.writer.write(step + 1, diagnose(state, batch))  # before donation
                    state, step_metrics = jit_train(state, batch)
                data_position = None  # the iterator now matches `state` again
                trace.step_done(step, state)
                pending.append(step_metrics)
                step += 1
                log.bar.update(1)
                is_last = step == options.num_steps
                eval_now = (options.eval_every and step % options.eval_every == 0) or is_last
                save_now = step % options.checkpoint_every == 0 or is_last
                if step % options.log_every == 0 or eval_now or save_now or stop.signal_name:
                    log.train(step, _checked_metrics(pending, step, checkpointer))
                eval_metrics = None
                if eval_now:
                    eval_metrics = evaluate(experiment, state.params, jit_eval)
                    log.eval(step, eval_metrics)
                if stop.signal_name:
                    save(step, state, None, force=True)
                    checkpointer.wait()
                    log.say(f"{stop.signal_name}: saved step {step} and stopped")
                    log.last["stopped_by"] = stop.signal_name
                    break
                if save_now:
                    save(step, state, _best_candidate(options, eval_metrics), force=True)
            checkpointer.wait()
    except Exception as error:
        if not isinstance(error, TrainingError):  # TrainingError: nothing worth saving
            _save_after_error(
                checkpointer, save, step, state, train_iter, data_position, pending, log.say
            )
        raise
    finally:
        trace.stop()
        log.close()
        checkpointer.close()
        if hasattr(train_iter, "close"):  # stops grain's prefetch thread before exit
            train_iter.close()
    return {**log.last, "step": step}


def _instrumented(
    experiment: Experiment, jit_train: Callable, abstract: Any, shardings: Any, log: _Log
) -> tuple[Callable, Callable | None, profiling.StepTrace]:
    """(the train step, logging its compiled memory on its first call; the diagnostics step
    or None when train.diagnostics_every is 0; the profiler's step trace)."""
    options = experiment.train
    trace = profiling.StepTrace(
        experiment.workdir / "profile", options.profile_start, options.profile_steps
    )
    return (profiling.MemoryOnFirstCall(jit_train, abstract, log.say),
            jit_diagnostics(experiment, shardings), trace)


def _prepare_host(experiment: Experiment) -> None:
    """The hint for a run on one of several CPU cores, and CPU memory kept between steps."""
    sharding.log_cpu_devices_hint(experiment.mesh, experiment.data.config.batch_size,
                                  experiment.train.microbatches)
    if experiment.platform == "cpu":  # each step then reuses its temporaries' pages
        cpu_memory.keep_freed_memory()


def _record_run(experiment: Experiment, checkpointer: checkpoint.Checkpointer) -> None:
    """Writes WORKDIR/config.json, after refusing (ConfigMismatchError, one line) a workdir
    whose checkpoints are another run's: other data or another model (workdir.check_resume)."""
    step = checkpointer.latest_step()
    saved = workdir_record.read_config(experiment.workdir)
    if step is not None and saved is None:  # from before config.json, or another host's disk
        try:
            saved = checkpointer.saved_config(step)
        except checkpoint.CheckpointError:
            pass  # restore_newest_readable reports unreadable steps
    if step is not None and saved is not None:
        try:
            workdir_record.check_resume(experiment.workdir, saved,
                                        json.loads(experiment.config_json()))
        except BaseException:
            checkpointer.close()
            raise
    if jax.process_index() == 0:
        workdir_record.write_config(experiment.workdir, experiment.config_json())


def _start_lines(
    experiment: Experiment, checkpointer: checkpoint.Checkpointer, resumed_step: int
) -> list[str]:
    """What the console says before the first step: the step a resumed run continues from (a
    new run starts at 0; checkpoints are of steps >= 1), and a learning-rate schedule that does
    not span the run (or changed since the checkpoint)."""
    lines = []
    if resumed_step > 0:
        changes = optimizer_differences(checkpointer, resumed_step, experiment)
        lines.append(
            f"resumed from step {resumed_step} of {experiment.train.num_steps} (workdir "
            f"{experiment.workdir})" + ("; the optimizer settings changed since that checkpoint: "
                                        + "; ".join(changes) if changes else "")
        )
    note = optim.schedule_length_note(experiment.optimizer_config, experiment.train.num_steps)
    if note:
        lines.append(note)
    return lines


def _start_state(
    experiment: Experiment,
    checkpointer: checkpoint.Checkpointer,
    abstract: TrainState,
    shardings: Any,
    train_iter: Any,
) -> TrainState:
    """The newest readable checkpoint's state (with `train_iter` at its data position), or a
    fresh one; closes `checkpointer` when that fails, leaving no orbax threads behind."""
    try:
        if checkpointer.latest_step() is not None:
            return restore_newest_readable(experiment, checkpointer, abstract, train_iter)
        return init_state(experiment, shardings)
    except BaseException:
        checkpointer.close()
        raise


def _best_candidate(options: TrainConfig, eval_metrics: dict | None) -> dict | None:
    """The metrics a checkpoint competes for "best" with: only evaluated steps compete."""
    keep = options.keep_best_metric
    if keep and (eval_metrics is None or keep not in eval_metrics):
        return None
    return eval_metrics


def _checked_metrics(
    pending: list[dict[str, jax.Array]], step: int, checkpointer: checkpoint.Checkpointer
) -> dict[str, float]:
    """The host metrics of the pending steps (then cleared); TrainingError if any step's loss
    or gradients went non-finite (nothing is saved: the last good checkpoint stays)."""
    logged = _host_metrics(pending)
    first_step = step - len(pending) + 1
    pending.clear()
    if logged["nonfinite_steps"] or not math.isfinite(logged["train_loss"]):
        checkpointer.wait()
        raise TrainingError(
            f"non-finite loss or gradients in {logged['nonfinite_steps']} of steps "
            f"{first_step}-{step} (train_loss {logged['train_loss']}); stopped at step "
            f"{step} without saving. The last good checkpoint is step "
            f"{checkpointer.latest_step()} in {checkpointer.directory}; lower the learning "
            "rate, enable grad_clip_norm, or use float32"
        )
    return logged


class _Log:
    """The loop's outputs: metrics.jsonl and the tracker (train.tracker), a progress bar and
    console lines (on process 0), throughput and MFU since the last log, and the latest value
    of every metric."""

    def __init__(self, experiment: Experiment, start_step: int) -> None:
        data_config, process_zero = experiment.data.config, jax.process_index() == 0
        self.tokens_per_batch = data_config.batch_size * data_config.seq_len
        self.flops_per_token = flops.flops_per_token(
            experiment.model_config, data_config.seq_len, experiment.mode,
            experiment.data.train_lengths.get("source"),
        )
        self.peak = hardware.device_peak_flops(
            jax.devices()[0], experiment.model_config.compute_dtype
        )
        self.writer = metrics.MetricWriter(
            experiment.workdir, jax.process_index(), resume_step=start_step,
            tracker=experiment.train.tracker, run=experiment.train.tracker_run,
        )
        self.writer.write_config(json.loads(experiment.config_json()))
        self.bar = metrics.progress_bar(
            experiment.train.num_steps, initial_step=start_step,
            enabled=experiment.train.progress_bar and process_zero,
        )
        # One console, not one per process.
        self.say: Callable[[str], None] = self.bar.write if process_zero else (lambda line: None)
        self.last: dict[str, Any] = {}
        self.last_time, self.last_step = time.perf_counter(), start_step

    def train(self, step: int, logged: dict[str, float]) -> None:
        elapsed = time.perf_counter() - self.last_time
        steps_done = step - self.last_step
        logged["steps_per_second"] = steps_done / elapsed
        logged["tokens_per_second"] = steps_done * self.tokens_per_batch / elapsed
        if self.peak:
            logged["mfu"] = flops.mfu(
                logged["tokens_per_second"], self.flops_per_token, jax.device_count(), self.peak
            )
        self.writer.write(step, logged)
        self.bar.set_postfix(loss=f"{logged['train_loss']:.4f}")
        self.last_time, self.last_step = time.perf_counter(), step
        self.last.update(logged)

    def eval(self, step: int, eval_metrics: dict[str, float]) -> None:
        self.writer.write(step, eval_metrics)
        self.last.update(eval_metrics)
        self.say(
            f"step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(eval_metrics.items()))
        )

    def close(self) -> None:
        self.bar.close()
        self.writer.close()


class _StopRequest:
    """Turns SIGTERM/SIGINT into a flag the loop checks between steps (then saves and exits)."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopRequest:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name

    def __exit__(self, *exc: Any) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)


def _save_after_error(
    checkpointer: checkpoint.Checkpointer,
    save: Callable[..., None],
    step: int,
    state: TrainState,
    train_iter: Any,
    data_position: Any,
    pending: list[dict[str, jax.Array]],
    say: Callable[[str], None],
) -> None:
    """After an exception in the loop, saves the last completed step (as SIGTERM does) unless it
    is saved already or its unchecked steps went non-finite; a failing save never hides the
    original error. `data_position`: the iterator state before a batch the step did not use."""
    try:
        checkpointer.wait()
    except Exception:  # a failed background save: the original error matters more
        pass
    if step in checkpointer.all_steps():
        return
    try:
        if pending and _host_metrics(pending)["nonfinite_steps"]:
            say(f"not saving step {step} after the error below: its loss is not finite")
            return
        if data_position is not None:
            train_iter.set_state(data_position)
        save(step, state, None, force=True)
        checkpointer.wait()
        say(f"saved step {step} in {checkpointer.directory} before stopping on the error below")
    except Exception as save_error:
        first_line = (str(save_error).splitlines() or [""])[0][:200]
        say(f"could not save step {step} after the error below "
            f"({type(save_error).__name__}: {first_line})")


def _host_metrics(pending: list[dict[str, jax.Array]]) -> dict[str, float]:
    """Sums the per-step loss sums of the steps since the last log; means the rest."""
    fetched = jax.device_get(pending)
    summed = {
        key: sum(float(m[key]) for m in fetched) for key in fetched[0] if key.endswith("_sum")
    }
    means = losses.weighted_metrics(summed)
    out = {f"train_{key}": float(value) for key, value in means.items()}
    out["grad_norm"] = float(np.mean([m["grad_norm"] for m in fetched]))
    out["learning_rate"] = float(fetched[-1]["learning_rate"])
    out["train_tokens"] = summed["weight_sum"]
    # A finite loss with non-finite gradients still poisons the params: count both.
    out["nonfinite_steps"] = sum(
        not (math.isfinite(float(m["loss_sum"])) and math.isfinite(float(m["grad_norm"])))
        for m in fetched
    )
    return out
