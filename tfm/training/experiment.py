"""An experiment: its config sections, validated once, and what the training loop,
`./launch.sh eval` and `./launch.sh generate` share (model, mesh, data, state, restore).

`parse_config(config)` turns the ml_collections config into one ExperimentConfig of frozen,
validated sections (each owned by the module that uses it: ModelConfig, DataConfig,
OptimizerConfig, DecodeConfig; TrainConfig, EvalConfig and GenerateConfig here), so a typo
fails with a ConfigError naming the field before anything is built or compiled. `setup` then
adds what needs the data and the devices and returns an Experiment.
"""

from __future__ import annotations

import dataclasses
import json
import logging
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

from tfm import kernels
from tfm.checks import (
    ConfigError,
    check_bool,
    check_choice,
    check_int,
    check_number,
    field_defaults,
    field_prefix,
    section_dict,
)
from tfm.data.build import Data, DataConfig, build_data
from tfm.decode.search import DecodeConfig
from tfm.kernels import cpu_compile, hardware
from tfm.nn import positions, remat
from tfm.nn.config import ModelConfig, from_dict, loss_backend_for
from tfm.nn.families import Family, get_family
from tfm.nn.models import output_projection
from tfm.parallel import distributed, sharding
from tfm.training import checkpoint, losses, optim, trackers
from tfm.training.optim import OptimizerConfig

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
GENERATION_METRICS = ("none", "exact_match", "bleu")
logger = logging.getLogger("tfm.training.train")  # the training system's one log name


class TrainingError(RuntimeError):
    """Training cannot go on (non-finite loss, incompatible checkpoint); nothing was overwritten."""


def _from_section(cls: type, values: Any, name: str) -> Any:
    """A section dataclass from its config values (dict, ConfigDict or None = defaults)."""
    given = section_dict(values, name, [field.name for field in dataclasses.fields(cls)])
    return cls(**{key: tuple(v) if isinstance(v, list) else v for key, v in given.items()})


DROPOUT_RNGS = ("threefry", "threefry2x32", "rbg", "unsafe_rbg")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The `train` section: the loop's length, logging, evaluation and checkpoint cadence."""

    seed: int = 0  # parameter init and dropout (the data's order: data.seed)
    num_steps: int = 1000  # train steps of the run; an unset optimizer.total_steps follows it
    label_smoothing: float = 0.0  # epsilon_ls of the loss (paper sec. 5.4: 0.1)
    log_every: int = 50  # steps between train-metric lines in metrics.jsonl and the tracker
    eval_every: int = 500  # 0 = only at the end
    checkpoint_every: int = 500  # steps between checkpoints (the last step is always saved)
    max_to_keep: int | None = 3  # newest checkpoints kept (None = all; the best is also kept)
    keep_best_metric: str | None = None  # e.g. "eval_loss" or "exact_match": also keep the best
    best_mode: str = "min"  # "min" or "max": which way keep_best_metric is better
    async_checkpoints: bool = True  # save in the background while training goes on
    progress_bar: bool = True  # a tqdm bar on the console of process 0
    # The generator of the dropout masks: "threefry" (jax's default generator, hashed in fused
    # elementwise code: tfm.training.prng), "threefry2x32" (the same masks through jax's own,
    # slower lowering), or "rbg" / "unsafe_rbg" (XLA's RngBitGenerator, made for
    # accelerators; other masks). Each is reproducible for the same config, seed and mesh; the
    # rbg ones may give other masks on another mesh or jax version.
    dropout_rng: str = "threefry"
    # Split each batch into this many slices inside the jitted step and sum their gradients
    # (lax.scan): the same update in less activation memory, and faster on CPU (a slice's
    # activations stay in cache). Each device's share of the batch must divide by it.
    microbatches: int = 1
    # A folder for jax's persistent compilation cache: later runs with the same shapes (a resume,
    # `eval`, `generate`, the other seeds of a sweep) load their compiled steps from it instead
    # of compiling again. None = off. Set for every mode: it is read in `setup`.
    compilation_cache_dir: str | None = None
    # On CPU, what the train step's dots and reductions compile to: "auto" (the default:
    # "ynnpack_dots" for a bfloat16 model on a CPU with bf16 units, else "xla"), "xla" (XLA's
    # own loops and Eigen), "ynnpack" (XLA's defaults), "ynnpack_dots" (YNNPACK takes only the
    # dots: the only CPU path that runs bf16 matmuls in bf16) or "onednn" (dots by the oneDNN
    # library, XLA's experimental path; x86-64 only, "xla" elsewhere). See
    # tfm/kernels/cpu_compile.py; benchmarks/README.md has which is faster where. The eval step
    # takes "auto"'s choice; decoding loops choose by rows (kernels.cpu_compile.decode_kernels).
    # No effect off CPU.
    cpu_kernels: str = "auto"
    # A jax.profiler trace (TensorBoard's profile plugin / xprof, Perfetto) of the steps
    # profile_start .. profile_start + profile_steps - 1 (0-based: step S turns state step S
    # into S + 1), written to WORKDIR/profile/. None = no trace; start after the first step,
    # which includes compilation, for a representative one.
    profile_start: int | None = None
    profile_steps: int = 3  # how many steps the trace covers
    # Every this many steps, per-layer parameter, gradient and update norms, and per-layer,
    # per-head attention entropy and distance on the first eval batch, logged as
    # "diagnostics/..." (tfm/training/diagnostics.py). 0 = off; on, those steps also run one more
    # forward and backward pass (the train step itself is unchanged).
    diagnostics_every: int = 0
    # Where metrics go besides WORKDIR/metrics.jsonl (always written): "tensorboard"
    # (WORKDIR/tensorboard/), "wandb" (Weights & Biases, WORKDIR/wandb/; pip install -e
    # ".[wandb]"; WANDB_MODE=offline keeps it local) or "none" (tfm/training/trackers.py).
    tracker: str = "tensorboard"
    # What the tracker files the run under: wandb's project and run name (None = the workdir's
    # folder name).
    tracker_project: str = "tfm"
    tracker_run_name: str | None = None  # None = the workdir's folder name

    def __post_init__(self) -> None:
        check_choice("train.dropout_rng", self.dropout_rng, DROPOUT_RNGS)
        check_choice("train.cpu_kernels", self.cpu_kernels, cpu_compile.CPU_KERNEL_CHOICES)
        for field in ("num_steps", "log_every", "checkpoint_every", "microbatches"):
            check_int(f"train.{field}", getattr(self, field), 1)
        check_int("train.eval_every", self.eval_every, 0)
        check_int("train.diagnostics_every", self.diagnostics_every, 0, " (0 = off)")
        check_number(
            "train.label_smoothing", self.label_smoothing, "in [0, 1)", lambda v: 0 <= v < 1
        )
        check_choice("train.best_mode", self.best_mode, ("min", "max"))
        if self.max_to_keep is not None:
            check_int("train.max_to_keep", self.max_to_keep, 1, " (or None: keep all)")
        check_int("train.seed", self.seed, 0)
        if self.profile_start is not None:
            check_int("train.profile_start", self.profile_start, 0, " (or None: no trace)")
        check_int("train.profile_steps", self.profile_steps, 1)
        check_bool("train.async_checkpoints", self.async_checkpoints)
        check_bool("train.progress_bar", self.progress_bar)
        check_choice("train.tracker", self.tracker, tuple(trackers.TRACKERS))
        cache_dir = self.compilation_cache_dir
        if cache_dir is not None and not _is_name(cache_dir):
            raise ConfigError(f"train.compilation_cache_dir={cache_dir!r} must be a folder path "
                              "(a non-empty string), or None to compile every run afresh")
        if not _is_name(self.tracker_project):
            raise ConfigError(f"train.tracker_project={self.tracker_project!r} must be a "
                              "non-empty string")
        if self.tracker_run_name is not None and not _is_name(self.tracker_run_name):
            raise ConfigError(f"train.tracker_run_name={self.tracker_run_name!r} must be a "
                              "non-empty string, or None for the workdir's name")

    @property
    def tracker_run(self) -> trackers.RunInfo:
        """What the tracker files the run under (train.tracker_project, tracker_run_name)."""
        return trackers.RunInfo(self.tracker_project, self.tracker_run_name)


def _is_name(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """The `eval` section: which splits, how many batches, and the decoding that scores them."""

    splits: tuple[str, ...] | None = None  # None = the data's eval splits
    max_batches: int = 0  # 0 = every batch of the split (loss)
    generation_metric: str | None = None  # None = by data: exact_match (synthetic), bleu
    max_generation_examples: int = 256  # 0 = all
    method: str | None = None  # None = greedy for exact_match, beam for bleu
    beam_size: int = 4
    alpha: float = 0.6
    extra_len: int = 50  # seq2seq: at most source length + 50 tokens
    cache_segments: int = 4  # decode loops, the KV cache grown before each (tfm.decode.search)

    def __post_init__(self) -> None:
        check_int("eval.max_batches", self.max_batches, 0, " (0 = all)")
        check_int("eval.max_generation_examples", self.max_generation_examples, 0, " (0 = all)")
        if self.generation_metric is not None:
            check_choice("eval.generation_metric", self.generation_metric, GENERATION_METRICS)
        self.decode_config("exact_match")  # its decoding fields, checked by DecodeConfig

    def decode_config(self, metric: str) -> DecodeConfig:
        """How evaluation decodes for `metric`; max_new_tokens=None: the source length +
        extra_len (seq2seq; an LM's budget comes from its targets, see evaluate.py)."""
        method = self.method or ("greedy" if metric == "exact_match" else "beam")
        with field_prefix("eval"):
            return DecodeConfig(
                method, None, beam_size=self.beam_size, alpha=self.alpha,
                extra_len=self.extra_len, cache_segments=self.cache_segments,
            )


# The decoding fields of the `generate` section (flat in the config, one DecodeConfig here).
GENERATE_DECODE_FIELDS = (
    "method", "max_new_tokens", "temperature", "top_k", "top_p", "beam_size", "alpha",
    "cache_segments",
)


# `./launch.sh generate` decodes its prompts once, so by default it compiles one decode loop:
# growing the cache in segments saves time per call but costs compile time (tfm.decode.search).
GENERATE_DECODE = DecodeConfig(cache_segments=1)


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """The `generate` section: how `./launch.sh generate` decodes prompts (`decode`, from the
    section's GENERATE_DECODE_FIELDS), the sampling seed, and what to do with characters
    outside the vocabulary (map_unknown=True: they become <unk>)."""

    decode: DecodeConfig = GENERATE_DECODE
    seed: int = 0
    map_unknown: bool = False

    def __post_init__(self) -> None:
        check_int("generate.max_new_tokens", self.decode.max_new_tokens, 1)
        check_int("generate.seed", self.seed, 0)
        check_bool("generate.map_unknown", self.map_unknown)

    @classmethod
    def from_section(cls, values: Any) -> GenerateConfig:
        given = section_dict(values, "generate", [*GENERATE_DECODE_FIELDS, "seed", "map_unknown"])
        decode_fields = {key: given.pop(key) for key in GENERATE_DECODE_FIELDS if key in given}
        with field_prefix("generate"):
            decode = dataclasses.replace(GENERATE_DECODE, **decode_fields)
        return cls(decode, **given)

    def decode_config(self, mode: str) -> DecodeConfig:
        """`decode` for a model of `mode`; an encoder-decoder's beam search gets the paper's
        budget (source length + extra_len) instead of max_new_tokens."""
        if mode == "seq2seq" and self.decode.method == "beam":
            return dataclasses.replace(self.decode, max_new_tokens=None)
        return self.decode


# The sections' defaults, as configs/base.py exposes them for command-line overrides.
TRAIN_DEFAULTS = field_defaults(TrainConfig)
EVAL_DEFAULTS = field_defaults(EvalConfig)
GENERATE_DEFAULTS = {
    **{key: getattr(GENERATE_DECODE, key) for key in GENERATE_DECODE_FIELDS},
    **{key: value for key, value in field_defaults(GenerateConfig).items() if key != "decode"},
}


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
    """Every section of one experiment config, validated; built once by `parse_config`.

    `model` still has the config's vocabulary sizes (1 where unset): `setup` takes them from
    the data. mesh, distributed: the raw sections, checked against the devices by
    sharding.make_mesh and distributed.maybe_initialize."""

    source: ml_collections.ConfigDict  # what was parsed (saved with checkpoints)
    model: ModelConfig
    data: DataConfig
    optimizer: OptimizerConfig
    train: TrainConfig
    eval: EvalConfig
    generate: GenerateConfig
    rules: Any
    mesh: Any
    distributed: Any
    pretrained: str | None  # a Hugging Face folder the first state's params come from


def parse_config(config: ml_collections.ConfigDict) -> ExperimentConfig:
    """Checks every section's fields and values without building anything (no data, devices or
    compilation), so a typo fails at once with a ConfigError naming the field, also before a
    multi-host start. What needs the data (vocabulary, splits, keep_best_metric) and the devices
    (mesh) is checked by `setup`."""
    section_dict({key: None for key in config.keys()}, "config", TOP_LEVEL_SECTIONS)
    model_values = dict(
        config.model.to_dict() if hasattr(config.model, "to_dict") else config.model
    )
    with field_prefix("model"):
        model = from_dict({**model_values, "vocab_size": model_values.get("vocab_size") or 1})
    train = _from_section(TrainConfig, config.get("train"), "train")
    return ExperimentConfig(
        source=config,
        model=model,
        data=DataConfig.from_dict(config.data),
        # An unset optimizer.total_steps is this run's length, so a raised train.num_steps
        # stretches the schedule instead of training at its end value.
        optimizer=OptimizerConfig.from_config(config.optimizer, num_steps=train.num_steps),
        train=train,
        eval=_from_section(EvalConfig, config.get("eval"), "eval"),
        generate=GenerateConfig.from_section(config.get("generate")),
        rules=sharding.resolve_rules(config.get("logical_axis_rules")),
        mesh=config.get("mesh"),
        distributed=config.get("distributed"),
        pretrained=_pretrained_folder(config),
    )


@struct.dataclass
class TrainState:
    """Everything a resumed run needs besides the data position: step, params, optimizer state
    and the base RNG key (dropout keys are derived from (key, step), so resuming is exact)."""

    step: jax.Array  # [] int32
    params: Any
    opt_state: Any
    rng: jax.Array  # [2] uint32 base key


def model_for(config: ModelConfig, mode: str) -> nn.Module:
    """The model of family `mode` (tfm.nn.families) built from `config`."""
    return get_family(mode).model(config)


def compute_logits(
    model: nn.Module,
    params: Any,
    batch: Mapping[str, jax.Array],
    *,
    mode: str,
    deterministic: bool,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:  # [batch, len, vocab] float32
    """The model's logits for a batch of the data pipeline (see tfm/data/pipeline.py)."""
    return get_family(mode).logits(
        model, params, batch, deterministic=deterministic, dropout_rng=dropout_rng
    )


def uses_fused_loss(config: ModelConfig) -> bool:
    """Whether `config.loss_backend` picks the fused cross-entropy kernel on the platform being
    compiled for ("auto": tfm.nn.config.loss_backend_for)."""
    backend = config.loss_backend
    if backend == "auto":
        backend = loss_backend_for(kernels.platform(), config.vocab_size)
    return backend == "fused"


def loss_sums(
    model: nn.Module,
    params: Any,
    batch: Mapping[str, jax.Array],
    weights: jax.Array,  # [batch, len]
    *,
    mode: str,
    deterministic: bool,
    label_smoothing: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """tfm.training.losses' cross-entropy sums of a batch against batch["targets"]: from the
    logits, or with the fused loss (ModelConfig.loss_backend) from the model's last hidden
    states and its output layer, without logits in memory."""
    config = model.config
    family = get_family(mode)
    if not uses_fused_loss(config):
        logits = family.logits(model, params, batch, deterministic=deterministic,
                               dropout_rng=dropout_rng)
        return losses.cross_entropy(logits, batch["targets"], weights,
                                    label_smoothing=label_smoothing)
    hidden = family.logits(model, params, batch, deterministic=deterministic,
                           dropout_rng=dropout_rng, return_hidden=True)
    table, bias = output_projection(params, config)
    return losses.fused_cross_entropy_sums(hidden, table, bias, batch["targets"], weights,
                                           label_smoothing=label_smoothing)


@dataclasses.dataclass
class Experiment:
    """One experiment's sections and what `setup` built from them, before anything compiles."""

    config: ml_collections.ConfigDict
    workdir: Path
    model_config: ModelConfig  # with the data's vocabulary sizes
    mode: str  # one of tfm.nn.families.MODES: "lm" or "seq2seq"
    data: Data
    train: TrainConfig
    eval: EvalConfig
    generate: GenerateConfig
    optimizer_config: OptimizerConfig
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    mesh: jax.sharding.Mesh
    rules: Any
    pretrained: str | None = None  # a Hugging Face folder the first state's params come from

    @property
    def model(self) -> nn.Module:
        return model_for(self.model_config, self.mode)

    @property
    def family(self) -> Family:
        return get_family(self.mode)

    @property
    def platform(self) -> str:
        """The platform of the mesh's devices ("cpu", "gpu" or "tpu"): what the steps compile
        for, also when that is not this host's (`./launch.sh compile`)."""
        return self.mesh.devices.flat[0].platform

    def config_json(self) -> str:
        """The config as saved with checkpoints (and as WORKDIR/config.json); the model and
        optimizer sections are resolved (the data's vocabulary, the schedule's length)."""
        values = json.loads(self.config.to_json_best_effort())
        values["model"] = dataclasses.asdict(self.model_config)
        values["optimizer"] = dataclasses.asdict(self.optimizer_config)
        return json.dumps(values, sort_keys=True)

    @property
    def eval_splits(self) -> tuple[str, ...]:
        return self.eval.splits or self.data.eval_splits

    @property
    def generation_metric(self) -> str:
        """What evaluation decodes for: eval.generation_metric, or by the data."""
        if self.eval.generation_metric is not None:
            return self.eval.generation_metric
        if self.data.config.kind == "synthetic":
            return "exact_match"
        return "bleu" if self.mode == "seq2seq" else "none"

    def eval_prefix(self, split: str) -> str:
        return "eval" if split == self.data.eval_splits[0] else f"eval_{split}"

    def eval_metric_names(self) -> list[str]:
        """The names of the metrics evaluation returns (eval_loss, eval_test_exact_match, ...)."""
        names = ["loss", "perplexity", "accuracy"]
        if self.generation_metric != "none":
            names.append(self.generation_metric)
        return [f"{self.eval_prefix(split)}_{name}" for split in self.eval_splits for name in names]

    def generation_examples(self, split: str) -> tuple[list[str], list[str]]:
        """(sources, targets) that evaluation decodes on `split`: the same on every process."""
        data = self.data
        if data.process_count > 1:
            # Every process decodes every example: the decode inputs are then truly replicated
            # (jit treats host numpy inputs as identical on all processes) and the score global.
            data = dataclasses.replace(data, process_index=0, process_count=1)
        sources, targets = data.eval_texts(split)
        limit = self.eval.max_generation_examples
        if limit:
            sources, targets = sources[:limit], targets[:limit]
        return sources, targets


def setup(
    config: ml_collections.ConfigDict | ExperimentConfig,
    workdir: str | Path,
    devices: Sequence[jax.Device] | None = None,
) -> Experiment:
    """Parses every section (once; or takes parsed ones), starts multi-host JAX if asked, builds
    mesh and data. Raises ConfigError naming the field before anything is compiled.

    `devices`: the devices the mesh spans (default: every device of every process); e.g.
    `jax.devices()[:1]` with mesh {data: 1} runs on one device of a many-device process."""
    sections = config if isinstance(config, ExperimentConfig) else parse_config(config)
    if sections.train.compilation_cache_dir is not None:
        try:
            cpu_compile.use_compilation_cache(sections.train.compilation_cache_dir)
        except OSError as error:
            raise ConfigError(f"train.compilation_cache_dir="
                              f"{sections.train.compilation_cache_dir!r}: cannot create or use "
                              f"that folder ({error})") from error
    distributed.maybe_initialize(sections.distributed)
    mesh = sharding.make_mesh(sections.mesh, devices)

    # Processes sharing a filesystem must not prepare one dataset at the same time: process 0
    # prepares it (or finds it prepared) first; the others then find it, or prepare their own
    # copy on their own disk.
    several = jax.process_count() > 1
    if several and jax.process_index() != 0:
        multihost_utils.sync_global_devices("tfm.training.train.setup: data prepared")
    data = build_data(sections.data, jax.process_index(), jax.process_count())
    if several and jax.process_index() == 0:
        multihost_utils.sync_global_devices("tfm.training.train.setup: data prepared")
    # "auto" kernels for the mesh's devices, which need not be this host's (deviceless compile).
    platform = mesh.devices.flat[0].platform
    model_config = _model_for_platform(_model_for_data(sections, data), platform)
    model_config = _loss_for_mesh(model_config, sections.model.loss_backend, mesh,
                                  sections.rules)
    warning = hardware.bf16_warning(model_config.dtype, platform)
    if warning and jax.process_index() == 0:
        logger.warning(warning)
    sharding.check_divisibility(
        model_config, mesh, data.config.batch_size, sections.rules, sections.train.microbatches
    )
    optimizer, schedule = optim.make_optimizer(sections.optimizer, d_model=model_config.d_model)
    experiment = Experiment(
        config=sections.source,
        workdir=Path(workdir),
        model_config=model_config,
        mode=data.mode,
        data=data,
        train=sections.train,
        eval=sections.eval,
        generate=sections.generate,
        optimizer_config=sections.optimizer,
        optimizer=optimizer,
        schedule=schedule,
        mesh=mesh,
        rules=sections.rules,
        pretrained=sections.pretrained,
    )
    for split in sections.eval.splits or ():
        if split not in data.sources:
            raise ConfigError(
                f"eval.splits: {split!r} is not a split of this data; splits: "
                f"{', '.join(data.sources)}"
            )
    keep = sections.train.keep_best_metric
    if keep is not None and keep not in experiment.eval_metric_names():
        raise ConfigError(
            f"train.keep_best_metric={keep!r} is never computed by this config's evaluation; "
            f"choose one of: {', '.join(experiment.eval_metric_names())}"
        )
    check_lengths(experiment)
    return experiment


def _model_for_platform(model_config: ModelConfig, platform: str) -> ModelConfig:
    """`model_config` with "auto" kernels resolved for `platform` (logging why when "auto"
    falls back to the reference, or that a Pallas kernel runs interpreted on CPU), its remat
    policy checked there."""
    note = kernels.setup_note(model_config.attention_backend, platform,
                              **model_config.attention_needs)
    if note and jax.process_index() == 0:
        logger.info(note)
    model_config = model_config.for_platform(platform)
    remat.check_platform(model_config.remat, platform)
    return model_config


def _loss_for_mesh(model_config: ModelConfig, asked: str, mesh: jax.sharding.Mesh,
                   rules: Any) -> ModelConfig:
    """loss_backend "auto" keeps the reference where the mesh splits the vocabulary (a tensor
    axis): the fused kernel takes the whole table on every device, so it would gather it and
    repeat the output layer on each of the axis's devices, where XLA splits the logits."""
    if asked != "auto" or model_config.loss_backend != "fused":
        return model_config
    axes = nn.logical_to_mesh_axes(("vocab",), rules)[0]
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    if all(mesh.shape[name] == 1 for name in names):
        return model_config
    if jax.process_index() == 0:
        logger.info("loss_backend='auto': the reference output layer and loss, since the mesh "
                    "splits the vocabulary over %s (the fused kernel takes the whole table)",
                    "x".join(names))
    return model_config.replace(loss_backend="reference")


def _model_for_data(sections: ExperimentConfig, data: Data) -> ModelConfig:
    """The model section with the data's vocabulary sizes (or the pretrained architecture)."""
    values = dataclasses.asdict(sections.model)
    values["vocab_size"] = data.vocab_size
    if data.mode == "seq2seq":
        values["source_vocab_size"] = data.source_vocab_size
        if data.source_vocab_size != data.vocab_size:
            values["share_embeddings"] = False
    if sections.pretrained is not None:
        values = _pretrained_model_values(sections.pretrained, values, data.mode, data)
    return from_dict(values)


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
    folder: str, model_values: dict[str, Any], mode: str, data: Data
) -> dict[str, Any]:
    """The model section of a run that starts from the pretrained folder's architecture."""
    from tfm.interop import hf

    pretrained = hf.config_from_hf(hf.read_config(folder))
    kind = "seq2seq" if pretrained.num_encoder_layers and pretrained.num_decoder_layers else (
        "lm" if pretrained.num_decoder_layers else "encoder")
    if kind != mode:
        raise ConfigError(
            f"init.pretrained={folder!r} holds a {kind} model but the data is for a {mode} task"
        )
    # Agree = every id the tokenizer makes has an embedding row; HF models may have more rows
    # than tokens (T5: 32128 rows, 32100 tokens), so equality would be too strict.
    if data.vocab_size > pretrained.vocab_size:
        raise ConfigError(
            f"init.pretrained={folder!r} has vocab_size={pretrained.vocab_size}, smaller than "
            f"data.tokenizer={data.config.resolved_tokenizer!r} ({data.vocab_size} ids)"
        )
    values = dataclasses.asdict(pretrained)
    values.update({field: model_values[field] for field in IMPLEMENTATION_FIELDS})
    return values


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


def required_lengths(experiment: Experiment) -> list[tuple[int, str]]:
    """(positions, what needs them) for every sequence the run builds: training rows, eval
    rows of each split, eval decoding (prompt or source plus generated tokens) and the
    `generate` section's output (its prompt comes later: `check_prompt_lengths`)."""
    data, mode = experiment.data, experiment.mode
    needs = [(length, f"data.seq_len={length} (training rows)")
             for key, length in data.train_lengths.items() if key == "inputs"]
    if "source" in data.train_lengths:
        needs.append((data.train_lengths["source"], "training source rows (data.source_seq_len)"))
    metric = experiment.generation_metric
    for split in experiment.eval_splits:
        for key, length in data.eval_lengths(split).items():
            if key in ("inputs", "source"):
                needs.append((length, f"eval rows of split {split!r} ({key})"))
        if metric == "none":
            continue
        sources, targets = experiment.generation_examples(split)
        width = max(len(data.encode_prompt(text)) for text in sources)
        if mode == "seq2seq":
            extra = experiment.eval.extra_len
            needs.append((width, f"eval decoding sources of split {split!r}"))
            needs.append((width + extra + 1, f"eval decoding of split {split!r} (source length "
                                             f"{width} + eval.extra_len={extra} + bos)"))
        else:
            new = max(len(data.tokenizer.encode(t)) for t in targets) + 2
            needs.append((width + new, f"eval decoding of split {split!r} (prompt {width} + "
                                       f"{new} new tokens)"))
    max_new = experiment.generate.decode.max_new_tokens
    if mode == "lm" or experiment.generate.decode.method != "beam":
        bos = 1 if mode == "seq2seq" else 2  # seq2seq: bos; lm: bos plus a prompt of >= 1
        needs.append((max_new + bos, f"generate.max_new_tokens={max_new} (+ {bos})"))
    return needs


def check_lengths(experiment: Experiment) -> None:
    """Learned positions stop at model.max_len: fail before anything compiles (or trains for an
    hour before the first evaluation) if any sequence of the run is longer."""
    config = experiment.model_config
    if not config.scheme.bounded_by_max_len:
        return
    too_long = [(length, what) for length, what in required_lengths(experiment)
                if length > config.max_len]
    if too_long:
        longest = max(length for length, _ in too_long)
        unbounded = [name for name, scheme in positions.SCHEMES.items()
                     if not scheme.bounded_by_max_len and scheme.kind != "none"]
        raise ConfigError(
            f"model.max_len={config.max_len} is too short for position_scheme="
            f"{config.position_scheme!r}: "
            f"{'; '.join(f'{what} needs {length}' for length, what in too_long)}. Set "
            f"model.max_len >= {longest}, shorten those lengths, or choose another "
            f"position_scheme ({', '.join(unbounded)} work at any length)"
        )


def _dummy_batch(experiment: Experiment) -> dict[str, np.ndarray]:
    lengths = experiment.data.train_lengths
    batch = experiment.data.config.batch_size
    shapes = {key: (batch, length) for key, length in lengths.items()}
    return {key: np.zeros(shape, np.int32) for key, shape in shapes.items()}


def _init_fn(experiment: Experiment) -> Callable[[jax.Array], TrainState]:
    model, mode = experiment.model, experiment.mode
    dummy = {key: jnp.asarray(value[:1]) for key, value in _dummy_batch(experiment).items()}

    def init(rng: jax.Array) -> TrainState:
        params_rng, dropout_rng = jax.random.split(rng)
        params = get_family(mode).init(model, params_rng, dummy)
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
    return state


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
