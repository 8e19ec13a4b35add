"""Learning-rate schedules and the optimizer, built from the `optimizer` config section.

Step convention: every schedule here takes optax's update count (0 for the first update) and
evaluates the formula at `step = count + 1`, so the first update uses step 1 (the paper's
formula is undefined at step 0) and warmup peaks at `step == warmup_steps`, i.e. count
`warmup_steps - 1`. With gradient accumulation the schedule counts optimizer updates, not
micro-batches.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import optax

from tfm.checks import ConfigError, section_dict

OPTIMIZERS = ("adam_paper", "adam", "adamw")
SCHEDULES = ("paper", "cosine", "rsqrt", "constant")

# None means "the optimizer's own default" (see `resolve_optimizer_config`).
DEFAULTS: dict[str, Any] = {
    "name": "adam_paper",
    "schedule": None,  # adam_paper: "paper"; adam/adamw: "cosine"
    "learning_rate": None,  # peak rate; for "paper" a multiplier of the formula (default 1.0)
    "warmup_steps": 4000,
    # The cosine schedule's length in optimizer updates. None: the run's length, i.e.
    # train.num_steps / grad_accum_steps (so raising train.num_steps stretches the schedule);
    # set it to end the decay elsewhere.
    "total_steps": None,
    "end_fraction": 0.0,  # cosine: final rate = end_fraction * peak
    "b1": None,  # adam_paper: 0.9; adam/adamw: 0.9
    "b2": None,  # adam_paper: 0.98; adam/adamw: 0.999
    "eps": None,  # adam_paper: 1e-9; adam/adamw: 1e-8
    "weight_decay": 0.0,  # decoupled (AdamW); only with name="adamw"
    "grad_clip_norm": 0.0,  # 0 = no clipping
    "grad_accum_steps": 1,  # 1 = no accumulation (optax.MultiSteps otherwise)
}
_NAME_DEFAULTS = {
    "adam_paper": {"schedule": "paper", "b1": 0.9, "b2": 0.98, "eps": 1e-9},
    "adam": {"schedule": "cosine", "b1": 0.9, "b2": 0.999, "eps": 1e-8},
    "adamw": {"schedule": "cosine", "b1": 0.9, "b2": 0.999, "eps": 1e-8},
}
# Leaves with these names (or of rank <= 1) get no weight decay: biases and norm scales.
_NO_DECAY_NAMES = ("bias", "scale")


def _step(count: jax.Array) -> jax.Array:
    return jnp.asarray(count, jnp.float32) + 1.0


def paper_schedule(
    d_model: int, warmup_steps: int = 4000, multiplier: float = 1.0
) -> optax.Schedule:
    """lrate = multiplier * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5), step = count + 1
    (Vaswani et al. 2017, eq. 3)."""

    def schedule(count: jax.Array) -> jax.Array:
        step = _step(count)
        return multiplier * d_model**-0.5 * jnp.minimum(step**-0.5, step * warmup_steps**-1.5)

    return schedule


def linear_warmup(peak: float, warmup_steps: int) -> optax.Schedule:
    """peak * min(1, step / warmup_steps); constant `peak` when warmup_steps == 0."""

    def schedule(count: jax.Array) -> jax.Array:
        if warmup_steps == 0:
            return jnp.full((), peak, jnp.float32)
        return peak * jnp.minimum(1.0, _step(count) / warmup_steps)

    return schedule


def constant(value: float) -> optax.Schedule:
    """A constant rate (no warmup)."""
    return linear_warmup(value, 0)


def warmup_cosine(
    peak: float, warmup_steps: int, total_steps: int, end_fraction: float = 0.0
) -> optax.Schedule:
    """Linear warmup to `peak` at step warmup_steps, then half a cosine down to
    end_fraction * peak at step total_steps, constant after."""
    warm = linear_warmup(peak, warmup_steps)

    def schedule(count: jax.Array) -> jax.Array:
        progress = (_step(count) - warmup_steps) / max(total_steps - warmup_steps, 1)
        cosine = 0.5 * (1.0 + jnp.cos(math.pi * jnp.clip(progress, 0.0, 1.0)))
        decayed = peak * (end_fraction + (1.0 - end_fraction) * cosine)
        return jnp.where(_step(count) <= warmup_steps, warm(count), decayed)

    return schedule


def warmup_rsqrt(peak: float, warmup_steps: int) -> optax.Schedule:
    """peak * min(step / warmup, sqrt(warmup / step)): linear warmup, then inverse square root
    decay (the paper's shape, parameterised by its peak)."""

    def schedule(count: jax.Array) -> jax.Array:
        step = _step(count)
        return peak * jnp.minimum(step / warmup_steps, jnp.sqrt(warmup_steps / step))

    return schedule


def decay_mask(params: Any) -> Any:
    """True for leaves that get weight decay: not named bias/scale and of rank >= 2 (so
    biases and norm scales are excluded, also when scanned layers stack them to rank 2)."""

    def keep(path: tuple, leaf: Any) -> bool:
        names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        names = [n for n in names if n and n != "value"]  # flax Partitioned boxes: `.value`
        return jnp.ndim(leaf) >= 2 and not (names and names[-1] in _NO_DECAY_NAMES)

    return jax.tree_util.tree_map_with_path(keep, params)


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"optimizer.{field}={value!r} is invalid; {allowed}")


def _number(values: dict, field: str, low: float, high: float, *, closed_high: bool) -> None:
    value = values[field]
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    ok = ok and low <= value and (value <= high if closed_high else value < high)
    if not ok:
        _fail(field, value, f"must be a number in [{low}, {high}{']' if closed_high else ')'}")


def _integer(values: dict, field: str, minimum: int) -> None:
    value = values[field]
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _fail(field, value, f"must be an integer >= {minimum}")


def resolve_optimizer_config(
    opt_config: Mapping[str, Any], num_steps: int | None = None
) -> dict[str, Any]:
    """Validates an optimizer section (dict or ConfigDict) and fills in the defaults.

    `num_steps`: the run's train.num_steps; an unset total_steps then becomes the run's number
    of optimizer updates, ceil(num_steps / grad_accum_steps). Raises ConfigError naming
    `optimizer.<field>` and the allowed values.
    """
    given = section_dict(opt_config, "optimizer", list(DEFAULTS))
    values = {**DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    follows_run = values["total_steps"] is None and num_steps is not None
    if values["name"] not in OPTIMIZERS:
        _fail("name", values["name"], f"choose one of: {', '.join(OPTIMIZERS)}")
    for field, default in _NAME_DEFAULTS[values["name"]].items():
        if values[field] is None:
            values[field] = default
    schedule = values["schedule"]
    if schedule not in SCHEDULES:
        _fail("schedule", schedule, f"choose one of: {', '.join(SCHEDULES)}")
    if values["learning_rate"] is None:
        if schedule != "paper":
            _fail("learning_rate", None, f"schedule={schedule!r} needs a peak learning rate > 0")
        values["learning_rate"] = 1.0
    _number(values, "learning_rate", 0.0, math.inf, closed_high=False)
    if values["learning_rate"] == 0:
        _fail("learning_rate", 0, "must be > 0")
    _integer(values, "warmup_steps", 1 if schedule in ("paper", "rsqrt") else 0)
    _integer(values, "grad_accum_steps", 1)
    if follows_run:
        values["total_steps"] = -(-num_steps // values["grad_accum_steps"])
    if schedule == "cosine":
        total = values["total_steps"]
        if follows_run and total <= values["warmup_steps"]:
            raise ConfigError(
                f"optimizer.warmup_steps={values['warmup_steps']} must be below the schedule's "
                f"length, {total} updates (train.num_steps={num_steps}"
                + (f" / grad_accum_steps={values['grad_accum_steps']}"
                   if values["grad_accum_steps"] > 1 else "")
                + "): lower --config.optimizer.warmup_steps or raise --config.train.num_steps"
            )
        if not isinstance(total, int) or isinstance(total, bool) or total <= values["warmup_steps"]:
            _fail("total_steps", total, "schedule='cosine' needs an integer > warmup_steps "
                  "(or None: the run's train.num_steps)")
    _number(values, "end_fraction", 0.0, 1.0, closed_high=True)
    _number(values, "b1", 0.0, 1.0, closed_high=False)
    _number(values, "b2", 0.0, 1.0, closed_high=False)
    _number(values, "eps", 0.0, math.inf, closed_high=False)
    _number(values, "weight_decay", 0.0, math.inf, closed_high=False)
    if values["weight_decay"] and values["name"] != "adamw":
        _fail("weight_decay", values["weight_decay"], "weight decay needs name='adamw'")
    _number(values, "grad_clip_norm", 0.0, math.inf, closed_high=False)
    return values


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The `optimizer` section, validated and with the optimizer's own defaults filled in (see
    DEFAULTS); built once per run by `from_config`."""

    name: str
    schedule: str
    learning_rate: float
    warmup_steps: int
    total_steps: int | None
    end_fraction: float
    b1: float
    b2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    grad_accum_steps: int

    @classmethod
    def from_config(
        cls, section: Mapping[str, Any] | OptimizerConfig, num_steps: int | None = None
    ) -> OptimizerConfig:
        """`num_steps`: the run's train.num_steps, the schedule's length when total_steps is
        unset (see `resolve_optimizer_config`)."""
        if isinstance(section, OptimizerConfig):
            return section
        return cls(**resolve_optimizer_config(section, num_steps))


def schedule_length_note(config: OptimizerConfig, num_steps: int) -> str | None:
    """A line for a cosine schedule whose length was set apart from the run's: past its end the
    rate stays at end_fraction * peak (0 by default), so those steps barely train."""
    updates = -(-num_steps // config.grad_accum_steps)
    if config.schedule != "cosine" or config.total_steps == updates:
        return None
    if config.total_steps < updates:
        return (f"optimizer.total_steps={config.total_steps} is below this run's "
                f"{updates} updates (train.num_steps={num_steps}): the learning rate stays at "
                f"{config.end_fraction:g} x peak for the last {updates - config.total_steps}; "
                "leave total_steps unset to follow train.num_steps")
    return (f"optimizer.total_steps={config.total_steps} is beyond this run's {updates} updates "
            f"(train.num_steps={num_steps}): the run stops before the schedule ends")


def make_schedule(values: Mapping[str, Any], d_model: int | None = None) -> optax.Schedule:
    """The schedule named by a resolved optimizer config (see `resolve_optimizer_config`)."""
    name, peak, warmup = values["schedule"], values["learning_rate"], values["warmup_steps"]
    if name == "paper":
        if d_model is None:
            raise ConfigError("optimizer.schedule='paper' needs d_model (pass the model's)")
        return paper_schedule(d_model, warmup, multiplier=peak)
    if name == "cosine":
        return warmup_cosine(peak, warmup, values["total_steps"], values["end_fraction"])
    if name == "rsqrt":
        return warmup_rsqrt(peak, warmup)
    return linear_warmup(peak, warmup)


def make_optimizer(
    opt_config: Mapping[str, Any] | OptimizerConfig, *, d_model: int | None = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Builds (optimizer, schedule) from an `optimizer` config section; see DEFAULTS for keys.

    Order: clip the global gradient norm -> Adam -> decoupled weight decay (masked by
    `decay_mask`) -> times -schedule(count). With grad_accum_steps = k the whole chain is wrapped
    in optax.MultiSteps: it averages k micro-batch gradients, then applies one update (returning
    zero updates in between). `d_model` is needed by the paper schedule only.
    """
    values = dataclasses.asdict(OptimizerConfig.from_config(opt_config))
    schedule = make_schedule(values, d_model)
    parts = []
    if values["grad_clip_norm"] > 0:
        parts.append(optax.clip_by_global_norm(values["grad_clip_norm"]))
    parts.append(
        optax.adamw(
            schedule,
            b1=values["b1"],
            b2=values["b2"],
            eps=values["eps"],
            weight_decay=values["weight_decay"],
            mask=decay_mask,
        )
    )
    optimizer = optax.chain(*parts)
    if values["grad_accum_steps"] > 1:
        optimizer = optax.MultiSteps(optimizer, values["grad_accum_steps"])
        optimizer = optimizer.gradient_transformation()
    return named_scope(optimizer, "optimizer"), schedule


def named_scope(transformation: optax.GradientTransformation, name: str
                ) -> optax.GradientTransformation:
    """`transformation` with its update traced under jax.named_scope(name), so the compiled
    step's instructions from it carry `name` in their metadata (`launch.sh compile
    --breakdown` groups them by it)."""

    def update(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        with jax.named_scope(name):
            return transformation.update(updates, state, params, **extra)

    return optax.GradientTransformation(transformation.init, update)
