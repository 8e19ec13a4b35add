"""The train state: its fresh start (sharded by the logical annotations, optionally with a
pretrained model's parameters), and its restore from checkpoints (the newest readable step,
or a step's parameters for `eval` and `generate`), with the run's checkpointer.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.experimental import multihost_utils

from tfm.checks import ConfigError
from tfm.kernels import cpu_compile
from tfm.parallel import sharding
from tfm.training import checkpoint, optim

# tfm.training.experiment.Experiment: that module builds on this one (and re-exports it), so
# this one names the type without importing it.
Experiment = Any

logger = logging.getLogger("tfm.training.train")  # the training system's one log name


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, incompatible checkpoint); nothing was overwritten."""


@struct.dataclass
class TrainState:
    """Everything a resumed run needs besides the data position: step, params, optimizer state
    and the base RNG key (dropout keys are derived from (key, step), so resuming is exact)."""

    step: jax.Array  # [] int32
    params: Any
    opt_state: Any
    rng: jax.Array  # [2] uint32 base key


def _dummy_batch(experiment: Experiment) -> dict[str, np.ndarray]:
    lengths = experiment.data.train_lengths
    batch = experiment.data.config.batch_size
    shapes = {key: (batch, length) for key, length in lengths.items()}
    return {key: np.zeros(shape, np.int32) for key, shape in shapes.items()}


def _init_fn(experiment: Experiment) -> Callable[[jax.Array], TrainState]:
    model, family = experiment.model, experiment.family
    dummy = {key: jnp.asarray(value[:1]) for key, value in _dummy_batch(experiment).items()}

    def init(rng: jax.Array) -> TrainState:
        params_rng, dropout_rng = jax.random.split(rng)
        params = family.init(model, params_rng, dummy)
        opt_state = experiment.optimizer.init(params)
        return TrainState(jnp.zeros((), jnp.int32), params, opt_state, dropout_rng)

    return init


def state_shardings(experiment: Experiment) -> tuple[Any, Any]:
    """(abstract unboxed state with shardings, sharding tree) from logical annotations."""
    init = _init_fn(experiment)
    rng = jax.random.PRNGKey(experiment.train.seed)
    with sharding.sharding_context(experiment.mesh, experiment.rules):  # the mesh's platform
        boxed = jax.eval_shape(init, rng)
    shardings = sharding.param_shardings(boxed, experiment.mesh, experiment.rules)
    abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        nn.meta.unbox(boxed),
        shardings,
    )
    return abstract, shardings


def init_state(experiment: Experiment, shardings: Any) -> TrainState:
    init = _init_fn(experiment)
    rng = jax.random.PRNGKey(experiment.train.seed)
    with sharding.sharding_context(experiment.mesh, experiment.rules):
        state = cpu_compile.jit_once(lambda r: nn.meta.unbox(init(r)),
                                     out_shardings=shardings)(rng)
    if experiment.pretrained is not None:
        state = _with_pretrained_params(experiment, state, shardings)
    if experiment.init_checkpoint is not None:
        state = _with_checkpoint_params(experiment, state, shardings)
    return state


def _with_checkpoint_params(experiment: Experiment, state: TrainState, shardings: Any):
    """`state` with the params of init.checkpoint's step (its model checked against this run's,
    the checkpoint.EVAL_TIME fields aside) and a fresh optimizer state for them."""
    folder, step = experiment.init_checkpoint
    abstract, _ = state_shardings(experiment)
    with checkpoint.Checkpointer(Path(folder) / "checkpoints") as checkpointer:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise ConfigError(f"init.checkpoint={folder!r} holds no checkpoint yet")
        try:
            saved = checkpointer.restore(step, abstract_state=abstract,
                                         config_json=experiment.config_json(),
                                         may_differ=checkpoint.EVAL_TIME)
        except (ValueError, FileNotFoundError) as error:
            reason = " ".join(str(error).split())  # one line
            raise ConfigError(f"init.checkpoint={folder!r} step {step}: {reason}") from None
    opt_state = jax.jit(experiment.optimizer.init,
                        out_shardings=shardings.opt_state)(saved.params)
    return TrainState(state.step, saved.params, opt_state, state.rng)



def _with_pretrained_params(experiment: Experiment, state: TrainState, shardings: Any):
    """`state` with the pretrained folder's parameters (placed by `shardings`, on any mesh and
    any number of processes) and a fresh optimizer state for them."""
    from tfm.interop import hf
    from tfm.nn.models import stack_layer_params

    _, params = hf.load_pretrained(experiment.pretrained)
    if experiment.model_config.scan_layers:
        params = stack_layer_params(params)
    want = jax.tree.structure(state.params)
    if jax.tree.structure(params) != want:
        raise ConfigError(
            f"init.pretrained={experiment.pretrained!r}: its parameters do not fit the model "
            "built from its config (a bug in tfm.interop.hf)"
        )

    def place(value: np.ndarray, like: jax.Array, where: Any) -> jax.Array:
        value = np.asarray(value, like.dtype)
        if value.shape != like.shape:
            raise ConfigError(
                f"init.pretrained: a parameter has shape {value.shape}, the model wants "
                f"{like.shape}"
            )
        return jax.make_array_from_callback(value.shape, where, lambda index: value[index])

    params = jax.tree.map(place, params, state.params, shardings.params)
    opt_state = jax.jit(experiment.optimizer.init, out_shardings=shardings.opt_state)(params)
    return TrainState(state.step, params, opt_state, state.rng)


class InShardingContext:
    """A jitted function that is called (and lowered) inside sharding.sharding_context, so the
    activation constraints (sharding.constrain) in the model see the mesh and rules when traced."""

    def __init__(self, jitted: Any, experiment: Experiment) -> None:
        self.jitted, self.mesh, self.rules = jitted, experiment.mesh, experiment.rules

    def __call__(self, *args: Any) -> Any:
        with sharding.sharding_context(self.mesh, self.rules):
            return self.jitted(*args)

    def lower(self, *args: Any) -> Any:
        with sharding.sharding_context(self.mesh, self.rules):
            return self.jitted.lower(*args)


def _data_state_fits(checkpointer: checkpoint.Checkpointer, step: int) -> bool:
    """False when `step` holds data-iterator states, but none for this process layout (grain
    writes data/process_{index}-of-{count}.json per process): saved by another process count."""
    data_dir = checkpointer.directory / str(step) / "data"
    name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    return not data_dir.exists() or (data_dir / name).exists()


def optimizer_differences(
    checkpointer: checkpoint.Checkpointer, step: int, experiment: Experiment
) -> list[str]:
    """'optimizer.FIELD: saved X, current Y' for every optimizer field (defaults filled in)
    that differs between checkpoint `step` and the current config."""
    try:
        saved = optim.resolve_optimizer_config(checkpointer.saved_config(step)["optimizer"])
    except (checkpoint.CheckpointError, KeyError, ConfigError):
        return []
    current = dataclasses.asdict(experiment.optimizer_config)
    return [
        f"optimizer.{key}: saved {saved.get(key)!r}, current {current.get(key)!r}"
        for key in sorted(set(saved) | set(current))
        if saved.get(key) != current.get(key)
    ]


def _restore_state(
    experiment: Experiment,
    checkpointer: checkpoint.Checkpointer,
    step: int,
    abstract: Any,
    train_iter: Any,
) -> TrainState:
    # Arrays restore onto this run's mesh whatever mesh or process count saved them; the data
    # position (one grain state per process) only when the process count is the same.
    same_layout = _data_state_fits(checkpointer, step)
    if not same_layout:
        logger.warning(
            "checkpoint step %d was saved by a different number of processes; its data "
            "position cannot be split over %d process(es), so the training data restarts "
            "from the beginning of its (seeded) order", step, jax.process_count()
        )
    try:
        return checkpointer.restore(
            step,
            abstract_state=abstract,
            data_iterator=train_iter if same_layout else None,
            config_json=experiment.config_json(),
        )
    except checkpoint.CheckpointError as error:
        differences = optimizer_differences(checkpointer, step, experiment)
        if not differences:
            raise
        raise TrainingError(
            f"checkpoint {checkpointer.directory / str(step)} holds an optimizer state "
            f"this config cannot restore; the optimizer config differs: "
            f"{'; '.join(differences)}. Resume with the saved optimizer settings or start "
            "a new workdir"
        ) from error


def restore_newest_readable(
    experiment: Experiment, checkpointer: checkpoint.Checkpointer, abstract: Any, train_iter: Any
) -> TrainState:
    """The newest checkpoint that restores. Unreadable newer steps (a crash of the disk, a
    truncated file) are moved aside, never deleted, with a warning naming each; if no step
    restores, one CheckpointError lists every step tried and nothing is moved."""
    steps = sorted(checkpointer.all_steps(), reverse=True)
    errors: list[tuple[int, checkpoint.CheckpointError]] = []
    for step in steps:
        try:
            state = _restore_state(experiment, checkpointer, step, abstract, train_iter)
        except checkpoint.CheckpointError as error:
            errors.append((step, error))
            continue
        for bad_step, error in errors:
            if jax.process_index() == 0:
                moved = checkpointer.set_aside(bad_step)
                logger.warning(
                    "checkpoint step %d could not be read (%s); training resumes from step "
                    "%d, and step %d was moved to %s", bad_step, error.reason, step, bad_step,
                    moved,
                )
        if errors and jax.process_count() > 1:
            multihost_utils.sync_global_devices("tfm.training.train: unreadable checkpoints moved")
            checkpointer.reload()
        return state
    raise checkpoint.no_readable_step_error(checkpointer.directory, [e for _, e in errors])


def make_checkpointer(experiment: Experiment) -> checkpoint.Checkpointer:
    options = experiment.train
    return checkpoint.Checkpointer(
        experiment.workdir / "checkpoints",
        max_to_keep=options.max_to_keep,
        keep_best_metric=options.keep_best_metric,
        best_mode=options.best_mode,
        save_interval_steps=1,
        async_save=options.async_checkpoints,
    )


def restore_params(experiment: Experiment, step: int | None = None) -> tuple[Any, int]:
    """Params of the latest (or given) checkpoint, checked against the current model config
    (the position-scaling fields of checkpoint.EVAL_TIME may differ: evaluation may extend the
    context of a trained model)."""
    abstract, _ = state_shardings(experiment)
    with make_checkpointer(experiment) as checkpointer:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(
                f"no checkpoint in {experiment.workdir / 'checkpoints'}; train first with "
                "./launch.sh train"
            )
        state = checkpointer.restore(
            step, abstract_state=abstract, config_json=experiment.config_json(),
            may_differ=checkpoint.EVAL_TIME,
        )
    return state.params, step
