"""Training: pure, jit-compiled train and eval steps, and the loop that resumes, logs and saves.

Data flows one way: config -> data pipeline -> model -> loss -> optimizer -> checkpoint/metrics.
`train_and_evaluate(config, workdir)` is what `./launch.sh train` runs; `Experiment` holds what
the loop, `./launch.sh eval` and `./launch.sh generate` share (model, mesh, data, restored state).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import struct
from jax.experimental import multihost_utils

from tfm import checkpoint, distributed, flops, generate, losses, metrics, optim, sharding
from tfm.config import ConfigError, ModelConfig, from_dict
from tfm.data import tokenizers
from tfm.data.build import Data, DataConfig, build_data
from tfm.models import DecoderLM, EncoderDecoder

TOP_LEVEL_SECTIONS = (
    "model",
    "data",
    "optimizer",
    "train",
    "eval",
    "generate",
    "mesh",
    "logical_axis_rules",
    "distributed",
    "init",
)
# Fields of config.model that still apply when init.pretrained supplies the architecture.
IMPLEMENTATION_FIELDS = ("dtype", "param_dtype", "scan_layers", "remat", "attention_backend")
TRAIN_DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "num_steps": 1000,
    "label_smoothing": 0.0,
    "log_every": 50,
    "eval_every": 500,  # 0 = only at the end
    "checkpoint_every": 500,
    "max_to_keep": 3,
    "keep_best_metric": None,  # e.g. "eval_loss" or "exact_match": also keep the best step
    "best_mode": "min",
    "async_checkpoints": True,
    "progress_bar": True,
}
EVAL_DEFAULTS: dict[str, Any] = {
    "splits": None,  # None = the data's eval splits
    "max_batches": 0,  # 0 = every batch of the split (loss)
    "generation_metric": None,  # None = by data kind: exact_match (synthetic), bleu (translation)
    "max_generation_examples": 256,  # 0 = all
    "method": None,  # None = greedy for exact_match, beam for bleu
    "beam_size": 4,
    "alpha": 0.6,
    "extra_len": 50,  # translation: at most source length + 50 tokens
}
GENERATE_DEFAULTS: dict[str, Any] = {
    "method": "greedy",
    "max_new_tokens": 64,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "beam_size": 4,
    "alpha": 0.6,
    "seed": 0,
    "map_unknown": False,  # True: prompt characters outside the vocabulary become <unk>
}
GENERATION_METRICS = ("none", "exact_match", "bleu")
logger = logging.getLogger(__name__)


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, incompatible checkpoint); nothing was overwritten."""


class PromptError(ValueError):
    """A generation prompt the model cannot take (characters outside the vocabulary, too long)."""


def _section(config: Any, name: str, defaults: Mapping[str, Any]) -> dict[str, Any]:
    """A config section as a dict with defaults filled in; unknown keys raise ConfigError."""
    given = config.get(name) if hasattr(config, "get") else None
    given = {} if given is None else (given.to_dict() if hasattr(given, "to_dict") else dict(given))
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        raise ConfigError(
            f"{', '.join(f'{name}.{key}' for key in unknown)}: unknown field(s); known fields: "
            f"{', '.join(defaults)}"
        )
    return {**defaults, **given}


def _check_train_section(values: dict[str, Any]) -> None:
    for field in ("num_steps", "log_every", "checkpoint_every"):
        if not isinstance(values[field], int) or values[field] < 1:
            raise ConfigError(f"train.{field}={values[field]!r} must be an integer >= 1")
    if not isinstance(values["eval_every"], int) or values["eval_every"] < 0:
        raise ConfigError(f"train.eval_every={values['eval_every']!r} must be an integer >= 0")
    if not 0.0 <= values["label_smoothing"] < 1.0:
        raise ConfigError(f"train.label_smoothing={values['label_smoothing']!r} must be in [0, 1)")
    if values["best_mode"] not in ("min", "max"):
        raise ConfigError(f"train.best_mode={values['best_mode']!r} is unknown; choose min, max")
    max_to_keep = values["max_to_keep"]
    if max_to_keep is not None and (not _is_int(max_to_keep) or max_to_keep < 1):
        raise ConfigError(f"train.max_to_keep={max_to_keep!r} must be None (keep all) or >= 1")
    if not _is_int(values["seed"]) or values["seed"] < 0:
        raise ConfigError(f"train.seed={values['seed']!r} must be an integer >= 0")
    for field in ("async_checkpoints", "progress_bar"):
        if not isinstance(values[field], bool):
            raise ConfigError(f"train.{field}={values[field]!r} must be True or False")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_decoding_options(section: str, values: dict[str, Any]) -> None:
    """Checks the decoding fields of the eval / generate sections (the methods of
    tfm.generate), so a typo fails before training rather than at its first evaluation."""
    method = values["method"]
    if method is not None and method not in generate.METHODS:
        raise ConfigError(
            f"{section}.method={method!r} is unknown; choose one of: {', '.join(generate.METHODS)}"
        )
    checks = {
        "beam_size": (_is_int, "an integer >= 1", lambda v: v >= 1),
        "alpha": (lambda v: isinstance(v, int | float), "a number >= 0", lambda v: v >= 0),
        "max_new_tokens": (_is_int, "an integer >= 1", lambda v: v >= 1),
        "temperature": (lambda v: isinstance(v, int | float), "a number > 0", lambda v: v > 0),
        "top_k": (_is_int, "an integer >= 0 (0 = off)", lambda v: v >= 0),
        "top_p": (lambda v: isinstance(v, int | float), "in (0, 1]", lambda v: 0 < v <= 1),
        "extra_len": (_is_int, "an integer >= 0", lambda v: v >= 0),
        "max_batches": (_is_int, "an integer >= 0 (0 = all)", lambda v: v >= 0),
        "max_generation_examples": (_is_int, "an integer >= 0 (0 = all)", lambda v: v >= 0),
        "seed": (_is_int, "an integer >= 0", lambda v: v >= 0),
    }
    for field, (type_ok, allowed, value_ok) in checks.items():
        if field in values and not (type_ok(values[field]) and value_ok(values[field])):
            raise ConfigError(f"{section}.{field}={values[field]!r} must be {allowed}")


@struct.dataclass
class TrainState:
    """Everything a resumed run needs besides the data position: step, params, optimizer state
    and the base RNG key (dropout keys are derived from (key, step), so resuming is exact)."""

    step: jax.Array  # [] int32
    params: Any
    opt_state: Any
    rng: jax.Array  # [2] uint32 base key


def model_for(config: ModelConfig, task: str) -> nn.Module:
    return EncoderDecoder(config) if task == "seq2seq" else DecoderLM(config)


def compute_logits(
    model: nn.Module,
    params: Any,
    batch: Mapping[str, jax.Array],
    *,
    task: str,
    deterministic: bool,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:  # [batch, len, vocab] float32
    rngs = None if dropout_rng is None else {"dropout": dropout_rng}
    if task == "seq2seq":
        return model.apply(
            {"params": params},
            batch["source"],
            batch["inputs"],
            source_positions=batch["source_positions"],
            source_segment_ids=batch["source_segment_ids"],
            positions=batch["positions"],
            segment_ids=batch["segment_ids"],
            deterministic=deterministic,
            rngs=rngs,
        )
    return model.apply(
        {"params": params},
        batch["inputs"],
        positions=batch["positions"],
        segment_ids=batch["segment_ids"],
        deterministic=deterministic,
        rngs=rngs,
    )


def train_step(
    state: TrainState,
    batch: Mapping[str, jax.Array],
    *,
    model: nn.Module,
    task: str,
    optimizer: optax.GradientTransformation,
    schedule: optax.Schedule,
    label_smoothing: float,
    grad_accum_steps: int = 1,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One micro-batch step (pure); with grad_accum_steps = k the optimizer (optax.MultiSteps)
    applies an update every k-th call. The loss is the token-weighted mean over real tokens."""
    dropout_rng = jax.random.fold_in(state.rng, state.step)

    def loss_fn(params):
        logits = compute_logits(
            model, params, batch, task=task, deterministic=False, dropout_rng=dropout_rng
        )
        sums = losses.cross_entropy(
            logits, batch["targets"], batch["weights"], label_smoothing=label_smoothing
        )
        return sums["loss_sum"] / jnp.maximum(sums["weight_sum"], 1.0), sums

    (_, sums), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    step_metrics = {
        **sums,
        "grad_norm": optax.tree.norm(grads),
        "learning_rate": schedule(state.step // grad_accum_steps),
    }
    return state.replace(step=state.step + 1, params=params, opt_state=opt_state), step_metrics


def eval_step(
    params: Any, batch: Mapping[str, jax.Array], *, model: nn.Module, task: str
) -> dict[str, jax.Array]:
    """Loss sums over the real tokens of a batch (unsmoothed: eval reports the true NLL)."""
    logits = compute_logits(model, params, batch, task=task, deterministic=True)
    weights = batch["weights"] * batch["example_weights"][:, None]
    return losses.cross_entropy(logits, batch["targets"], weights)


@dataclasses.dataclass
class Experiment:
    """The validated pieces of one experiment config, built before anything compiles."""

    config: ml_collections.ConfigDict
    workdir: Path
    model_config: ModelConfig
    task: str  # "lm" or "seq2seq"
    data: Data
    train_options: dict[str, Any]
    eval_options: dict[str, Any]
    generate_options: dict[str, Any]
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    mesh: jax.sharding.Mesh
    rules: Any
    pretrained: str | None = None  # a Hugging Face folder the first state's params come from

    @property
    def model(self) -> nn.Module:
        return model_for(self.model_config, self.task)

    def config_json(self) -> str:
        """The config as saved with checkpoints; the model section is the resolved ModelConfig."""
        values = json.loads(self.config.to_json_best_effort())
        values["model"] = dataclasses.asdict(self.model_config)
        return json.dumps(values, sort_keys=True)


def validate_config(config: ml_collections.ConfigDict) -> None:
    """Checks every section's fields and values without building anything (no data, devices or
    compilation), so a typo fails at once with a ConfigError naming the field, also before a
    multi-host start. What needs the data (vocabulary, splits, keep_best_metric) and the devices
    (mesh) is checked by `setup`."""
    unknown = sorted(set(config.keys()) - set(TOP_LEVEL_SECTIONS))
    if unknown:
        raise ConfigError(
            f"unknown config section(s) {', '.join(unknown)}; "
            f"known: {', '.join(TOP_LEVEL_SECTIONS)}"
        )
    _check_train_section(_section(config, "train", TRAIN_DEFAULTS))
    eval_options = _section(config, "eval", EVAL_DEFAULTS)
    _check_decoding_options("eval", eval_options)
    metric = eval_options["generation_metric"]
    if metric is not None and metric not in GENERATION_METRICS:
        raise ConfigError(
            f"eval.generation_metric={metric!r} is unknown; choose one of: "
            f"{', '.join(GENERATION_METRICS)}"
        )
    generate_options = _section(config, "generate", GENERATE_DEFAULTS)
    _check_decoding_options("generate", generate_options)
    if not isinstance(generate_options["map_unknown"], bool):
        raise ConfigError(
            f"generate.map_unknown={generate_options['map_unknown']!r} must be True or False"
        )
    model_values = dict(
        config.model.to_dict() if hasattr(config.model, "to_dict") else config.model
    )
    from_dict({**model_values, "vocab_size": model_values.get("vocab_size") or 1})
    optim.resolve_optimizer_config(config.optimizer)
    DataConfig.from_dict(config.data)
    sharding.resolve_rules(config.get("logical_axis_rules"))


def setup(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    devices: Sequence[jax.Device] | None = None,
) -> Experiment:
    """Validates every section, starts multi-host JAX if asked, builds mesh and data. Raises
    ConfigError naming the field before anything is compiled.

    `devices`: the devices the mesh spans (default: every device of every process); e.g.
    `jax.devices()[:1]` with mesh {data: 1} runs on one device of a many-device process."""
    validate_config(config)
    train_options = _section(config, "train", TRAIN_DEFAULTS)
    eval_options = _section(config, "eval", EVAL_DEFAULTS)
    generate_options = _section(config, "generate", GENERATE_DEFAULTS)
    model_values = dict(
        config.model.to_dict() if hasattr(config.model, "to_dict") else config.model
    )
    distributed.maybe_initialize(config.get("distributed"))
    mesh = sharding.make_mesh(config.get("mesh"), devices)
    rules = sharding.resolve_rules(config.get("logical_axis_rules"))

    # Processes sharing a filesystem must not prepare one dataset at the same time: process 0
    # prepares it (or finds it prepared) first; the others then find it, or prepare their own
    # copy on their own disk.
    several = jax.process_count() > 1
    if several and jax.process_index() != 0:
        multihost_utils.sync_global_devices("tfm.train.setup: data prepared")
    data = build_data(config.data, jax.process_index(), jax.process_count())
    if several and jax.process_index() == 0:
        multihost_utils.sync_global_devices("tfm.train.setup: data prepared")
    task = "seq2seq" if data.encoder.mode == "seq2seq" else "lm"
    model_values["vocab_size"] = data.vocab_size
    if task == "seq2seq":
        model_values["source_vocab_size"] = data.source_vocab_size
        if data.source_vocab_size != data.vocab_size:
            model_values["share_embeddings"] = False
    pretrained = _pretrained_folder(config)
    if pretrained is not None:
        model_values = _pretrained_model_values(pretrained, model_values, task, data)
    model_config = from_dict(model_values)
    if (warning := flops.bf16_warning(model_config)) and jax.process_index() == 0:
        logger.warning(warning)
    sharding.check_divisibility(model_config, mesh, data.config.batch_size, rules)
    optimizer, schedule = optim.make_optimizer(config.optimizer, d_model=model_config.d_model)
    experiment = Experiment(
        config,
        Path(workdir),
        model_config,
        task,
        data,
        train_options,
        eval_options,
        generate_options,
        optimizer,
        schedule,
        mesh,
        rules,
        pretrained,
    )
    for split in eval_options["splits"] or ():
        if split not in data.sources:
            raise ConfigError(
                f"eval.splits: {split!r} is not a split of this data; splits: "
                f"{', '.join(data.sources)}"
            )
    keep = train_options["keep_best_metric"]
    if keep is not None and keep not in eval_metric_names(experiment):
        raise ConfigError(
            f"train.keep_best_metric={keep!r} is never computed by this config's evaluation; "
            f"choose one of: {', '.join(eval_metric_names(experiment))}"
        )
    check_lengths(experiment)
    return experiment


def _pretrained_folder(config: ml_collections.ConfigDict) -> str | None:
    init = config.get("init")
    folder = None if init is None else init.get("pretrained")
    if folder is None:
        return None
    if not isinstance(folder, str) or not (Path(folder) / "config.json").is_file():
        raise ConfigError(
            f"init.pretrained={folder!r} must be a Hugging Face model folder holding config.json"
        )
    return folder


def _pretrained_model_values(
    folder: str, model_values: dict[str, Any], task: str, data: Data
) -> dict[str, Any]:
    """The model section of a run that starts from the pretrained folder's architecture."""
    from tfm.interop import hf

    pretrained = hf.config_from_hf(hf.read_config(folder))
    kind = "seq2seq" if pretrained.num_encoder_layers and pretrained.num_decoder_layers else (
        "lm" if pretrained.num_decoder_layers else "encoder")
    if kind != task:
        raise ConfigError(
            f"init.pretrained={folder!r} holds a {kind} model but the data is for a {task} task"
        )
    if data.vocab_size > pretrained.vocab_size:
        raise ConfigError(
            f"init.pretrained={folder!r} has vocab_size={pretrained.vocab_size}, smaller than the "
            f"data's tokenizer ({data.vocab_size} ids)"
        )
    values = dataclasses.asdict(pretrained)
    values.update({field: model_values[field] for field in IMPLEMENTATION_FIELDS})
    return values


def _with_pretrained_params(experiment: Experiment, state: TrainState, shardings: Any):
    """`state` with the pretrained folder's parameters (placed by `shardings`, on any mesh and
    any number of processes) and a fresh optimizer state for them."""
    from tfm.interop import hf
    from tfm.models import stack_layer_params

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


def required_lengths(experiment: Experiment) -> list[tuple[int, str]]:
    """(positions, what needs them) for every sequence the run builds: training rows, eval
    rows of each split, eval decoding (prompt or source plus generated tokens) and the
    `generate` section's output (its prompt comes later: `check_prompt_lengths`)."""
    data, task = experiment.data, experiment.task
    needs = [(length, f"data.seq_len={length} (training rows)")
             for key, length in data.train_lengths.items() if key == "inputs"]
    if "source" in data.train_lengths:
        needs.append((data.train_lengths["source"], "training source rows (data.source_seq_len)"))
    splits = experiment.eval_options["splits"] or data.eval_splits
    metric = generation_metric(experiment)
    for split in splits:
        for key, length in data.eval_lengths(split).items():
            if key in ("inputs", "source"):
                needs.append((length, f"eval rows of split {split!r} ({key})"))
        if metric == "none":
            continue
        sources, targets = _generation_examples(experiment, split)
        width = max(len(data.encode_prompt(text)) for text in sources)
        if task == "seq2seq":
            extra = experiment.eval_options["extra_len"]
            needs.append((width, f"eval decoding sources of split {split!r}"))
            needs.append((width + extra + 1, f"eval decoding of split {split!r} (source length "
                                             f"{width} + eval.extra_len={extra} + bos)"))
        else:
            new = max(len(data.tokenizer.encode(t)) for t in targets) + 2
            needs.append((width + new, f"eval decoding of split {split!r} (prompt {width} + "
                                       f"{new} new tokens)"))
    max_new = experiment.generate_options["max_new_tokens"]
    if task == "lm" or experiment.generate_options["method"] != "beam":
        bos = 1 if task == "seq2seq" else 2  # seq2seq: bos; lm: bos plus a prompt of >= 1
        needs.append((max_new + bos, f"generate.max_new_tokens={max_new} (+ {bos})"))
    return needs


def check_lengths(experiment: Experiment) -> None:
    """Learned positions stop at model.max_len: fail before anything compiles (or trains for an
    hour before the first evaluation) if any sequence of the run is longer."""
    config = experiment.model_config
    if config.position_scheme != "learned":
        return
    too_long = [(length, what) for length, what in required_lengths(experiment)
                if length > config.max_len]
    if too_long:
        longest = max(length for length, _ in too_long)
        raise ConfigError(
            f"model.max_len={config.max_len} is too short for position_scheme='learned': "
            f"{'; '.join(f'{what} needs {length}' for length, what in too_long)}. Set "
            f"model.max_len >= {longest}, shorten those lengths, or choose another "
            "position_scheme (sinusoidal, rope, relative, t5_bias, alibi work at any length)"
        )


def _eval_prefix(experiment: Experiment, split: str) -> str:
    return "eval" if split == experiment.data.eval_splits[0] else f"eval_{split}"


def eval_metric_names(experiment: Experiment) -> list[str]:
    """The names of the metrics `evaluate` returns (eval_loss, eval_test_exact_match, ...)."""
    names = ["loss", "perplexity", "accuracy"]
    if generation_metric(experiment) != "none":
        names.append(generation_metric(experiment))
    splits = experiment.eval_options["splits"] or experiment.data.eval_splits
    return [f"{_eval_prefix(experiment, split)}_{name}" for split in splits for name in names]


def _dummy_batch(experiment: Experiment) -> dict[str, np.ndarray]:
    lengths = experiment.data.train_lengths
    batch = experiment.data.config.batch_size
    shapes = {key: (batch, length) for key, length in lengths.items()}
    return {key: np.zeros(shape, np.int32) for key, shape in shapes.items()}


def _init_fn(experiment: Experiment) -> Callable[[jax.Array], TrainState]:
    model, task = experiment.model, experiment.task
    dummy = {key: jnp.asarray(value[:1]) for key, value in _dummy_batch(experiment).items()}

    def init(rng: jax.Array) -> TrainState:
        params_rng, dropout_rng = jax.random.split(rng)
        if task == "seq2seq":
            params = model.init(params_rng, dummy["source"], dummy["inputs"])["params"]
        else:
            params = model.init(params_rng, dummy["inputs"])["params"]
        opt_state = experiment.optimizer.init(params)
        return TrainState(jnp.zeros((), jnp.int32), params, opt_state, dropout_rng)

    return init


def state_shardings(experiment: Experiment) -> tuple[Any, Any]:
    """(abstract unboxed state with shardings, sharding tree) from logical annotations."""
    init = _init_fn(experiment)
    rng = jax.random.PRNGKey(experiment.train_options["seed"])
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
    rng = jax.random.PRNGKey(experiment.train_options["seed"])
    with sharding.sharding_context(experiment.mesh, experiment.rules):
        state = jax.jit(lambda r: nn.meta.unbox(init(r)), out_shardings=shardings)(rng)
    if experiment.pretrained is not None:
        state = _with_pretrained_params(experiment, state, shardings)
    return state


class _InShardingContext:
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


def jit_steps(experiment: Experiment, shardings: Any) -> tuple[Callable, Callable]:
    """(train_step, eval_step) jit-compiled with explicit shardings, the same code from 1 device
    to N processes: the state as `shardings` (from state_shardings), batches split over the
    "batch" rule's mesh axes (data x fsdp), metrics replicated. The train step donates its
    state. Both also have `.lower(*args)` (e.g. `.lower(...).compile().memory_analysis()`).

    `train(state, batch) -> (state, metrics)`; `eval(params, batch) -> loss sums`.
    """
    model, task, mesh = experiment.model, experiment.task, experiment.mesh
    batch_sharding = sharding.batch_sharding(mesh, experiment.rules)
    replicated = sharding.replicated(mesh)
    step_fn = functools.partial(
        train_step,
        model=model,
        task=task,
        optimizer=experiment.optimizer,
        schedule=experiment.schedule,
        label_smoothing=experiment.train_options["label_smoothing"],
        grad_accum_steps=optim.resolve_optimizer_config(experiment.config.optimizer)[
            "grad_accum_steps"
        ],
    )
    jit_train = jax.jit(
        step_fn,
        in_shardings=(shardings, batch_sharding),
        out_shardings=(shardings, replicated),
        donate_argnums=(0,),
    )
    jit_eval = jax.jit(
        functools.partial(eval_step, model=model, task=task),
        in_shardings=(shardings.params, batch_sharding),
        out_shardings=replicated,
    )
    return _InShardingContext(jit_train, experiment), _InShardingContext(jit_eval, experiment)


def _data_state_fits(checkpointer: checkpoint.Checkpointer, step: int) -> bool:
    """False when `step` holds data-iterator states, but none for this process layout (grain
    writes data/process_{index}-of-{count}.json per process): saved by another process count."""
    data_dir = checkpointer.directory / str(step) / "data"
    name = f"process_{jax.process_index()}-of-{jax.process_count()}.json"
    return not data_dir.exists() or (data_dir / name).exists()


def _optimizer_differences(
    checkpointer: checkpoint.Checkpointer, step: int, experiment: Experiment
) -> list[str]:
    """'optimizer.FIELD: saved X, current Y' for every optimizer field (defaults filled in)
    that differs between checkpoint `step` and the current config."""
    try:
        saved = optim.resolve_optimizer_config(checkpointer.saved_config(step)["optimizer"])
    except (checkpoint.CheckpointError, KeyError, ConfigError):
        return []
    current = optim.resolve_optimizer_config(experiment.config.optimizer)
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
        differences = _optimizer_differences(checkpointer, step, experiment)
        if not differences:
            raise
        raise TrainingError(
            f"checkpoint {checkpointer.directory / str(step)} holds an optimizer state "
            f"this config cannot restore; the optimizer config differs: "
            f"{'; '.join(differences)}. Resume with the saved optimizer settings or start "
            "a new workdir"
        ) from error


def _restore_newest_readable(
    experiment: Experiment, checkpointer: checkpoint.Checkpointer, abstract: Any, train_iter: Any
) -> TrainState:
    """The newest checkpoint that restores. Unreadable newer steps (a crash of the disk, a
    truncated file) are moved aside, never deleted, with a warning naming each; if no step
    restores, the newest one's CheckpointError is raised and nothing is moved."""
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
                    "checkpoint step %d could not be read (%s: %s); training resumes from step "
                    "%d, and step %d was moved to %s", bad_step,
                    type(error.__cause__).__name__, checkpoint.first_line(error.__cause__, 160),
                    step, bad_step, moved,
                )
        if errors and jax.process_count() > 1:
            multihost_utils.sync_global_devices("tfm.train: unreadable checkpoints moved")
            checkpointer.reload()
        return state
    raise errors[0][1]


def make_checkpointer(experiment: Experiment) -> checkpoint.Checkpointer:
    options = experiment.train_options
    return checkpoint.Checkpointer(
        experiment.workdir / "checkpoints",
        max_to_keep=options["max_to_keep"],
        keep_best_metric=options["keep_best_metric"],
        best_mode=options["best_mode"],
        save_interval_steps=1,
        async_save=options["async_checkpoints"],
    )


def restore_params(experiment: Experiment, step: int | None = None) -> tuple[Any, int]:
    """Params of the latest (or given) checkpoint, checked against the current model config."""
    abstract, _ = state_shardings(experiment)
    with make_checkpointer(experiment) as checkpointer:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(
                f"no checkpoint in {experiment.workdir / 'checkpoints'}; train first with "
                "./launch.sh train"
            )
        state = checkpointer.restore(
            step, abstract_state=abstract, config_json=experiment.config_json()
        )
    return state.params, step


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


def evaluate(experiment: Experiment, params: Any, eval_fn: Callable | None = None) -> dict:
    """Loss/perplexity/accuracy on every eval split, plus exact match or BLEU from decoding."""
    options = experiment.eval_options
    eval_fn = eval_fn or jit_steps(experiment, state_shardings(experiment)[1])[1]
    results: dict[str, float] = {}
    for split in options["splits"] or experiment.data.eval_splits:
        totals: dict[str, float] = {}
        for index, batch in enumerate(experiment.data.eval_batches(split)):
            if options["max_batches"] and index >= options["max_batches"]:
                break
            global_batch = sharding.shard_batch(
                dict(batch), experiment.mesh, rules=experiment.rules
            )
            for key, value in jax.device_get(eval_fn(params, global_batch)).items():
                totals[key] = totals.get(key, 0.0) + float(value)
        prefix = _eval_prefix(experiment, split)
        for key, value in losses.weighted_metrics(totals).items():
            if key in ("nll", "perplexity", "accuracy"):
                name = {"nll": "loss"}.get(key, key)
                results[f"{prefix}_{name}"] = float(value)
        metric = generation_metric(experiment)
        if metric != "none":
            results[f"{prefix}_{metric}"] = generation_score(experiment, params, split, metric)
    return results


def generation_metric(experiment: Experiment) -> str:
    metric = experiment.eval_options["generation_metric"]
    if metric is not None:
        return metric
    if experiment.data.config.kind == "synthetic":
        return "exact_match"
    return "bleu" if experiment.task == "seq2seq" else "none"


def decode_texts(
    experiment: Experiment,
    params: Any,
    sources: list[str],
    *,
    method: str,
    max_new_tokens: int | None = None,
    progress: str | None = None,
    **options: Any,
) -> list[str]:
    """Generates a target text for each source text (prompt for an LM, source for seq2seq).
    `progress`: a label for a progress bar over the batches (process 0), None for none."""
    config = experiment.model_config
    encoded = [experiment.data.encode_prompt(text) for text in sources]
    batch_size = experiment.data.config.eval_batch_size or experiment.data.config.batch_size
    width = max(len(ids) for ids in encoded)
    outputs: list[str] = []
    bar = metrics.progress_bar(
        -(-len(encoded) // batch_size), desc=progress or "", unit="batch", leave=False,
        enabled=progress is not None and jax.process_index() == 0,
    )
    for start in range(0, len(encoded), batch_size):
        chunk = encoded[start : start + batch_size]
        real = len(chunk)
        chunk = chunk + [chunk[-1]] * (batch_size - real)  # fixed shapes: one compilation
        tokens, lengths = generate.pad_batch(chunk)
        tokens = np.pad(tokens, ((0, 0), (0, width - tokens.shape[1])))
        if experiment.task == "seq2seq":
            output = generate.translate(
                params,
                config,
                tokens,
                lengths,
                method=method,
                max_new_tokens=max_new_tokens,
                **options,
            )
        else:
            output = generate.lm_generate(
                params,
                config,
                tokens,
                lengths,
                method=method,
                max_new_tokens=max_new_tokens or 64,
                **options,
            )
        best, _ = generate.best_sequences(jax.tree.map(_fetch, output))
        outputs += [experiment.data.decode(generate.strip_special(row)) for row in best[:real]]
        bar.update(1)
    bar.close()
    return outputs


def _fetch(x: jax.Array) -> np.ndarray:
    """The whole value of an output array on this host, also when other processes hold parts."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _generation_examples(experiment: Experiment, split: str) -> tuple[list[str], list[str]]:
    """(sources, targets) that evaluation decodes on `split`: the same on every process."""
    data = experiment.data
    if data.process_count > 1:
        # Every process decodes every example: the decode inputs are then truly replicated
        # (jit treats host numpy inputs as identical on all processes) and the score global.
        data = dataclasses.replace(data, process_index=0, process_count=1)
    sources, targets = data.eval_texts(split)
    limit = experiment.eval_options["max_generation_examples"]
    if limit:
        sources, targets = sources[:limit], targets[:limit]
    return sources, targets


def generation_score(experiment: Experiment, params: Any, split: str, metric: str) -> float:
    """Exact-match accuracy (percent) or corpus BLEU of decoded outputs on `split`."""
    options = experiment.eval_options
    sources, targets = _generation_examples(experiment, split)
    method = options["method"] or ("greedy" if metric == "exact_match" else "beam")
    extra = (
        {"beam_size": options["beam_size"], "alpha": options["alpha"]} if method == "beam" else {}
    )
    if experiment.task == "seq2seq":
        extra["extra_len"] = options["extra_len"]
        max_new = None
    else:
        max_new = max(len(experiment.data.tokenizer.encode(t)) for t in targets) + 2
    hypotheses = decode_texts(
        experiment, params, sources, method=method, max_new_tokens=max_new,
        progress=f"decode {split}" if experiment.train_options["progress_bar"] else None, **extra,
    )
    if metric == "exact_match":
        return 100.0 * float(np.mean([h == t for h, t in zip(hypotheses, targets, strict=True)]))
    import sacrebleu

    return float(sacrebleu.corpus_bleu(hypotheses, [targets]).score)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | Path) -> dict[str, Any]:
    """Trains `config` in `workdir`, resuming from its latest checkpoint; returns final metrics."""
    experiment = setup(config, workdir)
    options = experiment.train_options
    workdir = experiment.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    process_zero = jax.process_index() == 0
    if process_zero:
        (workdir / "config.json").write_text(experiment.config_json())

    abstract, shardings = state_shardings(experiment)
    checkpointer = make_checkpointer(experiment)
    train_iter = experiment.data.train_iterator()
    try:
        if checkpointer.latest_step() is not None:
            state = _restore_newest_readable(experiment, checkpointer, abstract, train_iter)
        else:
            state = init_state(experiment, shardings)
    except BaseException:
        checkpointer.close()  # leave no orbax threads behind when the start fails
        raise
    start_step = int(state.step)

    batch_sharding = sharding.batch_sharding(experiment.mesh, experiment.rules)
    task = experiment.task
    jit_train, jit_eval = jit_steps(experiment, shardings)

    tokens_per_batch = experiment.data.config.batch_size * experiment.data.config.seq_len
    source_len = experiment.data.train_lengths.get("source")
    flops_per_token = flops.flops_per_token(
        experiment.model_config, experiment.data.config.seq_len, task, source_len
    )
    peak = flops.device_peak_flops(jax.devices()[0], experiment.model_config.compute_dtype)
    writer = metrics.MetricWriter(workdir, jax.process_index(), resume_step=start_step)
    bar = metrics.progress_bar(
        options["num_steps"],
        initial_step=start_step,
        enabled=options["progress_bar"] and process_zero,
    )
    say = bar.write if process_zero else (lambda line: None)  # one console, not one per process
    pending: list[dict[str, jax.Array]] = []
    last_log_time, last_log_step = time.perf_counter(), start_step
    last_metrics: dict[str, Any] = {}
    step = start_step

    def save(step: int, state: TrainState, eval_metrics: dict | None, force: bool) -> None:
        checkpointer.save(
            step,
            state,
            config_json=experiment.config_json(),
            data_state=train_iter,
            metrics=eval_metrics,
            force=force,
        )

    def check_finite(step: int) -> dict[str, float]:
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

    # After an error the loop saves `state` (the last completed step); data_position is the
    # iterator state to save with it while a step has taken its batch but not finished.
    data_position = None
    try:
        with _StopRequest() as stop:
            while step < options["num_steps"]:
                data_position = train_iter.get_state()
                batch = sharding.shard_batch(
                    next(train_iter), experiment.mesh, batch_sharding, experiment.rules
                )
                state, step_metrics = jit_train(state, batch)
                data_position = None  # the iterator now matches `state` again
                pending.append(step_metrics)
                step += 1
                bar.update(1)
                is_last = step == options["num_steps"]
                eval_now = (options["eval_every"] and step % options["eval_every"] == 0) or is_last
                save_now = step % options["checkpoint_every"] == 0 or is_last
                if step % options["log_every"] == 0 or eval_now or save_now or stop.signal_name:
                    logged = check_finite(step)
                    elapsed = time.perf_counter() - last_log_time
                    steps_done = step - last_log_step
                    logged["steps_per_second"] = steps_done / elapsed
                    logged["tokens_per_second"] = steps_done * tokens_per_batch / elapsed
                    if peak:
                        logged["mfu"] = flops.mfu(
                            logged["tokens_per_second"], flops_per_token, jax.device_count(), peak
                        )
                    writer.write(step, logged)
                    bar.set_postfix(loss=f"{logged['train_loss']:.4f}")
                    last_log_time, last_log_step = time.perf_counter(), step
                    last_metrics.update(logged)
                eval_metrics = None
                if eval_now:
                    eval_metrics = evaluate(experiment, state.params, jit_eval)
                    writer.write(step, eval_metrics)
                    last_metrics.update(eval_metrics)
                    say(
                        f"step {step}: "
                        + ", ".join(f"{k}={v:.4g}" for k, v in sorted(eval_metrics.items()))
                    )
                if stop.signal_name:
                    save(step, state, None, force=True)
                    checkpointer.wait()
                    say(f"{stop.signal_name}: saved step {step} and stopped")
                    last_metrics["stopped_by"] = stop.signal_name
                    break
                if save_now:
                    keep_metric = options["keep_best_metric"]
                    if keep_metric and (eval_metrics is None or keep_metric not in eval_metrics):
                        eval_metrics = None  # only evaluated steps compete for "best"
                    save(step, state, eval_metrics, force=True)
            checkpointer.wait()
    except Exception as error:
        if not isinstance(error, TrainingError):  # TrainingError: nothing worth saving
            _save_after_error(
                checkpointer, save, step, state, train_iter, data_position, pending, say
            )
        raise
    finally:
        bar.close()
        writer.close()
        checkpointer.close()
        if hasattr(train_iter, "close"):  # stops grain's prefetch thread before exit
            train_iter.close()
    last_metrics["step"] = step
    return last_metrics


def evaluate_checkpoint(
    config: ml_collections.ConfigDict, workdir: str | Path, step: int | None = None
) -> dict[str, float]:
    """`./launch.sh eval`: metrics on the eval splits from the latest (or given) checkpoint."""
    experiment = setup(config, workdir)
    params, step = restore_params(experiment, step)
    results = evaluate(experiment, params)
    results["step"] = step
    return results


def generate_from_checkpoint(
    config: ml_collections.ConfigDict,
    workdir: str | Path,
    prompts: list[str],
    step: int | None = None,
) -> list[str]:
    """`./launch.sh generate`: text in, text out, with the config's `generate` settings."""
    experiment = setup(config, workdir)
    options = dict(experiment.generate_options)
    method = options.pop("method")
    seed = options.pop("seed")
    max_new = options.pop("max_new_tokens")
    check_prompts(experiment, prompts, map_unknown=options.pop("map_unknown"))
    params, _ = restore_params(experiment, step)
    extra: dict[str, Any] = {}
    if method == "sample":
        extra = dict(
            temperature=options["temperature"],
            top_k=options["top_k"],
            top_p=options["top_p"],
            rng=jax.random.PRNGKey(seed),
        )
    elif method == "beam":
        extra = dict(beam_size=options["beam_size"], alpha=options["alpha"])
    if experiment.task == "seq2seq":
        max_new = None if method == "beam" else max_new
    return decode_texts(experiment, params, prompts, method=method, max_new_tokens=max_new, **extra)


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def check_prompts(experiment: Experiment, prompts: Sequence[str], *, map_unknown: bool) -> None:
    """Before restoring or compiling anything: raises PromptError (one line) for characters
    outside the vocabulary (unless `map_unknown`) and for prompts past a learned position
    table; warns when a prompt is longer than the training rows of a scheme that extrapolates."""
    data, task, config = experiment.data, experiment.task, experiment.model_config
    options = experiment.generate_options
    max_new = options["max_new_tokens"]
    tokenizer = (data.source_tokenizer or data.tokenizer) if task == "seq2seq" else data.tokenizer
    for number, prompt in enumerate(prompts, 1):
        unknown = tokenizers.unknown_characters(tokenizer, prompt)
        if unknown and not map_unknown:
            alphabet = getattr(tokenizer, "chars", None)
            known = (f" (the vocabulary: {''.join(alphabet)!r})"
                     if alphabet is not None and len(alphabet) <= 64 else "")
            raise PromptError(
                f"prompt {number} {_short(prompt)} has characters outside the vocabulary: "
                f"{', '.join(repr(c) for c in unknown)}{known}; remove them, or pass "
                "--config.generate.map_unknown=True to map them to <unk>"
            )
    widths = [len(data.encode_prompt(prompt)) for prompt in prompts]
    width, longest = max(widths), prompts[widths.index(max(widths))]
    beam = options["method"] == "beam"
    if task == "seq2seq":
        extra = 50  # tfm.generate.translate's default: at most source length + 50 tokens
        needs = {"source": width, "output": (width + extra if beam else max_new) + 1}
        trained = data.train_lengths["source"]
    else:
        needs = {"prompt and output": width + max_new}
        trained = data.train_lengths["inputs"]
    if config.position_scheme == "learned":
        for what, length in needs.items():
            if length > config.max_len:
                raise PromptError(
                    f"prompt {widths.index(width) + 1} {_short(longest)} is {width} tokens; its "
                    f"{what} needs {length} positions, past model.max_len={config.max_len} of "
                    "the learned position table; shorten the prompt"
                    + ("" if task == "seq2seq" and beam else " or lower generate.max_new_tokens")
                )
    elif width > trained:
        logger.warning(
            "prompt %d %s is %d tokens, longer than the %d of the training rows; "
            "position_scheme=%r runs at any length, but quality past the trained lengths may "
            "drop", widths.index(width) + 1, _short(longest), width, trained,
            config.position_scheme,
        )
