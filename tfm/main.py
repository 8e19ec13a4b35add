"""The command line behind ./launch.sh: `python -m tfm.main COMMAND --config=FILE[:ARG] [...]`.

Commands: train (resumes from the workdir's latest checkpoint), eval (metrics of a checkpoint),
generate (text in, text out), average (mean of the last K checkpoints into a new workdir),
compile (the train step compiled for a machine this one need not be), lm_eval (tasks of
EleutherAI's lm-evaluation-harness on a checkpoint). Any config field can be
overridden: --config.model.position_scheme=rope. eval, generate and average on a workdir use the
config its training saved (WORKDIR/config.json, read by tfm/saved_config.py); `COMMAND --help`
prints one command's options (train CONFIG --help: also the config's fields).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

from tfm import saved_config

COMMANDS = ("train", "eval", "generate", "average", "compile", "lm_eval")
# Commands on a trained run: they read the config it saved (WORKDIR/config.json).
ON_A_RUN = ("eval", "generate", "average", "lm_eval")
SAVED_CONFIG = Path(__file__).resolve().parent / "saved_config.py"
HELP_FLAGS = ("-h", "--help", "--helpshort", "--helpfull")
# Overrides that do not change what is trained stay out of the default workdir's name.
NOT_IN_WORKDIR_NAME = (
    "generate.", "eval.", "train.progress_bar", "train.log_every", "train.tracker",
    "train.compilation_cache_dir", "train.profile_start", "train.profile_steps",
    "train.async_checkpoints",
)
WORKDIR_NAME_LIMIT = 100
WORKDIR_RULE = (
    "default workdir: workdirs/<config>[_<arg>][+<field>=<value>...], one +field=value per "
    "--config override in command-line order (field: the last name, or the dotted path when two "
    "share it; a path value: its file stem; other characters than A-Za-z0-9._- become _; over "
    f"{WORKDIR_NAME_LIMIT} characters: cut, plus an 8-digit hash); overrides of generate.*, "
    "eval.*, train.progress_bar, log_every, tracker*, compilation_cache_dir, profile_* and "
    "async_checkpoints are left out. --workdir DIR to continue a run under other settings"
)

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config: configs/FILE.py[:ARG]; override fields with --config.x=y"
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "the run's directory (checkpoints, metrics, config.json); default: "
    "workdirs/<config>[_<arg>][+<field>=<value>...] (./launch.sh train --help)"
)
_PROMPTS = flags.DEFINE_multi_string("prompt", [], "generate: an input text (repeatable)")
_STEP = flags.DEFINE_integer(
    "step", None, "eval/generate/lm_eval: checkpoint step (default: latest)"
)
_EVAL_SEQ_LEN = flags.DEFINE_list(
    "eval_seq_len", [], "eval: row lengths to evaluate at (64,128,...); results are also merged "
    "into WORKDIR/eval_seq_len.json"
)
_LAST_K = flags.DEFINE_integer("last_k", 5, "average: how many of the newest checkpoints")
_OUTPUT = flags.DEFINE_string("output", None, "average: the new workdir for the averaged model")
_PRETRAINED = flags.DEFINE_string(
    "pretrained", None, "generate: a Hugging Face model folder instead of a config and workdir"
)
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 32, "generate --pretrained: tokens per prompt")
_TARGET = flags.DEFINE_string(
    "target", None, "compile: the machine to compile for (./launch.sh compile --help lists them: "
    "tfm.training.compile_report.TARGETS)"
)
_JSON = flags.DEFINE_string("json", None, "compile: also write the report to this JSON file")
_LARGEST_BATCH = flags.DEFINE_bool(
    "largest_batch", False, "compile: find the largest data.batch_size whose train step fits the "
    "target's memory (a few compiles) and report that step")
_BREAKDOWN = flags.DEFINE_bool(
    "breakdown", False, "compile: also list where the step's bytes and FLOPs go (attention, FFN, "
    "norms, embedding/loss, optimizer, collectives; tfm.training.hlo_breakdown)")
_DECODE_ONLY = flags.DEFINE_bool(
    "decode_only", False, "compile: the decode loop alone, without the train step (its memory "
    "per chip and cost; for a change to decoding)")
_TRAIN_ONLY = flags.DEFINE_bool(
    "train_only", False, "compile: the train step alone, without the decode loop (for a change "
    "that cannot touch decoding)")
_TASKS = flags.DEFINE_list(
    "tasks", [], "lm_eval: the harness's task names (lambada_openai,hellaswag,...)"
)
_LIMIT = flags.DEFINE_integer("limit", None, "lm_eval: at most this many examples per task")
_NUM_FEWSHOT = flags.DEFINE_integer(
    "num_fewshot", None, "lm_eval: examples in each prompt (default: the task's own)"
)
_INCLUDE_PATH = flags.DEFINE_string(
    "include_path", None, "lm_eval: a folder of task YAML files of your own "
    "(e.g. tests/fixtures/lm_eval)"
)
_PROMPT_IDS = flags.DEFINE_bool(
    "prompt_ids", False, "generate --pretrained: prompts and outputs are space-separated ids"
)


def config_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """The (field path, value as typed) of each --config.a.b=value (or --config.a.b value)
    override in `argv`, in command-line order; a field given twice keeps its place and its last
    value, as absl does."""
    overrides: dict[str, str] = {}
    for index, arg in enumerate(argv):
        if not arg.startswith("--config."):
            continue
        name, equals, value = arg[2:].partition("=")
        if not equals:  # --config.a.b value, or a switch: --config.train.progress_bar
            following = argv[index + 1] if index + 1 < len(argv) else ""
            value = following if following and not following.startswith("-") else "true"
        overrides[name.split(".", 1)[1]] = value
    return list(overrides.items())


def _name_value(value: str) -> str:
    """An override's value as it appears in a workdir name: a path's file stem, then only
    A-Za-z0-9._- (others become _)."""
    if "/" in value or re.fullmatch(r"[^/]+\.[A-Za-z][A-Za-z0-9]*", value):
        value = Path(value).stem or value
    return re.sub(r"[^A-Za-z0-9._-]+", "_", value).strip("_") or "_"


def default_workdir(config_arg: str, overrides: list[tuple[str, str]] = ()) -> Path:
    """workdirs/<config stem>[_<arg>] plus +<field>=<value> for each override that changes what
    is trained (see WORKDIR_RULE), e.g. workdirs/char_lm_runlocal+position_scheme=alibi."""
    path, _, variant = config_arg.partition(":")
    name = Path(path).stem + (f"_{variant.replace(',', '_')}" if variant else "")
    named = [(field, value) for field, value in overrides
             if not field.startswith(NOT_IN_WORKDIR_NAME)]
    last_names = [field.rsplit(".", 1)[-1] for field, _ in named]
    for (field, value), last in zip(named, last_names, strict=True):
        shown = field if last_names.count(last) > 1 else last
        name += f"+{shown}={_name_value(value)}"
    if len(name) > WORKDIR_NAME_LIMIT:
        digest = hashlib.sha256(
            "\n".join(f"{field}={value}" for field, value in named).encode()).hexdigest()[:8]
        name = f"{name[:WORKDIR_NAME_LIMIT - 9]}-{digest}"
    return Path("workdirs") / name


def main(argv: list[str]) -> None:
    try:
        _main(argv)
    except app.UsageError as error:  # one line and where to look, not absl's flag list
        _usage_error(str(error), argv[1] if len(argv) > 1 else None)


def _usage_error(message: str, command: str | None) -> None:
    where = f"tfm.main {command}" if command in COMMANDS else "tfm.main"
    sys.stderr.write(f"{where}: {message}\n{_see_help(command)}\n")
    sys.exit(2)


def _see_help(command: str | None) -> str:
    return f"see ./launch.sh {command if command in COMMANDS else 'COMMAND'} --help"


def _unexpected_arguments(argv: list[str]) -> str:
    """The usage error for positional arguments after the command, e.g. a value given to a
    switch: `--prompt_ids "5 6 7"`."""
    extra = argv[2:]
    raw = sys.argv
    position = raw.index(extra[0]) if extra[0] in raw else 0
    before = raw[position - 1] if position > 0 else ""
    name = before[2:] if before.startswith("--") and "=" not in before else ""
    if name in flags.FLAGS and flags.FLAGS[name].boolean:
        return (f"--{name} is a switch and takes no value (--{name} or --no{name}); got "
                f"{extra[0]!r} after it")
    return f"unexpected argument {extra[0]!r} after the command {argv[1]!r}"


def _main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[1] not in COMMANDS:
        raise app.UsageError(
            f"expected one command, one of: {', '.join(COMMANDS)}; got {argv[1:] or 'none'}"
        )
    if len(argv) > 2:
        raise app.UsageError(_unexpected_arguments(argv))
    if _PRETRAINED.value is not None:
        if argv[1] != "generate":
            raise app.UsageError("--pretrained=DIR goes with generate; to fine-tune, use "
                                 "train CONFIG --config.init.pretrained=DIR")
        _generate_pretrained(_PRETRAINED.value)
        return
    if _CONFIG.value is None:
        raise app.UsageError("a CONFIG is required: ./launch.sh COMMAND configs/FILE.py[:ARG]")
    command = argv[1]
    config_arg = flags.FLAGS["config"].config_filename
    config_file = config_arg.split(":", 1)[0]
    if not Path(config_file).is_file():  # config_flags defers this error to the first use
        raise app.UsageError(f"config file {config_file!r} not found (e.g. configs/char_lm.py)")
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    workdir = (Path(_WORKDIR.value) if _WORKDIR.value
               else default_workdir(config_arg, config_overrides(sys.argv)))

    if command == "average" and not _OUTPUT.value:
        raise app.UsageError("average needs --output=NEW_WORKDIR")
    if command == "compile" and not _TARGET.value:
        raise app.UsageError("compile needs --target=NAME (e.g. v5e-8)")
    if command == "lm_eval" and not _TASKS.value:
        raise app.UsageError("lm_eval needs --tasks a,b (the harness's task names)")
    if _LARGEST_BATCH.value and command != "compile":
        raise app.UsageError("--largest_batch goes with compile --target=NAME")

    # Heavy imports after flag parsing, so usage errors are instant.
    from tfm.checks import ConfigError
    from tfm.data.builders import DataError
    from tfm.interop.hf import UnreadableCheckpoint, UnsupportedCheckpoint
    from tfm.training.checkpoint import CheckpointError, ConfigMismatchError
    from tfm.training.evaluate import PromptError
    from tfm.training.state import TrainingError

    # UnreadableCheckpoint, UnsupportedCheckpoint: a bad config.init.pretrained folder
    expected = (ConfigError, DataError, CheckpointError, ConfigMismatchError, TrainingError,
                FileNotFoundError, FileExistsError, PromptError, UnreadableCheckpoint,
                UnsupportedCheckpoint)
    try:
        _run(command, _CONFIG.value, workdir, config_arg)
    except expected as error:  # a bad value or file, not a bug: one line, no traceback
        sys.stderr.write(f"tfm.main {command}: {type(error).__name__}: {error}\n")
        sys.exit(1)
    except OSError as error:  # read-only or full filesystem, permission denied: not a bug either
        sys.stderr.write(f"tfm.main {command}: {os_error_line(error)}\n")
        sys.exit(1)


def _read_prompts() -> list[str]:
    prompts = _PROMPTS.value or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:  # a usage error, but without absl's 20 lines of flag help
        sys.stderr.write("tfm.main generate: no prompt: give --prompt TEXT (repeatable) or "
                         "non-empty lines on stdin\n")
        sys.exit(2)
    return prompts


def _generate_pretrained(directory: str) -> None:
    from tfm.interop import hf

    prompts = _read_prompts()
    try:
        outputs = hf.generate_pretrained(
            directory, prompts, max_new_tokens=_MAX_NEW.value, prompt_ids=_PROMPT_IDS.value
        )
    except (hf.UnsupportedCheckpoint, hf.UnreadableCheckpoint, FileNotFoundError) as error:
        sys.stderr.write(f"tfm.main generate: {type(error).__name__}: {error}\n")
        sys.exit(1)
    for prompt, output in zip(prompts, outputs, strict=True):
        print(f"{prompt}\t->\t{output}")


def os_error_line(error: OSError) -> str:
    """One line naming the operation, the path and the reason of an OSError, e.g.
    "PermissionError: cannot mkdir /runs/x: Permission denied". The operation is the innermost
    Python function the error passed through (mkdir, open, write_text, rename, ...)."""
    frames = traceback.extract_tb(error.__traceback__)
    operation = frames[-1].name if frames else "access"
    paths = [os.fspath(p) for p in (error.filename, error.filename2) if p is not None]
    where = " -> ".join(paths) if paths else "a file"
    reason = error.strerror or str(error)
    return f"{type(error).__name__}: cannot {operation} {where}: {reason}"


def _run(command: str, config: Any, workdir: Path, config_arg: str) -> None:
    from tfm.training import checkpoint, evaluate, experiment, state, train

    if command == "train":
        if os.environ.get("TFM_PROCESS_ID", "0") == "0":  # jax.distributed is not started yet
            print(f"workdir: {workdir}", flush=True)
        final = train.train_and_evaluate(config, workdir)
        _print(json.dumps({"workdir": str(workdir), **final}, indent=1, default=str))
        if final.get("stopped_by"):  # saved and stopped early: not a finished run (128 + signum)
            raise SystemExit(128 + signal.Signals[final["stopped_by"]].value)
    elif command == "eval" and _EVAL_SEQ_LEN.value:
        _print(json.dumps(evaluate_lengths(config, workdir, _EVAL_SEQ_LEN.value, _STEP.value),
                          indent=1))
    elif command == "eval":
        results = evaluate.evaluate_checkpoint(config, workdir, _STEP.value)
        _print(json.dumps(results, indent=1))
    elif command == "compile":
        _compile(config, workdir)
    elif command == "lm_eval":
        _lm_eval(config, workdir)
    elif command == "generate":
        prompts = _read_prompts()
        outputs = evaluate.generate_from_checkpoint(config, workdir, prompts, _STEP.value)
        for prompt, output in zip(prompts, outputs, strict=True):
            _print(f"{prompt}\t->\t{output}")
    else:
        abstract, _ = state.state_shardings(experiment.setup(config, workdir))
        step = checkpoint.write_averaged_checkpoint(
            workdir / "checkpoints", Path(_OUTPUT.value) / "checkpoints", abstract,
            last_k=_LAST_K.value,
        )
        saved = workdir / "config.json"
        if saved.is_file():  # the averaged run is evaluated with the config it was trained with
            (Path(_OUTPUT.value) / "config.json").write_text(saved.read_text())
        config_word = "" if saved.is_file() else f"{config_arg} "
        print(f"averaged the last {_LAST_K.value} checkpoints of {workdir} into "
              f"{_OUTPUT.value} (step {step}); evaluate with: ./launch.sh eval {config_word}"
              f"--workdir {_OUTPUT.value}")


def _lm_eval(config: Any, workdir: Path) -> None:
    """The harness's tasks on the run's checkpoint; the results in WORKDIR/lm_eval/."""
    try:
        from tfm.interop import lm_eval
    except ImportError as error:
        sys.stderr.write(f"tfm.main lm_eval: {error}\n")
        sys.exit(1)
    model = lm_eval.TfmLM(workdir=str(workdir), step=_STEP.value, run_config=config)
    table = lm_eval.evaluate(
        model, _TASKS.value, workdir / "lm_eval", limit=_LIMIT.value,
        num_fewshot=_NUM_FEWSHOT.value, include_path=_INCLUDE_PATH.value,
    )
    _print(table)
    _print(f"results: {workdir / 'lm_eval' / 'results.json'}")


def _compile(config: Any, workdir: Path) -> None:
    """Compiles the train step for --target and prints the report; exits 1 when it does not
    fit the chip's memory."""
    from tfm.training import compile_report

    text, failure = compile_report.run(config, workdir, _TARGET.value, _JSON.value,
                                       largest_batch=_LARGEST_BATCH.value,
                                       breakdown=_BREAKDOWN.value,
                                       decode_only=_DECODE_ONLY.value,
                                       train_only=_TRAIN_ONLY.value)
    if text:
        _print(text)
    if failure:
        sys.stderr.write(f"tfm.main compile: {failure}\n")
        sys.exit(1)


def evaluate_lengths(
    config: Any, workdir: Path, lengths: list[str], step: int | None = None
) -> dict[str, dict[str, Any]]:
    """Eval metrics of a checkpoint with the eval rows cut to each length (data.eval_seq_len;
    a text LM's eval text is cut into windows of that length), e.g. a model trained at context
    128 evaluated at 64..1024. Learned positions past model.max_len are "n/a" with the reason.
    Returns {length: metrics}, also merged into WORKDIR/eval_seq_len.json."""
    import jax

    from tfm.nn import positions
    from tfm.training.evaluate import evaluate_checkpoint

    if not all(text.isdigit() and int(text) > 0 for text in lengths):
        raise app.UsageError(f"--eval_seq_len takes whole numbers >= 1; got {','.join(lengths)}")
    results: dict[str, dict[str, Any]] = {}
    for length in map(int, lengths):
        scheme, max_len = config.model.position_scheme, config.model.max_len
        if positions.SCHEMES[scheme].bounded_by_max_len and length > max_len:
            results[str(length)] = {"n/a": f"position_scheme={scheme!r} has no positions past "
                                            f"model.max_len={max_len}"}
            continue
        with config.unlocked():
            variant = config.copy_and_resolve_references()
        variant.data.eval_seq_len = length
        results[str(length)] = evaluate_checkpoint(variant, workdir, step)
    if jax.process_index() == 0:
        path = workdir / "eval_seq_len.json"
        saved = json.loads(path.read_text()) if path.exists() else {}
        path.write_text(json.dumps({**saved, **results}, indent=1) + "\n")
    return results


def _print(text: str) -> None:
    """Prints on process 0 only: N processes of one run write one console."""
    import jax

    if jax.process_index() == 0:
        print(text)


def _config_overrides(argv: list[str]) -> list[str]:
    """The field paths of the --config.a.b=value overrides in `argv` ("a.b")."""
    names = [arg.split("=", 1)[0].lstrip("-") for arg in argv]
    return [name.split(".", 1)[1] for name in names if name.startswith("config.")]


def _flag_error_line(error: Exception, argv: list[str]) -> str:
    """One readable line for a command-line error (no traceback)."""
    if isinstance(error, flags.Error):
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        # A failing config file comes with its traceback inside the message: keep the ends.
        return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"
    # ml_collections raises KeyError/AttributeError for an override of a missing field; the
    # message starts with the quoted name and may add "Did you mean ...?".
    message = error
    while isinstance(message, BaseException) and message.args:  # AttributeError(KeyError(str))
        message = message.args[0]
    lines = str(message).splitlines() or [""]
    paths = _config_overrides(argv)
    if not lines[0].startswith(("'", '"')):  # e.g. indexing into a number: model.d_model.x
        culprit = next((path for path in paths if path in lines[0]), None)
        return f"--config.{culprit}: {' '.join(lines)}" if culprit else " ".join(lines)
    missing = lines[0].strip("\"' ")
    hint = " ".join(line.strip() for line in lines[1:])
    culprit = next((path for path in paths if missing in path.split(".")), None)
    where = f"--config.{culprit}: " if culprit else ""
    return (
        f"{where}the config has no field {missing!r}{'; ' + hint if hint else ''} "
        "(every field is listed in configs/base.py and the config file)"
    )


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing that reports bad flags and unknown --config.x overrides in one line
    (exit status 2) instead of a traceback."""
    try:
        return flags.FLAGS(argv)
    except (flags.Error, KeyError, AttributeError) as error:
        sys.stderr.write(f"tfm.main: {_flag_error_line(error, argv)}\n")
        sys.stderr.write(_see_help(argv[1] if len(argv) > 1 else None) + "\n")
        sys.exit(2)


# ------------------------------------------------------------------ per-command help

# command: (usage, what it does, its flags as defined above)
COMMAND_HELP: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "train": (
        "./launch.sh train CONFIG[:ARG] [--workdir DIR] [--config.FIELD=VALUE ...] "
        "[--num_processes N] [--devices_per_process D]",
        "Trains CONFIG in DIR, resuming from DIR's latest checkpoint if there is one; writes "
        "DIR/config.json, which eval, generate and average read.",
        ("workdir",),
    ),
    "eval": (
        "./launch.sh eval [CONFIG[:ARG]] [--workdir DIR] [--step N] [--eval_seq_len 64,128] "
        "[--config.FIELD=VALUE ...]",
        "Metrics on the eval splits from DIR's latest checkpoint (JSON on stdout).",
        ("workdir", "step", "eval_seq_len"),
    ),
    "generate": (
        "./launch.sh generate [CONFIG[:ARG]] [--workdir DIR] --prompt TEXT [--prompt TEXT ...] "
        "[--step N] [--config.generate.FIELD=VALUE ...]\n"
        "       ./launch.sh generate --pretrained HF_DIR --prompt TEXT [--max_new_tokens N] "
        "[--prompt_ids]",
        "Text in, text out (prompt<TAB>-><TAB>output per line) from DIR's checkpoint; prompts "
        "from --prompt or, without it, one per line of stdin.",
        ("workdir", "prompt", "step", "pretrained", "max_new_tokens", "prompt_ids"),
    ),
    "average": (
        "./launch.sh average [CONFIG[:ARG]] [--workdir DIR] --output NEW_DIR [--last_k K]",
        "Averages the parameters of DIR's last K checkpoints into a new workdir (with DIR's "
        "config.json, so `./launch.sh eval --workdir NEW_DIR` evaluates it).",
        ("workdir", "last_k", "output"),
    ),
    "compile": (
        "./launch.sh compile CONFIG[:ARG] --target NAME [--json FILE] [--largest_batch] "
        "[--breakdown] [--decode_only | --train_only] [--config.FIELD=VALUE ...]",
        "Compiles CONFIG's train step (and decode loop) for a machine this one need not be; "
        "prints per-chip memory, FLOPs, traffic and roofline MFU; exits 1 if it does not fit. "
        'TPU targets need libtpu (pip install -e ".[tpu]"), GPU ones the CUDA plugin '
        '(pip install -e ".[gpu]").',
        ("target", "json", "largest_batch", "breakdown", "decode_only", "train_only"),
    ),
    "lm_eval": (
        "./launch.sh lm_eval [CONFIG[:ARG]] [--workdir DIR] --tasks a,b [--limit N] "
        "[--num_fewshot K] [--include_path TASK_DIR] [--step N]",
        "Runs EleutherAI's lm-evaluation-harness tasks on DIR's checkpoint (the model `tfm`, "
        'tfm/interop/lm_eval/; pip install -e ".[eval]"); prints the harness\'s table and '
        "writes DIR/lm_eval/results.json. Tasks download their data from the Hugging Face Hub "
        "unless they are local (--include_path).",
        ("workdir", "tasks", "limit", "num_fewshot", "include_path", "step"),
    ),
}
_ON_A_RUN_NOTE = (
    "CONFIG: without it, the config saved by training in DIR/config.json; with it, CONFIG only "
    "names the default DIR, and DIR/config.json, if there, still wins. --config.FIELD=VALUE "
    "overrides either."
)


def command_help(command: str) -> str:
    """The usage and options of one command (its flags' help strings as defined above)."""
    usage, description, names = COMMAND_HELP[command]
    lines = [f"usage: {usage}", "", description]
    if command in ON_A_RUN:
        lines.append(_ON_A_RUN_NOTE)
    lines += ["", "options:"]
    for name in names:
        lines.append(f"  --{name:<16} {flags.FLAGS[name].help}")
    lines.append("  --config.FIELD=VALUE  override a config field (e.g. "
                 "--config.model.position_scheme=rope)")
    if command == "train":
        lines += ["  --num_processes N     start N local processes joined by jax.distributed",
                  "  --devices_per_process D  simulated CPU devices per process (default 1)",
                  "", WORKDIR_RULE + ".",
                  "./launch.sh train CONFIG --help also lists CONFIG's fields and values."]
    if command == "compile":
        from tfm.training.compile_report import TARGETS

        lines += ["", "targets: " + ", ".join(TARGETS)]
    return "\n".join(lines)


def _help(argv: list[str]) -> None:
    """`COMMAND --help`: the command's usage and options; with a config, its fields."""
    command = argv[1] if len(argv) > 1 else None
    if command not in COMMAND_HELP:
        _usage_error(f"no help for {command!r}; commands: {', '.join(COMMANDS)}", None)
    print(command_help(command))
    if _CONFIG.value is not None:
        from tfm.config_help import describe

        print(f"\nfields of {flags.FLAGS['config'].config_filename} (with the overrides given):")
        print(describe(_CONFIG.value))


def _flag_value(argv: list[str], name: str) -> tuple[str | None, list[str]]:
    """The value of --name=V or --name V in argv, and argv without it."""
    for index, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1], argv[:index] + argv[index + 1:]
        if arg == f"--{name}" and index + 1 < len(argv):
            return argv[index + 1], argv[:index] + argv[index + 2:]
    return None, argv


def with_saved_config(argv: list[str]) -> list[str]:
    """argv of eval, generate or average with the run's saved config: --config= the workdir's
    config.json (through tfm/saved_config.py) and an explicit --workdir, when the workdir (given,
    or CONFIG's default) has one; argv unchanged when it has none but CONFIG is given. Exits with
    one line when neither CONFIG nor a saved config is there."""
    command = argv[1]
    config_arg, rest = _flag_value(argv, "config")
    workdir_arg, _ = _flag_value(argv, "workdir")
    if workdir_arg is None and config_arg is None:
        _usage_error("give CONFIG or --workdir DIR (the directory of a training run)", command)
    workdir = Path(workdir_arg) if workdir_arg else default_workdir(
        config_arg, config_overrides(argv))
    saved = saved_config.saved_config_path(workdir)
    if not saved.is_file():
        if config_arg is not None:  # e.g. a run from before config.json: CONFIG as given
            return argv
        sys.stderr.write(f"tfm.main {command}: {workdir} has no {saved.name}: no training run "
                         "there; train one, or give the run's CONFIG\n")
        sys.exit(1)
    given = f" (instead of {config_arg})" if config_arg else ""
    overridden = "; --config flags override it" if config_overrides(argv) else ""
    sys.stderr.write(f"{command}: using the run's saved config {saved}{given}{overridden}\n")
    _, rest = _flag_value(rest, "workdir")
    # --config= before its --config.x=y overrides: config_flags defines those flags only once
    # it has read the config file.
    return [*rest[:2], f"--config={SAVED_CONFIG}:{workdir}", f"--workdir={workdir}", *rest[2:]]


def no_tpu_startup_noise() -> None:
    """On a host without TPU chips, libtpu (installed for `compile`) prints its start-up errors
    (unexpected worker hostname from TPU_WORKER_HOSTNAMES, host bounds) when it loads: tell it
    it is one host. Before jax starts; values set by the user stay."""
    import glob

    google_pci = "0x1ae0"  # TPU chips are Google PCI devices (as jax's hardware_utils checks)
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            if Path(vendor).read_text().strip() == google_pci:
                return
        except OSError:
            continue
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")


def run() -> None:
    argv = list(sys.argv)
    if any(arg in HELP_FLAGS for arg in argv[1:]):
        argv = [arg for arg in argv if arg not in HELP_FLAGS]
        app.run(_help, argv=argv, flags_parser=parse_flags)
    no_tpu_startup_noise()
    if len(argv) > 1 and argv[1] in ON_A_RUN and not any(
            arg.startswith("--pretrained") for arg in argv):
        argv = with_saved_config(argv)
    app.run(main, argv=argv, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
