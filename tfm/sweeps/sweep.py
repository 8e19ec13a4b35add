"""Sweeps: many runs of one config, declared in the config file, run locally or on SLURM.

A config module may define `get_sweep(arg)` next to `get_config(arg)`; it returns the runs as a
list of override dicts (big_vision style), built with `product` and `zip_`:

    def get_sweep(arg):
        return product(
            sweep("model.position_scheme", ["sinusoidal", "rope", "alibi"]),
            sweep("train.seed", [0, 1, 2]),
        )

`./launch.sh sweep configs/X.py[:ARG] [--seeds 0,1,2] [--parallel N] [--dry_run] [--slurm
[--submit]] [--workdir ROOT]` trains every run with `./launch.sh train configs/X.py[:ARG]
--config.FIELD=VALUE ... --workdir ROOT/NAME` (a subprocess each, so one failure cannot take
the others down). NAME comes from the overrides (`position_scheme=rope,seed=0`). Each run
writes `ROOT/NAME/sweep_run.json` (status, command, error, wall time); the sweep writes
`ROOT/sweep.json` (every run) and is resumable: a run whose status is "done" with the same
command is read back, anything else runs again (training resumes from its checkpoint).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import importlib.util
import itertools
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
Overrides = dict[str, Any]
SEED_FIELD = "train.seed"
RUN_FILE = "sweep_run.json"
SWEEP_FILE = "sweep.json"


# ------------------------------------------------------------------------- declaring sweeps


def sweep(field: str, values: Iterable[Any]) -> list[Overrides]:
    """One field over `values`: sweep("train.seed", [0, 1]) -> [{"train.seed": 0}, {...: 1}]."""
    return [{field: value} for value in values]


def product(*axes: Sequence[Overrides]) -> list[Overrides]:
    """Every combination of the axes' runs (the first axis varies slowest)."""
    runs = []
    for combination in itertools.product(*axes):
        merged: Overrides = {}
        for overrides in combination:
            _merge_into(merged, overrides)
        runs.append(merged)
    return runs


def zip_(*axes: Sequence[Overrides]) -> list[Overrides]:
    """The i-th runs of all axes together (the axes must have equal lengths)."""
    lengths = {len(axis) for axis in axes}
    if len(lengths) > 1:
        raise ValueError(f"zip_ needs axes of one length; got lengths {sorted(lengths)}")
    runs = []
    for group in zip(*axes, strict=True):
        merged: Overrides = {}
        for overrides in group:
            _merge_into(merged, overrides)
        runs.append(merged)
    return runs


def _merge_into(merged: Overrides, overrides: Overrides) -> None:
    clash = sorted(set(merged) & set(overrides))
    if clash:
        raise ValueError(f"two sweep axes set the same field(s): {', '.join(clash)}")
    merged.update(overrides)


def with_seeds(runs: Sequence[Overrides], seeds: Sequence[int] | None) -> list[Overrides]:
    """`runs` once per seed (train.seed), unless `seeds` is None (the sweep's own seeds)."""
    if seeds is None:
        return [dict(run) for run in runs] or [{}]
    return product(runs or [{}], sweep(SEED_FIELD, seeds))


def load_sweep(config_arg: str) -> list[Overrides]:
    """The runs of `configs/X.py[:ARG]`: its `get_sweep(ARG)`, or one run without overrides."""
    path, _, arg = config_arg.partition(":")
    module = _load_module(path)
    if not hasattr(module, "get_sweep"):
        return [{}]
    runs = module.get_sweep(arg or None)
    for run in runs:
        if not isinstance(run, dict) or not all(isinstance(key, str) for key in run):
            raise ValueError(f"{path}: get_sweep must return a list of dicts; got {run!r}")
    return list(runs)


def load_config(config_arg: str) -> Any:
    """The ConfigDict of `configs/X.py[:ARG]` (a path relative to the checkout, or absolute):
    its `get_config(ARG)`, as `./launch.sh train` builds it before command-line overrides."""
    path, _, arg = config_arg.partition(":")
    return _load_module(path).get_config(arg or None)


def _load_module(path: str) -> Any:
    file = Path(path) if Path(path).is_absolute() else REPO / path
    if not file.is_file():
        raise FileNotFoundError(f"config file {path!r} not found (e.g. configs/synthetic_lm.py)")
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))  # configs import configs.base
    spec = importlib.util.spec_from_file_location(f"sweep_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------- naming and commands


def format_value(value: Any) -> str:
    """A value as config_flags parses it on the command line (strings bare, the rest repr)."""
    return value if isinstance(value, str) else repr(value)


def group_key(overrides: Overrides, fields: Sequence[str]) -> tuple[str, ...]:
    """A run's values of `fields` as the command line writes them ("" where unset): runs with
    equal keys differ only in other fields (the seed) and form one group of a report."""
    return tuple(format_value(overrides.get(field, "")) for field in fields)


def run_name(overrides: Overrides) -> str:
    """A readable, filesystem-safe, stable directory name: `position_scheme=rope,seed=0`.

    Keys are the last part of the field path unless two overrides share it; values keep
    letters, digits, `.`, `_` and `-` (other characters become `-`). Over 120 characters, the
    name is cut and ends with a hash of the overrides."""
    if not overrides:
        return "default"
    short = [key.rsplit(".", 1)[-1] for key in overrides]
    keys = short if len(set(short)) == len(short) else [key.replace(".", "-") for key in overrides]
    parts = []
    for key, value in zip(keys, overrides.values(), strict=True):
        text = re.sub(r"[^A-Za-z0-9._\-]+", "-", format_value(value)).strip("-") or "empty"
        parts.append(f"{key}={text}")
    name = ",".join(parts)
    if len(name) > 120:
        digest = hashlib.sha1(repr(sorted(overrides.items())).encode()).hexdigest()[:8]
        name = f"{name[:111]}~{digest}"
    return name


@dataclasses.dataclass
class Run:
    """One run of a sweep: its overrides, directory and `./launch.sh train` command."""

    index: int
    overrides: Overrides
    name: str
    workdir: Path
    command: list[str]
    eval_command: list[str] | None = None  # run after training (e.g. --eval_seq_len)

    def manifest(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "overrides": self.overrides,
                "workdir": str(self.workdir), "command": shlex.join(self.command)}


def make_runs(config_arg: str, runs: Sequence[Overrides], root: Path,
              extra_args: Sequence[str] = (), eval_args: Sequence[str] | None = None
              ) -> list[Run]:
    """A `Run` per override dict; distinct overrides that would share a name get a hash.
    `eval_args`: if given, each run is then evaluated with `./launch.sh eval ... *eval_args`."""
    names = [run_name(overrides) for overrides in runs]
    out = []
    for index, (overrides, name) in enumerate(zip(runs, names, strict=True)):
        if names.count(name) > 1:
            name += "~" + hashlib.sha1(repr(sorted(overrides.items())).encode()).hexdigest()[:8]
        workdir = root / name
        flags = [f"--config.{key}={format_value(value)}" for key, value in overrides.items()]
        flags += list(extra_args)
        command = ["./launch.sh", "train", config_arg, "--workdir", str(workdir), *flags]
        evaluate = (None if eval_args is None else
                    ["./launch.sh", "eval", config_arg, "--workdir", str(workdir), *flags,
                     *eval_args])
        out.append(Run(index, dict(overrides), name, workdir, command, evaluate))
    return out


def default_root(config_arg: str) -> Path:
    path, _, arg = config_arg.partition(":")
    return Path("workdirs") / "sweeps" / (Path(path).stem + (f"_{arg.replace(',', '_')}"
                                                             if arg else ""))


# ------------------------------------------------------------------------- running


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _write_json(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(json.dumps(value, indent=1, default=str) + "\n")
    os.replace(partial, path)


def _done(run: Run) -> dict[str, Any] | None:
    status = read_json(run.workdir / RUN_FILE)
    if status and status.get("status") == "done" and status.get("command") == shlex.join(
            run.command):
        return status
    return None


def is_finished(run: Run) -> bool:
    """True when the run finished with exactly this command (and eval command, if any), so it is
    not trained again."""
    status = _done(run)
    return status is not None and (
        not run.eval_command or status.get("eval_command") == shlex.join(run.eval_command))


def _error_line(log: str) -> str:
    """The last meaningful line of a failed run's output (tfm.main prints one line per error)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith(("tfm.main", "launch.sh")) or "Error" in line:
            return line[:500]
    return lines[-1][:500] if lines else "no output"


# What `./launch.sh train` exits with after SIGTERM/SIGINT made it save and stop (128 + signum),
# or a child killed by one of them: the run is "stopped", and a rerun resumes it.
_STOP_CODES = {128 + signal.SIGTERM, 128 + signal.SIGINT, -signal.SIGTERM, -signal.SIGINT}


class Children:
    """The sweep's running subprocesses. `stop()` (the sweep got SIGTERM/SIGINT) passes SIGTERM
    on to each (training saves its step and exits) and keeps new runs from starting."""

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self._live: set[subprocess.Popen] = set()
        self._lock = threading.Lock()

    def add(self, process: subprocess.Popen) -> None:
        with self._lock:
            self._live.add(process)
        if self.stopping.is_set():
            self._terminate(process)

    def remove(self, process: subprocess.Popen) -> None:
        with self._lock:
            self._live.discard(process)

    def stop(self, signum: int = signal.SIGTERM, frame: Any = None) -> None:
        self.stopping.set()
        with self._lock:
            live = list(self._live)
        for process in live:
            self._terminate(process)

    @staticmethod
    def _terminate(process: subprocess.Popen) -> None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(signal.SIGTERM)


def execute(run: Run, cpus: Sequence[int] | None = None,
            children: Children | None = None) -> dict[str, Any]:
    """Trains `run` in a subprocess (output in `workdir/train.log`), pinned to `cpus` if given,
    then runs its eval command (if any; output in `eval.log`); writes and returns its status
    ("done", "failed", or "stopped" when a signal stopped it: a rerun resumes it)."""
    run.workdir.mkdir(parents=True, exist_ok=True)
    trained = _done(run)
    record = {**run.manifest(), "status": "running", "started": time.time()}
    _write_json(run.workdir / RUN_FILE, record)
    env = dict(os.environ)
    if cpus:
        # XLA's CPU thread pool and OpenMP size themselves from the CPUs the process may use,
        # so pinning splits the cores between parallel runs.
        env["OMP_NUM_THREADS"] = str(len(cpus))
    env["PYTHONUNBUFFERED"] = "1"
    steps = [] if trained else [("train", run.command + ["--config.train.progress_bar=False"])]
    if run.eval_command:
        steps.append(("eval", run.eval_command))
    start = time.perf_counter()
    record["status"] = "done"
    for step, command in steps:
        log_path = run.workdir / f"{step}.log"
        with log_path.open("w") as log:
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                       stderr=subprocess.STDOUT)
            if cpus:  # before launch.sh has started Python (a preexec_fn is unsafe in threads)
                with contextlib.suppress(OSError):
                    os.sched_setaffinity(process.pid, cpus)
            if children is not None:
                children.add(process)
            returncode = process.wait()
            if children is not None:
                children.remove(process)
        record["returncode"] = returncode
        if returncode in _STOP_CODES:
            record["status"] = "stopped"
            record["error"] = f"{step} stopped by a signal (exit {returncode}); rerun to resume"
            break
        if returncode != 0:
            record["status"] = "failed" if step == "train" else "eval_failed"
            record["error"] = _error_line(log_path.read_text(errors="replace"))
            break
        if step == "eval":
            record["eval_command"] = shlex.join(command)
    record["wall_s"] = round(time.perf_counter() - start, 1) + (trained or {}).get("wall_s", 0)
    if record["status"] == "eval_failed":  # training is done: do not train again on resume
        record["status"] = "done"
        record["eval_error"] = record.pop("error")
    _write_json(run.workdir / RUN_FILE, record)
    return record


def cpu_slots(parallel: int) -> list[list[int]]:
    """The available CPUs split into `parallel` groups (a CPU per group at least)."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if not cpus:
        return [[] for _ in range(parallel)]
    size = max(1, len(cpus) // parallel)
    return [cpus[(i * size) % len(cpus):][:size] or cpus[:size] for i in range(parallel)]


def run_sweep(runs: Sequence[Run], root: Path, parallel: int = 1,
              say: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """Runs what is not finished, `parallel` at a time; never stops on a failed run. Writes
    ROOT/sweep.json and returns the status of every run."""
    records: dict[int, dict[str, Any]] = {}
    todo = []
    for run in runs:
        if is_finished(run):
            records[run.index] = read_json(run.workdir / RUN_FILE)
            say(f"[{run.index + 1}/{len(runs)}] {run.name}: finished before, read back")
        else:
            todo.append(run)
    write_manifest(root, runs, records)
    slots = cpu_slots(parallel) if parallel > 1 else [None]
    free = list(range(len(slots)))
    lock = threading.Lock()
    children = Children()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, children.stop)

    def work(run: Run) -> dict[str, Any] | None:
        if children.stopping.is_set():
            return None
        with lock:
            slot = free.pop()
        try:
            say(f"[{run.index + 1}/{len(runs)}] {run.name}: training"
                + (f" on CPUs {slots[slot]}" if slots[slot] else ""))
            record = execute(run, slots[slot], children)
        finally:
            with lock:
                free.append(slot)
        outcome = {"done": "done", "stopped": "stopped (rerun the sweep to resume)"}.get(
            record["status"], f"FAILED: {record.get('error')}")
        say(f"[{run.index + 1}/{len(runs)}] {run.name}: {outcome} ({record['wall_s']} s)")
        with lock:
            records[run.index] = record
            write_manifest(root, runs, records)
        return record

    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=len(slots)) as pool:
            list(pool.map(work, todo))
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    for run in todo:  # not started because the sweep was stopped
        records.setdefault(run.index, {**run.manifest(), "status": "not started"})
    write_manifest(root, runs, records)
    counts = collections.Counter(r.get("status") for r in records.values())
    others = "".join(f"; {n} {status}" for status, n in counts.items() if status != "done")
    say(f"{counts['done']} of {len(runs)} runs done{others}; summary in {root / SWEEP_FILE}"
        + (" (failed runs: see their train.log)" if counts["failed"] else "")
        + (" (rerun the same command to resume)" if children.stopping.is_set() else ""))
    return [records[run.index] for run in runs]


def write_manifest(root: Path, runs: Sequence[Run], records: dict[int, dict] | None = None,
                   **extra: Any) -> None:
    """ROOT/sweep.json: every run's name, overrides, command and (when known) status. Runs of
    an earlier sweep into the same ROOT that this one does not have (a sweep restricted to some
    schemes, to rerun or add them) stay listed, so `report ROOT` still sees them."""
    records = records or {}
    entries = []
    for run in runs:
        entry = run.manifest()
        record = records.get(run.index) or {}
        for key in ("status", "error", "eval_error", "wall_s", "returncode"):
            if key in record:
                entry[key] = record[key]
        entry.setdefault("status", "pending")
        entries.append(entry)
    current = {entry["name"]: entry for entry in entries}
    earlier = (read_json(root / SWEEP_FILE) or {}).get("runs", [])
    merged = [current.pop(entry["name"], entry) for entry in earlier] + list(current.values())
    _write_json(root / SWEEP_FILE, {"root": str(root), **extra, "runs": merged})


# ------------------------------------------------------------------------- SLURM


def slurm_script(runs: Sequence[Run], root: Path, *, job_name: str, parallel: int | None = None,
                 sbatch_options: Sequence[str] = ()) -> str:
    """An sbatch array script: array task i runs `./launch.sh train` for run i."""
    array = f"0-{len(runs) - 1}" + (f"%{parallel}" if parallel else "")
    lines = [
        "#!/usr/bin/env bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --array={array}",
        f"#SBATCH --output={root}/slurm-%A_%a.out",
        *(f"#SBATCH {option}" for option in sbatch_options),
        "# Written by ./launch.sh sweep --slurm; one array task per run. Resubmitting resumes:",
        "# each run continues from its latest checkpoint.",
        "set -euo pipefail",
        f"cd {shlex.quote(str(REPO))}",
        'case "$SLURM_ARRAY_TASK_ID" in',
    ]
    for run in runs:
        then = f" && {shlex.join(run.eval_command)}" if run.eval_command else ""
        lines.append(f"  {run.index}) {shlex.join(run.command)}{then} ;;")
    lines += ['  *) echo "no run $SLURM_ARRAY_TASK_ID" >&2; exit 2 ;;', "esac", ""]
    return "\n".join(lines)


# ------------------------------------------------------------------------- command line


def select(overrides: Sequence[Overrides], only: Sequence[str]) -> list[Overrides]:
    """The runs whose overrides match every `FIELD=VALUE` in `only` (values as on the command
    line; FIELD is the full path, e.g. data.task, or its last part). A field no run sets, or a
    value no run has, is a ValueError that lists what there is."""
    selected = list(overrides)
    for condition in only:
        field, equals, value = condition.partition("=")
        if not equals or not field:
            raise ValueError(f"--only {condition!r} must be FIELD=VALUE, e.g. data.task=reverse")
        fields = sorted({key for run in overrides for key in run})
        matches = [key for key in fields if key == field or key.rsplit(".", 1)[-1] == field]
        if len(matches) != 1:
            raise ValueError(f"--only {condition!r}: {field!r} is not one swept field; "
                             f"swept: {', '.join(fields)}")
        key = matches[0]
        values = sorted({format_value(run[key]) for run in overrides if key in run})
        if value not in values:
            raise ValueError(f"--only {condition!r}: no run has {key}={value}; "
                             f"values: {', '.join(values)}")
        selected = [run for run in selected if key in run and format_value(run[key]) == value]
    return selected


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="./launch.sh sweep", description="Train every run of a config's get_sweep(ARG).")
    parser.add_argument("config", help="configs/FILE.py[:ARG]")
    parser.add_argument("--seeds", default=None,
                        help="comma-separated train.seed values, crossed with the sweep")
    parser.add_argument("--parallel", type=int, default=1, help="local runs at a time")
    parser.add_argument("--dry_run", action="store_true", help="print the runs, run nothing")
    parser.add_argument("--only", action="append", default=[], metavar="FIELD=VALUE",
                        help="keep the runs with this override (repeatable: all must hold), "
                             "e.g. --only data.task=reverse; names and ROOT stay those of "
                             "the whole sweep")
    parser.add_argument("--workdir", default=None,
                        help="sweep root (default workdirs/sweeps/<config>[_<arg>])")
    parser.add_argument("--eval_seq_len", default=None,
                        help="after training, ./launch.sh eval --eval_seq_len THIS for each run")
    parser.add_argument("--slurm", action="store_true", help="write ROOT/sweep.sbatch instead")
    parser.add_argument("--submit", action="store_true", help="with --slurm: call sbatch")
    parser.add_argument("--sbatch", action="append", default=[],
                        help="an #SBATCH option for --slurm, e.g. --sbatch=--time=4:00:00")
    # Anything else (--config.x=y) goes to every run's train command.
    return parser.parse_known_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    os.chdir(REPO)  # relative paths (CONFIG, --workdir) are relative to the repository root
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    if args.parallel < 1:
        sys.stderr.write(f"launch.sh sweep: --parallel={args.parallel} must be >= 1\n")
        return 2
    bad = [arg for arg in extra if not arg.startswith("--config.")]
    if bad:
        sys.stderr.write(f"launch.sh sweep: unknown option(s) {' '.join(bad)}\n")
        return 2
    try:
        seeds = None if args.seeds is None else [int(s) for s in args.seeds.split(",")]
        overrides = select(with_seeds(load_sweep(args.config), seeds), args.only)
    except (ValueError, FileNotFoundError) as error:
        sys.stderr.write(f"launch.sh sweep: {error}\n")
        return 2
    root = Path(args.workdir) if args.workdir else default_root(args.config)
    eval_args = None if args.eval_seq_len is None else ["--eval_seq_len", args.eval_seq_len]
    runs = make_runs(args.config, overrides, root, extra, eval_args)
    if args.dry_run:
        print(f"{len(runs)} runs of {args.config} under {root}:")
        for run in runs:
            done = " (finished)" if is_finished(run) else ""
            print(f"  {run.name}{done}\n    {shlex.join(run.command)}")
            if run.eval_command:
                print(f"    {shlex.join(run.eval_command)}")
        return 0
    if args.slurm:
        script = root / "sweep.sbatch"
        script.parent.mkdir(parents=True, exist_ok=True)
        job_name = "tfm_" + default_root(args.config).name
        script.write_text(slurm_script(runs, root, job_name=job_name,
                                       parallel=args.parallel if args.parallel > 1 else None,
                                       sbatch_options=args.sbatch))
        write_manifest(root, runs, slurm_script=str(script))
        print(f"wrote {script} ({len(runs)} array tasks)")
        if args.submit:
            return subprocess.run(["sbatch", str(script)]).returncode
        print(f"submit with: sbatch {script}")
        return 0
    records = run_sweep(runs, root, args.parallel)
    return 0 if all(r.get("status") == "done" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
