"""Checkpoints: a thin wrapper over orbax's CheckpointManager, and checkpoint averaging.

Each step directory `{directory}/{step}/` holds the items `state` (the train-state pytree),
`config` (the experiment config as JSON), optionally `data` (the grain iterator state) and
`metrics`. Orbax writes a step into a temporary directory and renames it only once every item
is complete, so a crash mid-save leaves the earlier checkpoints untouched and no half-written
step is ever listed; `save` never overwrites an existing step, and old steps are deleted only
after a newer save has finished.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from orbax.checkpoint import checkpoint_managers

from tfm.checks import ConfigError
from tfm.logs import silence_absl_message

# Steps saved without metrics (the forced saves of unevaluated steps, SIGTERM) are meant not to
# compete for the best step; orbax warns about each one inside the progress bar.
silence_absl_message("Requested `tracked_metric`; did not provide metrics")


class CheckpointError(RuntimeError):
    """A checkpoint exists but cannot be read (corrupt, incomplete, or not ours). `step` is the
    unreadable step (None when the error covers several) and `reason` its cause in one line."""

    def __init__(self, message: str, *, step: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.step = step
        self.reason = reason


def first_line(error: BaseException, limit: int = 300) -> str:
    """The first line of an error message, at most `limit` characters: tensorstore puts its whole
    JSON spec (some 60 lines) into its messages."""
    line = (str(error).strip().splitlines() or [""])[0].strip()
    return line if len(line) <= limit else line[: limit - 3] + "..."


def read_failure(error: BaseException, limit: int = 240) -> str:
    """'Type: first line' of the innermost cause of a failed read: orbax wraps tensorstore's
    error (e.g. 'ValueError: OUT_OF_RANGE: Error reading "params/w/0.0" ...') in one whose first
    line names only an array index."""
    while error.__cause__ is not None:
        error = error.__cause__
    # The step folder is named by the caller; tensorstore repeats it in every message.
    line = re.sub(r' in OCDBT database at local file "[^"]*"', "", first_line(error, 10 * limit))
    return f"{type(error).__name__}: {first_line(Exception(line), limit)}"


def no_readable_step_error(directory: Any, failures: Sequence[CheckpointError]) -> CheckpointError:
    """The one-line error for a run none of whose checkpoints (in `directory`, a run's
    workdir/checkpoints) restores: each step tried with its reason, and what to do (nothing was
    moved or deleted)."""
    directory = Path(os.fspath(directory))
    tried = "; ".join(f"step {error.step} ({error.reason})" for error in failures)
    folders = ", ".join(str(directory / str(error.step)) for error in failures)
    return CheckpointError(
        f"no checkpoint in {directory} could be read (corrupt or incomplete?); tried {tried}. "
        f"Nothing was moved or deleted. To start over, train with another --workdir (or move "
        f"{directory.parent} aside), or move these step folders elsewhere: {folders}"
    )


def _is_abandoned_orbax_read(unraisable: Any) -> bool:
    """An orbax read coroutine left suspended by a failed restore, closed when garbage
    collected: its `except BaseException` turns the GeneratorExit of close() into an Exception
    carrying tensorstore's whole spec (some 60 lines), which Python reports as
    "Exception ignored in: <coroutine object _read_array_index_and_device_put ...>"."""
    code = getattr(getattr(unraisable, "object", None), "cr_code", None)
    error = unraisable.exc_value
    return (
        code is not None
        and f"{os.sep}orbax{os.sep}" in code.co_filename
        and isinstance(getattr(error, "__cause__", None), GeneratorExit)
    )


def _ignore_reads_finishing_after_a_failure() -> None:
    """After a failed restore, orbax closes its event loop while tensorstore's other reads are
    still in flight; each then reports "RuntimeError: Event loop is closed", or, once collected,
    an abandoned read coroutine's error (see _is_abandoned_orbax_read), through
    sys.unraisablehook: a traceback apiece, some 1,300 lines on the console for one truncated
    file. They are harmless (the restore has already failed with the first error): drop just
    those. Installed before each restore, since the collection may come at any later time."""
    previous = sys.unraisablehook
    if getattr(previous, "tfm_ignores_closed_loop", False):
        return

    def hook(unraisable: Any) -> None:
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        if _is_abandoned_orbax_read(unraisable):
            return
        previous(unraisable)

    hook.tfm_ignores_closed_loop = True
    sys.unraisablehook = hook
    # The same abandoned reads' futures, collected with their error unretrieved, reach asyncio's
    # exception handler instead ("_GatheringFuture exception was never retrieved", the whole
    # spec again), logged through the "asyncio" logger: drop those records too.
    logging.getLogger("asyncio").addFilter(_drop_abandoned_orbax_futures)


def _drop_abandoned_orbax_futures(record: logging.LogRecord) -> bool:
    """False (drop) for asyncio's report of a failed orbax read's future nobody awaited: its
    message names tensorstore's spec, or (a read past a truncated file's end) the OCDBT
    database it read."""
    message = record.getMessage()
    return not ("exception was never retrieved" in message
                and any(mark in message for mark in ("TensorStore", "OCDBT database")))


def _flatten(tree: Any, prefix: str) -> dict[str, Any]:
    if isinstance(tree, Mapping):
        flat = {}
        for key, value in tree.items():
            flat.update(_flatten(value, f"{prefix}.{key}"))
        return flat
    return {prefix: tree}


class ConfigMismatchError(ValueError):
    """A checkpoint was saved with another model config; the message lists each differing field."""


def _model_field_defaults() -> dict[str, Any]:
    from tfm.nn.config import ModelConfig

    return {f"model.{f.name}": _as_json(f.default) for f in dataclasses.fields(ModelConfig)}


def _as_json(value: Any) -> Any:
    """`value` as config.json holds it (tuples as lists), so both sides compare alike."""
    return json.loads(json.dumps(value))


# Model fields a restored run may change: they choose an implementation, not the parameters
# (remat also was a bool before it named a policy; "auto" backends resolve per platform, so a
# run saved on a TPU restores on a CPU).
IMPLEMENTATION_ONLY = ("model.attention_backend", "model.matmul", "model.cache_layout",
                       "model.remat", "model.loss_backend")
# Model fields evaluation and generation may change on trained parameters (a context-extension
# study evaluates one RoPE model under each scaling, zero-shot): how positions are scaled, not
# what was learned. A training run resuming with one of them changed is still refused.
EVAL_TIME = ("model.rope_scaling", "model.rope_scaling_factor", "model.rope_original_max_len",
             "model.rope_low_freq_factor", "model.rope_high_freq_factor", "model.rope_beta_fast",
             "model.rope_beta_slow", "model.rope_mscale", "model.rope_mscale_all_dim",
             "model.rope_truncate", "model.rope_attention_factor", "model.rope_short_factor",
             "model.rope_long_factor", "model.attention_log_length")


def model_differences(saved: Mapping[str, Any], current: Mapping[str, Any],
                      may_differ: tuple[str, ...] = ()) -> list[str]:
    """'model.FIELD: saved X, current Y' for every field under "model" whose saved and current
    values differ, IMPLEMENTATION_ONLY and `may_differ` aside. A field one side lacks (a
    checkpoint from before the field existed) counts as its default."""
    old = _flatten(saved.get("model", {}), "model")
    new = _flatten(current.get("model", {}), "model")
    for key in (*IMPLEMENTATION_ONLY, *may_differ):
        old.pop(key, None)
        new.pop(key, None)
    missing = "<absent>"
    defaults = _model_field_defaults()
    value = lambda side, key: _as_json(side.get(key, defaults.get(key, missing)))
    return [
        f"{key}: saved {value(old, key)!r}, current {value(new, key)!r}"
        for key in sorted(set(old) | set(new))
        if value(old, key) != value(new, key)
    ]


def check_model_config(saved: Mapping[str, Any], current: Mapping[str, Any], where: str,
                       may_differ: tuple[str, ...] = ()) -> None:
    """Raises ConfigMismatchError (a ValueError) listing every model field that differs (see
    `model_differences`; other sections, e.g. the learning rate, may change between runs)."""
    diffs = model_differences(saved, current, may_differ)
    if diffs:
        raise ConfigMismatchError(
            f"checkpoint {where} was saved with a different model config; differing fields:\n"
            + "\n".join(f"  {line}" for line in diffs)
        )


class Checkpointer:
    """Saves and restores train states (plus config, data-iterator state and metrics).

    Keeps the newest `max_to_keep` steps (None = all) and, with `keep_best_metric`, also the
    single best step by that metric (`best_mode` "min" or "max") among those saved with metrics.
    `save` is a no-op returning False unless step % save_interval_steps == 0 (or `force`); the
    very first save of an empty directory always happens (orbax's initial-save rule). Create
    one on every process in a multi-host run; orbax coordinates the writes.
    """

    def __init__(
        self,
        directory: str | Path,
        *,
        max_to_keep: int | None = 5,
        keep_best_metric: str | None = None,
        best_mode: str = "min",
        save_interval_steps: int = 1,
        async_save: bool = True,
    ) -> None:
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ConfigError(f"max_to_keep={max_to_keep!r} must be None (keep all) or >= 1")
        if best_mode not in ("min", "max"):
            raise ConfigError(f"best_mode={best_mode!r} is unknown; choose one of: min, max")
        if not isinstance(save_interval_steps, int) or save_interval_steps < 1:
            raise ConfigError(f"save_interval_steps={save_interval_steps!r} must be >= 1")
        directory = str(directory)  # local or a cloud path such as gs://bucket/run
        self.directory = epath.Path(directory if "://" in directory else os.path.abspath(directory))
        self.keep_best_metric = keep_best_metric
        best_fn = None
        policy = checkpoint_managers.LatestN(n=max_to_keep)
        if keep_best_metric is not None:
            best_fn = lambda metrics: metrics[keep_best_metric]
            best = checkpoint_managers.BestN(
                get_metric_fn=best_fn,
                reverse=best_mode == "min",  # BestN keeps the end of the sorted list
                n=1,
                keep_checkpoints_without_metrics=False,
            )
            policy = checkpoint_managers.AnyPreservationPolicy([policy, best])
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_interval_steps,
            best_fn=best_fn,  # makes orbax store metrics and answer best_step()
            best_mode=best_mode,
            preservation_policy=policy,
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)

    def save(
        self,
        step: int,
        state: Any,
        *,
        config_json: str,
        data_state: Any = None,
        metrics: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Starts saving `state` (any pytree of arrays) at `step`; returns whether it saves.

        config_json: the experiment config as a JSON object string (model under "model").
        data_state: a grain DatasetIterator, whose position is saved with the state.
        metrics: scalars for `keep_best_metric` (e.g. {"eval_loss": 2.1}).
        With async_save the write continues in the background: the arrays are copied first, so
        the caller may donate or update `state` (and advance the iterator) right away.
        """
        if step in self.all_steps():
            return False
        items = {
            "state": ocp.args.StandardSave(state),
            "config": ocp.args.JsonSave(json.loads(config_json)),
        }
        if data_state is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_state)
        if metrics is not None:
            metrics = {name: float(np.asarray(value)) for name, value in metrics.items()}
            if self.keep_best_metric is not None and self.keep_best_metric not in metrics:
                raise ValueError(
                    f"metrics {sorted(metrics)} lack keep_best_metric={self.keep_best_metric!r}"
                )
        return self._manager.save(
            step, args=ocp.args.Composite(**items), metrics=metrics, force=force
        )

    def _step_path(self, step: int | None) -> tuple[int, epath.Path]:
        self.wait()
        steps = self.all_steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no checkpoint found in {self.directory}")
            step = steps[-1]
        elif step not in steps:
            raise FileNotFoundError(
                f"no checkpoint for step {step} in {self.directory}; available steps: {steps}"
            )
        return step, self.directory / str(step)

    def _restore(self, step: int, path: epath.Path, items: dict[str, Any]) -> Any:
        _ignore_reads_finishing_after_a_failure()
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as error:  # orbax/tensorstore raise many kinds; name the place
            reason = read_failure(error)
            raise CheckpointError(
                f"checkpoint {path} could not be read (corrupt or incomplete?): {reason}. "
                f"Other saved steps (not checked) in {self.directory}: "
                f"{[s for s in self.all_steps() if s != step]}",
                step=step, reason=reason,
            ) from error

    def set_aside(self, step: int) -> Path:
        """Moves the unreadable step directory out of the checkpoint directory (never deletes
        it) to `{directory}_corrupt/{step}[.N]`, so training can go on from an older step and
        save `step` again. Returns the new place. Call it on one process only."""
        self.wait()
        source = Path(os.fspath(self.directory / str(step)))
        target_dir = Path(os.fspath(self.directory)).with_name(self.directory.name + "_corrupt")
        target_dir.mkdir(parents=True, exist_ok=True)
        target, index = target_dir / str(step), 1
        while target.exists():
            target, index = target_dir / f"{step}.{index}", index + 1
        source.rename(target)
        self.reload()
        return target

    def reload(self) -> None:
        """Re-reads the step list from disk (after another process moved a step)."""
        self._manager.reload()

    def saved_config(self, step: int | None = None) -> dict[str, Any]:
        """The experiment config stored with `step` (default: the latest)."""
        step, path = self._step_path(step)
        return self._restore(step, path, {"config": ocp.args.JsonRestore()})["config"]

    def restore(
        self,
        step: int | None = None,
        *,
        abstract_state: Any = None,
        data_iterator: Any = None,
        config_json: str | None = None,
        may_differ: tuple[str, ...] = (),
    ) -> Any:
        """Returns the state saved at `step` (default: the latest).

        abstract_state: a pytree of jax.ShapeDtypeStruct whose `sharding`s place the restored
        arrays (resharding as needed); None restores arrays as saved. data_iterator: a grain
        iterator set in place to the saved position. config_json: the current experiment
        config; if given, any difference under "model" (but the `may_differ` fields) raises a
        ValueError naming each field. Raises FileNotFoundError if the step does not exist,
        CheckpointError if it is unreadable.
        """
        step, path = self._step_path(step)
        if config_json is not None:
            check_model_config(self.saved_config(step), json.loads(config_json), str(path),
                               may_differ)
        items = {"state": ocp.args.StandardRestore(abstract_state)}
        if data_iterator is not None:
            if not (path / "data").exists():
                raise ValueError(f"checkpoint {path} holds no data-iterator state")
            items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
        return self._restore(step, path, items)["state"]

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def best_step(self) -> int | None:
        """The best step by keep_best_metric (the latest step without one)."""
        return self._manager.best_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def wait(self) -> None:
        """Blocks until background saves have finished (and old steps are deleted)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _average_steps(checkpointer: Checkpointer, steps: Sequence[int] | None, last_k: int) -> list:
    available = checkpointer.all_steps()
    if steps is None:
        if last_k < 1 or not available:
            raise ValueError(f"last_k={last_k} needs >= 1 checkpoint in {checkpointer.directory}")
        return available[-last_k:]
    missing = sorted(set(steps) - set(available))
    if missing or not steps:
        raise FileNotFoundError(
            f"steps {missing or steps} not in {checkpointer.directory}; available: {available}"
        )
    return sorted(steps)


def average_checkpoints(
    directory: str | Path,
    abstract_state: Any = None,
    *,
    steps: Sequence[int] | None = None,
    last_k: int = 5,
) -> tuple[Any, list[int]]:
    """Averages the checkpoints `steps` (default: the newest `last_k`; the paper averages the
    last 5 (base) or 20 (big), Vaswani et al. 2017 sec. 6.1). Every floating-point leaf is
    averaged (params, and optimizer moments so the tree stays restorable), accumulated in
    float32; integer leaves (step counters) come from the newest step. Returns (state, steps):
    take the params from the averaged state."""
    with Checkpointer(directory, max_to_keep=None, async_save=False) as checkpointer:
        chosen = _average_steps(checkpointer, steps, last_k)
        total = None
        for step in chosen:
            state = checkpointer.restore(step, abstract_state=abstract_state)
            as_f32 = jax.tree.map(
                lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                state,
            )
            total = as_f32 if total is None else jax.tree.map(
                lambda acc, x: acc + x if jnp.issubdtype(x.dtype, jnp.floating) else x,
                total, as_f32,
            )
        averaged = jax.tree.map(
            lambda acc, ref: (acc / len(chosen)).astype(ref.dtype)
            if jnp.issubdtype(ref.dtype, jnp.floating) else acc,
            total, state,
        )
    return averaged, chosen


def write_averaged_checkpoint(
    directory: str | Path,
    output_directory: str | Path,
    abstract_state: Any = None,
    *,
    steps: Sequence[int] | None = None,
    last_k: int = 5,
) -> int:
    """Averages checkpoints (see `average_checkpoints`) and saves the result in
    `output_directory` under the newest averaged step, with that step's config plus an
    "averaged_steps" entry. Returns the step written."""
    averaged, chosen = average_checkpoints(directory, abstract_state, steps=steps, last_k=last_k)
    with Checkpointer(directory, max_to_keep=None, async_save=False) as source:
        config = source.saved_config(chosen[-1])
    config["averaged_steps"] = chosen
    with Checkpointer(output_directory, max_to_keep=None, async_save=False) as target:
        if chosen[-1] in target.all_steps():
            raise FileExistsError(f"{output_directory} already holds step {chosen[-1]}")
        target.save(chosen[-1], averaged, config_json=json.dumps(config), force=True)
        target.wait()
    return chosen[-1]
