"""An experiment: what the training loop, `./launch.sh eval` and `./launch.sh generate` share.
`setup` takes the validated sections (tfm/training/config.py: `parse_config`), starts multi-host
JAX if asked, builds the mesh, the data and, once, the model config (the model section, or a
pretrained folder's architecture, with the data's vocabulary and the mesh's kernel choices), and
checks what needs them before anything compiles. The train state, its initialisation and its
restore from checkpoints: tfm/training/state.py; the loss: tfm/training/losses.py.

The names of those modules stay importable from here (`from tfm.training.experiment import
setup, parse_config, TrainState, ...`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import optax
from jax.experimental import multihost_utils

from tfm import kernels
from tfm.checks import ConfigError
from tfm.data.build import Data, build_data
from tfm.kernels import cpu_compile, hardware
from tfm.nn import positions, remat
from tfm.nn.config import ModelConfig, from_dict, loss_backend_for
from tfm.nn.families import Family, family_of, get_family
from tfm.parallel import distributed, sharding
from tfm.training import long_context, optim
from tfm.training.config import (  # noqa: F401  (re-exported: the public import path)
    DROPOUT_RNGS,
    EVAL_DEFAULTS,
    GENERATE_DECODE,
    GENERATE_DECODE_FIELDS,
    GENERATE_DEFAULTS,
    GENERATION_METRICS,
    IMPLEMENTATION_FIELDS,
    TOP_LEVEL_SECTIONS,
    TRAIN_DEFAULTS,
    EvalConfig,
    ExperimentConfig,
    GenerateConfig,
    TrainConfig,
    parse_config,
)
from tfm.training.losses import loss_sums, uses_fused_loss  # noqa: F401  (re-exported)
from tfm.training.optim import OptimizerConfig
from tfm.training.state import (  # noqa: F401  (re-exported: the public import path)
    InShardingContext,
    TrainingError,
    TrainState,
    init_state,
    logger,  # the training system's one log name
    make_checkpointer,
    optimizer_differences,
    restore_newest_readable,
    restore_params,
    state_shardings,
)


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


@dataclasses.dataclass
class Experiment:
    """One experiment's sections and what `setup` built from them, before anything compiles."""

    config: ml_collections.ConfigDict
    workdir: Path
    model_config: ModelConfig  # with the data's vocabulary sizes
    mode: str  # the model family, one of tfm.nn.families.MODES
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
    init_checkpoint: tuple[str, int | None] | None = None  # (tfm workdir, step): the same

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
        return self.family.pair_metric

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
    model_config = model_config_for(sections, data, mesh)
    warning = hardware.bf16_warning(model_config.dtype, mesh.devices.flat[0].platform)
    if warning and jax.process_index() == 0:
        logger.warning(warning)
    sharding.check_divisibility(
        model_config, mesh, data.config.batch_size, sections.rules, sections.train.microbatches
    )
    sharding.check_context(model_config, mesh, data.config.seq_len, data.config.source_seq_len)
    for field, chunk in (("generate.prefill_chunk", sections.generate.decode.prefill_chunk),
                         ("eval.prefill_chunk", sections.eval.prefill_chunk)):
        warning = sharding.chunked_prefill_warning(field, chunk, mesh)
        if warning and jax.process_index() == 0:
            logger.warning(warning)
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
        init_checkpoint=sections.init_checkpoint,
    )
    long_context.check(experiment)
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


def model_config_for(
    sections: ExperimentConfig, data: Data, mesh: jax.sharding.Mesh
) -> ModelConfig:
    """The model config of the run, built once: the model section (or the pretrained folder's
    architecture with the section's IMPLEMENTATION_FIELDS) with the data's vocabulary sizes and
    the loss backend the mesh allows, its other "auto" kernels then resolved for the mesh's
    platform (ModelConfig.for_platform), which need not be this host's (deviceless compile)."""
    values = dataclasses.asdict(sections.model)
    values["vocab_size"] = data.vocab_size
    if data.source_vocab_size is not None:  # a source side: the encoder's own vocabulary
        values["source_vocab_size"] = data.source_vocab_size
        if data.source_vocab_size != data.vocab_size:
            values["share_embeddings"] = False
    if sections.pretrained is not None:
        values = _pretrained_model_values(sections.pretrained, values, data)
    platform = mesh.devices.flat[0].platform
    values["loss_backend"] = _loss_backend(values["loss_backend"], platform, values["vocab_size"],
                                           mesh, sections.rules)
    model_config = from_dict(values)
    if sharding.context_size(mesh) > 1 and model_config.attention_backend == "auto":
        model_config = model_config.replace(
            attention_backend=context_attention_backend(model_config, platform))
    return _model_for_platform(model_config, platform, longest_row(data))


def longest_row(data: Data) -> int:
    """The longest rows the run trains or evaluates on (tokens; source rows included, eval rows
    where data.eval_seq_len sets them), which decide whether "auto" takes a blocked kernel
    (tfm.kernels.within_one_block)."""
    return max(*data.train_lengths.values(), data.config.eval_seq_len or 0)


def context_attention_backend(model_config: ModelConfig, platform: str) -> str:
    """What attention_backend "auto" means under context parallelism (each chunk's attention,
    tfm.kernels.context_parallel) on `platform`: the flex kernel (Mosaic on TPU, Triton on
    GPU), under either strategy (all_gather: per device against the gathered row; ring: per
    pair of chunk halves), when it serves the model (its lowered programs are checked for
    both), else the reference maths. On GPU the reference would write each chunk's [chunk, T]
    scores and bias (GPT-2 small, T5, 131,072 tokens over h100-8: 2,143 GB per GPU; flex 11.3)."""
    flex = kernels.BACKENDS["flex"]
    if (platform in ("tpu", "gpu")
            and kernels.Needs(**model_config.attention_needs).unmet(flex) is None):
        return "flex"
    return "reference"


def _model_for_platform(model_config: ModelConfig, platform: str,
                        longest: int | None = None) -> ModelConfig:
    """`model_config` with "auto" kernels resolved for `platform` and rows of at most `longest`
    tokens (logging why when "auto" falls back to the reference, or that a Pallas kernel runs
    interpreted on CPU), its remat policy checked there."""
    note = kernels.setup_note(model_config.attention_backend, platform, longest,
                              **model_config.attention_needs)
    if note and jax.process_index() == 0:
        logger.info(note)
    model_config = model_config.for_platform(platform, longest)
    remat.check_platform(model_config.remat, platform)
    return model_config




def _loss_backend(asked: str, platform: str, vocab_size: int, mesh: jax.sharding.Mesh,
                  rules: Any) -> str:
    """loss_backend "auto" keeps the reference where the mesh splits the vocabulary (a tensor
    axis): the fused kernel takes the whole table on every device, so it would gather it and
    repeat the output layer on each of the axis's devices, where XLA splits the logits. Other
    values stay (ModelConfig.for_platform resolves "auto")."""
    if asked != "auto" or loss_backend_for(platform, vocab_size) != "fused":
        return asked
    axes = nn.logical_to_mesh_axes(("vocab",), rules)[0]
    names = (axes,) if isinstance(axes, str) else tuple(axes or ())
    if all(mesh.shape[name] == 1 for name in names):
        return asked
    if jax.process_index() == 0:
        logger.info("loss_backend='auto': the reference output layer and loss, since the mesh "
                    "splits the vocabulary over %s (the fused kernel takes the whole table)",
                    "x".join(names))
    return "reference"


def _pretrained_model_values(
    folder: str, model_values: dict[str, Any], data: Data
) -> dict[str, Any]:
    """The model section of a run that starts from the pretrained folder's architecture."""
    from tfm.interop import hf

    pretrained = hf.config_from_hf(hf.read_config(folder))
    family = family_of(pretrained)
    if family.name != data.mode:
        raise ConfigError(
            f"init.pretrained={folder!r} holds a {family.name} model but the data is for a "
            f"{data.mode} task"
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



def required_lengths(experiment: Experiment) -> list[tuple[int, str]]:
    """(positions, what needs them) for every sequence the run builds: training rows, eval
    rows of each split, eval decoding (prompt or source plus generated tokens) and the
    `generate` section's output (its prompt comes later: `check_prompt_lengths`)."""
    data, reads_source = experiment.data, experiment.family.reads_source
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
        if reads_source:
            extra = experiment.eval.extra_len
            needs.append((width, f"eval decoding sources of split {split!r}"))
            needs.append((width + extra + 1, f"eval decoding of split {split!r} (source length "
                                             f"{width} + eval.extra_len={extra} + bos)"))
        else:
            new = max(len(data.tokenizer.encode(t)) for t in targets) + 2
            needs.append((width + new, f"eval decoding of split {split!r} (prompt {width} + "
                                       f"{new} new tokens)"))
    max_new = experiment.generate.decode.max_new_tokens
    if not reads_source or experiment.generate.decode.method != "beam":
        bos = 1 if reads_source else 2  # a source: bos; a prompt: bos plus a prompt of >= 1
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
