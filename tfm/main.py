"""The command line behind ./launch.sh: `python -m tfm.main COMMAND --config=FILE[:ARG] [...]`.

Commands: train (resumes from the workdir's latest checkpoint), eval (metrics of a checkpoint),
generate (text in, text out), average (mean of the last K checkpoints into a new workdir).
Any config field can be overridden: --config.model.position_scheme=rope.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

COMMANDS = ("train", "eval", "generate", "average", "compile")

_CONFIG = config_flags.DEFINE_config_file(
    "config", None, "Experiment config: configs/FILE.py[:ARG]; override fields with --config.x=y"
)
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory (checkpoints, metrics); default workdirs/<config>[_<arg>]"
)
_PROMPTS = flags.DEFINE_multi_string("prompt", [], "generate: an input text (repeatable)")
_STEP = flags.DEFINE_integer("step", None, "eval/generate: checkpoint step (default: latest)")
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
    "target", None, "compile: the machine to compile for (v5e-8, v4-8, v5p-8, v6e-8, v5e-256, "
    "cpu; see tfm.training.compile_report.TARGETS)"
)
_JSON = flags.DEFINE_string("json", None, "compile: also write the report to this JSON file")
_LARGEST_BATCH = flags.DEFINE_bool(
    "largest_batch", False, "compile: find the largest data.batch_size whose train step fits the "
    "target's memory (a few compiles) and report that step")
_PROMPT_IDS = flags.DEFINE_bool(
    "prompt_ids", False, "generate --pretrained: prompts and outputs are space-separated ids"
)


def default_workdir(config_arg: str) -> Path:
    path, _, variant = config_arg.partition(":")
    name = Path(path).stem + (f"_{variant.replace(',', '_')}" if variant else "")
    return Path("workdirs") / name


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[1] not in COMMANDS:
        raise app.UsageError(
            f"expected one command, one of: {', '.join(COMMANDS)}; got {argv[1:] or 'none'}"
        )
    if _PRETRAINED.value is not None:
        if argv[1] != "generate":
            raise app.UsageError("--pretrained=DIR goes with generate; to fine-tune, use "
                                 "train CONFIG --config.init.pretrained=DIR")
        _generate_pretrained(_PRETRAINED.value)
        return
    if _CONFIG.value is None:
        raise app.UsageError("--config=configs/FILE.py[:ARG] is required")
    command = argv[1]
    config_arg = flags.FLAGS["config"].config_filename
    config_file = config_arg.split(":", 1)[0]
    if not Path(config_file).is_file():  # config_flags defers this error to the first use
        raise app.UsageError(f"config file {config_file!r} not found (e.g. configs/char_lm.py)")
    logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
    workdir = Path(_WORKDIR.value) if _WORKDIR.value else default_workdir(config_arg)

    if command == "average" and not _OUTPUT.value:
        raise app.UsageError("average needs --output=NEW_WORKDIR")
    if command == "compile" and not _TARGET.value:
        raise app.UsageError("compile needs --target=NAME (e.g. v5e-8)")
    if _LARGEST_BATCH.value and command != "compile":
        raise app.UsageError("--largest_batch goes with compile --target=NAME")

    # Heavy imports after flag parsing, so usage errors are instant.
    from tfm.checks import ConfigError
    from tfm.data.builders import DataError
    from tfm.interop.hf import UnreadableCheckpoint, UnsupportedCheckpoint
    from tfm.training.checkpoint import CheckpointError, ConfigMismatchError
    from tfm.training.evaluate import PromptError
    from tfm.training.experiment import TrainingError

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
    from tfm.training import checkpoint, evaluate, experiment, train

    if command == "train":
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
    elif command == "generate":
        prompts = _read_prompts()
        outputs = evaluate.generate_from_checkpoint(config, workdir, prompts, _STEP.value)
        for prompt, output in zip(prompts, outputs, strict=True):
            _print(f"{prompt}\t->\t{output}")
    else:
        abstract, _ = experiment.state_shardings(experiment.setup(config, workdir))
        step = checkpoint.write_averaged_checkpoint(
            workdir / "checkpoints", Path(_OUTPUT.value) / "checkpoints", abstract,
            last_k=_LAST_K.value,
        )
        print(f"averaged the last {_LAST_K.value} checkpoints of {workdir} into "
              f"{_OUTPUT.value} (step {step}); evaluate with: ./launch.sh eval {config_arg} "
              f"--workdir {_OUTPUT.value}")


def _compile(config: Any, workdir: Path) -> None:
    """Compiles the train step for --target and prints the report; exits 1 when it does not
    fit the chip's memory."""
    from tfm.training import compile_report

    text, failure = compile_report.run(config, workdir, _TARGET.value, _JSON.value,
                                       largest_batch=_LARGEST_BATCH.value)
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
        sys.stderr.write("usage: ./launch.sh COMMAND CONFIG[:ARG] [--config.FIELD=VALUE ...]; "
                         "./launch.sh --help for more\n")
        sys.exit(2)


def run() -> None:
    app.run(main, flags_parser=parse_flags)


if __name__ == "__main__":
    run()
