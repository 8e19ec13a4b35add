"""The shared skeleton of every experiment config: all sections with their defaults.

Every field exists here, so any of them can be overridden from the command line
(`--config.model.num_kv_heads=2`); optional fields are typed placeholders, not bare None.
"""

from __future__ import annotations

import dataclasses
import typing

import ml_collections
from ml_collections import config_dict

from tfm.data.config import DataConfig
from tfm.nn.config import ModelConfig
from tfm.training.config import GENERATE_DEFAULTS, EvalConfig, TrainConfig
from tfm.training.optim import DEFAULTS as OPTIMIZER_DEFAULTS

_OPTIONAL_TYPES = {"int": int, "float": float, "str": str, "tuple": tuple, "bool": bool}


def _placeholder(annotation: str) -> typing.Any:
    """A typed None for an `X | None` annotation, so the field stays overridable."""
    base = annotation.replace(" ", "").split("|")[0].split("[")[0]
    return config_dict.placeholder(_OPTIONAL_TYPES.get(base, object))


def _dataclass_section(cls: type) -> ml_collections.ConfigDict:
    section = ml_collections.ConfigDict()
    for field in dataclasses.fields(cls):
        value = field.default
        section[field.name] = _placeholder(str(field.type)) if value is None else value
    return section


def _dict_section(defaults: dict, types: dict | None = None) -> ml_collections.ConfigDict:
    types = types or {}
    section = ml_collections.ConfigDict()
    for key, value in defaults.items():
        section[key] = config_dict.placeholder(types.get(key, object)) if value is None else value
    return section


def base_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.model = _dataclass_section(ModelConfig)
    config.model.vocab_size = config_dict.placeholder(int)  # filled in from the tokenizer
    # A policy name or the old True / False: untyped, so that both override it.
    config.model.remat = config_dict.FieldReference("none", field_type=object)
    config.data = _dataclass_section(DataConfig)
    config.optimizer = _dict_section(
        OPTIMIZER_DEFAULTS,
        dict(schedule=str, learning_rate=float, total_steps=int, b1=float, b2=float, eps=float),
    )
    config.train = _dataclass_section(TrainConfig)
    config.eval = _dataclass_section(EvalConfig)
    config.generate = _dict_section(GENERATE_DEFAULTS)
    # init.pretrained: a Hugging Face model folder (tfm.interop.hf) to start training from;
    # its architecture replaces config.model except the implementation fields (dtype,
    # param_dtype, scan_layers, remat, attention_backend). A workdir checkpoint wins on resume.
    # init.checkpoint: a tfm workdir whose checkpoint (init.checkpoint_step, None = the latest)
    # gives the first state's params, with a fresh optimizer and step 0: fine-tune a trained
    # model, e.g. at a longer context with a RoPE scaling (its model must be this run's, the
    # fields of tfm.training.checkpoint.EVAL_TIME aside).
    config.init = ml_collections.ConfigDict(dict(
        pretrained=config_dict.placeholder(str), checkpoint=config_dict.placeholder(str),
        checkpoint_step=config_dict.placeholder(int)))
    config.mesh = ml_collections.ConfigDict(dict(data=-1, fsdp=1, context=1, tensor=1))
    # (("embed", None), ...) overrides tfm.parallel.sharding's defaults
    config.logical_axis_rules = ()
    config.distributed = ml_collections.ConfigDict(
        dict(enabled="auto", coordinator_address="", num_processes=0, process_id=-1)
    )
    return config


def apply_variants(config: ml_collections.ConfigDict, arg: str | None, variants: dict) -> None:
    """Applies `arg`, a comma-separated list of variant names (`rope,runlocal`), to `config`.

    `variants` maps a name to a function that edits the config; every position scheme is also
    a variant (sets model.position_scheme). Unknown names raise, listing what is allowed.
    """
    from tfm.nn.positions import POSITION_SCHEMES

    for name in filter(None, (arg or "").split(",")):
        if name in POSITION_SCHEMES:
            config.model.position_scheme = name
        elif name in variants:
            variants[name](config)
        else:
            allowed = sorted(variants) + list(POSITION_SCHEMES)
            raise ValueError(
                f"config variant {name!r} is unknown; choose from: {', '.join(allowed)}"
            )


def position_sweep(arg: str | None = None) -> list[dict]:
    """Every position scheme (`model.position_scheme`), one run each; when the sweep's ARG names
    schemes (`reverse,rope,alibi`), just those (a pilot or a rerun of a few)."""
    from tfm.nn.positions import POSITION_SCHEMES
    from tfm.sweeps.sweep import sweep

    names = set(filter(None, (arg or "").split(",")))
    return sweep("model.position_scheme", [s for s in POSITION_SCHEMES if s in names]
                 or POSITION_SCHEMES)


SWEEP_TASKS = ("copy", "reverse", "addition")


def synthetic_sweep(arg: str | None) -> list[dict]:
    """The length-generalisation sweep of the synthetic configs: every position scheme (or those
    named in ARG), on the task named in ARG, or on copy, reverse and addition when ARG names none.
    The sweep's ARG is also the config's, so `reverse,runlocal` applies to every run."""
    from tfm.data.synthetic import TASKS
    from tfm.sweeps.sweep import product, sweep

    names = set(filter(None, (arg or "").split(",")))
    if names & set(TASKS):
        return position_sweep(arg)
    return product(sweep("data.task", SWEEP_TASKS), position_sweep(arg))


def synthetic_config(mode: str, seq_len: int, num_steps: int) -> ml_collections.ConfigDict:
    """What the synthetic-task configs share: train on lengths 1-12 ("validation" holds unseen
    examples of those lengths), test on 13-24 ("test") and 25-48 ("test_long"), length
    generalisation (Kazemnejad et al. 2023); a small pre-LN model without dropout; AdamW with a
    cosine schedule over the run's train.num_steps; evaluation and checkpoints halfway and at
    the end, keeping the best exact match. Eval rows fit each split's longest example whatever
    seq_len (which only bounds training rows) says; the default model.max_len=512 covers the
    longest (addition, 25-48 digits: a prompt of 99 tokens and 50 answer tokens), so learned
    positions are evaluated there too, with table rows training never reached."""
    config = base_config()
    config.data.update(
        kind="synthetic", mode=mode, task="reverse", train_lengths=(1, 12), eval_lengths=(13, 24),
        long_eval_lengths=(25, 48), num_train_examples=50_000, num_eval_examples=512,
        seq_len=seq_len, batch_size=64, eval_batch_size=128, packing=False,
    )
    config.model.update(d_model=64, num_heads=4, d_ff=256, dropout_rate=0.0, norm_placement="pre")
    config.optimizer.update(name="adamw", schedule="cosine", learning_rate=3e-3,
                            warmup_steps=100, grad_clip_norm=1.0)
    config.train.update(num_steps=num_steps, log_every=100, eval_every=num_steps // 2,
                        checkpoint_every=num_steps // 2, keep_best_metric="eval_exact_match",
                        best_mode="max")
    return config


def synthetic_variants() -> dict:
    """Variants of the synthetic-task configs: one per task, `runlocal` (60 steps) and `short`
    (half the steps)."""
    from tfm.data.synthetic import TASKS

    def runlocal(c):
        c.data.num_train_examples = 2_000
        c.data.num_eval_examples = 64
        c.optimizer.warmup_steps = 10
        c.train.update(num_steps=60, log_every=20, eval_every=60, checkpoint_every=60)
        c.eval.max_generation_examples = 64

    def short(c):
        """The CPU budget of the committed length-generalisation results: half the steps, one
        evaluation at the end, 256 decoded examples per split."""
        steps = c.train.num_steps // 2
        c.train.update(num_steps=steps, eval_every=steps, checkpoint_every=steps)
        c.eval.max_generation_examples = 256

    variants = {"runlocal": runlocal, "short": short}
    for task in TASKS:
        variants[task] = lambda c, task=task: setattr(c.data, "task", task)
    return variants
