"""The sections of an experiment config, validated once: `parse_config(config)` turns the
ml_collections config into one ExperimentConfig of frozen sections (each owned by the module that
uses it: ModelConfig, DataConfig, OptimizerConfig, DecodeConfig; TrainConfig, EvalConfig and
GenerateConfig here), so a typo fails with a ConfigError naming the field before anything is
built or compiled. tfm/training/experiment.py's `setup` then adds what needs the data and the
devices.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import ml_collections

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
from tfm.data.config import DataConfig
from tfm.decode.search import DecodeConfig
from tfm.kernels import cpu_compile
from tfm.nn.config import ModelConfig, from_dict
from tfm.nn.families import get_family
from tfm.parallel import sharding
from tfm.training import trackers
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
    prefill_chunk: int = 0  # prompt tokens per prefill call (tfm.decode.prefill); 0 = whole
    # Long-context probes (tfm/training/long_context.py), off by default.
    passkey_lengths: tuple[int, ...] = ()  # passkey prompt lengths in tokens; () = off
    passkey_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)  # where the key sits
    passkey_examples: int = 4  # prompts per (length, depth) cell
    passkey_task: str = "passkey"  # or "multi_key": several named keys, one asked for
    passkey_alphabet: str = "0123456789"  # the keys' characters
    passkey_key_length: int = 5
    passkey_decode: bool = True  # False: score the keys under teacher forcing only, no decoding
    position_buckets: int = 0  # > 0: perplexity per bucket of positions along the eval rows

    def __post_init__(self) -> None:
        check_int("eval.max_batches", self.max_batches, 0, " (0 = all)")
        for length in self.passkey_lengths:
            check_int("eval.passkey_lengths", length, 16)
        for depth in self.passkey_depths:
            check_number("eval.passkey_depths", depth, "numbers in [0, 1]",
                         lambda v: 0.0 <= v <= 1.0)
        check_int("eval.passkey_examples", self.passkey_examples, 1)
        check_choice("eval.passkey_task", self.passkey_task, ("passkey", "multi_key"))
        if len(self.passkey_alphabet) < 2:
            raise ConfigError(f"eval.passkey_alphabet={self.passkey_alphabet!r} needs at least "
                              "2 characters")
        check_int("eval.passkey_key_length", self.passkey_key_length, 1)
        check_bool("eval.passkey_decode", self.passkey_decode)
        check_int("eval.position_buckets", self.position_buckets, 0, " (0 = off)")
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
                prefill_chunk=self.prefill_chunk,
            )


# The decoding fields of the `generate` section (flat in the config, one DecodeConfig here).
GENERATE_DECODE_FIELDS = (
    "method", "max_new_tokens", "temperature", "top_k", "top_p", "beam_size", "alpha",
    "cache_segments", "prefill_chunk",
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
        """`decode` for a model of family `mode`; beam search over a source (an
        encoder-decoder's) gets the paper's budget (source length + extra_len) instead of
        max_new_tokens."""
        if get_family(mode).reads_source and self.decode.method == "beam":
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
    init_checkpoint: tuple[str, int | None] | None  # (a tfm workdir, its step or None = latest)


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
        init_checkpoint=_init_checkpoint(config),
    )


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


def _init_checkpoint(config: ml_collections.ConfigDict) -> tuple[str, int | None] | None:
    """(workdir, step) of init.checkpoint / init.checkpoint_step, checked to exist."""
    init = section_dict(config.get("init"), "init", ["pretrained", "checkpoint", "checkpoint_step"])
    folder, step = init.get("checkpoint"), init.get("checkpoint_step")
    if folder is None:
        if step is not None:
            raise ConfigError("init.checkpoint_step is set without init.checkpoint")
        return None
    if init.get("pretrained") is not None:
        raise ConfigError("init.pretrained and init.checkpoint both give the first params; "
                          "set one")
    if not isinstance(folder, str) or not (Path(folder) / "checkpoints").is_dir():
        raise ConfigError(f"init.checkpoint={folder!r} must be a tfm workdir holding "
                          "checkpoints/ (./launch.sh train --workdir DIR)")
    if step is not None:
        check_int("init.checkpoint_step", step, 0)
    return str(Path(folder).resolve()), step
