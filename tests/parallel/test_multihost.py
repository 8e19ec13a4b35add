"""Multi-process training through ./launch.sh: 2 processes, then 1, then 2 again, one workdir.

Each run is `./launch.sh train configs/synthetic_seq2seq.py:runlocal` with tiny overrides (d_model
32, 1+1 layers, batch 8 x 16) and mesh data=1 x fsdp=-1, so in the 2-process runs parameters and
Adam moments are split across the processes (fsdp=2, one CPU device each) and every checkpoint
leaf is a global array written by both. What is compared:
- run 1 (2 processes, steps 1-2) starts from an empty data_dir: process 0 prepares the dataset
  while process 1 waits (tfm.training.train.setup), so the two never write it at the same time;
- run 2 (1 process, 1 device) resumes at step 2 and logs steps 3-4; run 3 (2 processes)
  resumes at step 4 and logs steps 5-6: every step is logged exactly once, so each run restored
  the step counter, and the eval loss keeps falling (2 -> 4 -> 6), so the params went on
  training (the data position restarts when the process count changes: a logged warning);
- the checkpoints of steps 2 (written by 2 processes) and 4 (by 1), restored here onto 8 devices
  (fsdp=8: resharding on restore), give the eval losses those runs logged, within 1e-5;
- run 3 also decodes (exact match) with params spread over both processes.
Every run has a timeout, and its processes are killed if it expires.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from child_flags import child_xla_flags

from configs import synthetic_seq2seq
from tfm.parallel import sharding
from tfm.training import train
from tfm.training.evaluate import evaluate
from tfm.training.experiment import restore_params, setup, state_shardings

REPO = Path(__file__).resolve().parents[2]
OVERRIDES = {
    "model.d_model": 32, "model.num_heads": 4, "model.d_ff": 64, "model.num_encoder_layers": 1,
    "model.num_decoder_layers": 1,
    "data.batch_size": 8, "data.eval_batch_size": 8, "data.seq_len": 16,
    "data.num_train_examples": 200, "data.num_eval_examples": 16,
    "data.train_lengths": (1, 8), "data.eval_lengths": (9, 12),
    "mesh.data": 1, "mesh.fsdp": -1,
    "train.log_every": 1, "train.checkpoint_every": 2, "train.progress_bar": False,
    "train.keep_best_metric": "eval_loss", "train.best_mode": "min",
    "eval.splits": ("validation",), "eval.generation_metric": "none",
    "eval.max_generation_examples": 4,
    # One schedule for runs of 2, 4 and 6 steps resuming each other (unset, it would follow
    # each run's train.num_steps and stop short of runlocal's 10 warmup steps).
    "optimizer.total_steps": 60,
}
RUN_TIMEOUT_S = 300
# LLVM optimisation level 0: 2-4x faster CPU compiles; code generation only, not the HLO passes
# (SPMD partitioning) under test.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def python_wrapper(directory):
    """launch.sh runs $PYTHON and sets XLA_FLAGS itself for several processes: a wrapper adds the
    suite's fast-compile flags in every process it starts."""
    path = directory / "python"
    path.write_text(f'#!/bin/sh\nexport XLA_FLAGS="$XLA_FLAGS {child_xla_flags()}"'
                    f'\nexec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return path


def flag(key, value):
    text = repr(value).replace(" ", "") if isinstance(value, tuple) else str(value)
    return f"--config.{key}={text}"


def launch(workdir, data_dir, cache_dir, num_processes, num_steps, **extra):
    overrides = {**OVERRIDES, "data.data_dir": str(data_dir), "train.num_steps": num_steps,
                 **extra}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "TPU_", "TFM_", "XLA_FLAGS"))}
    # Runs 1 and 3 compile the same programs: the persistent cache saves run 3 the work.
    env.update(JAX_PLATFORMS="cpu", PYTHON=str(python_wrapper(cache_dir.parent)),
               JAX_COMPILATION_CACHE_DIR=str(cache_dir),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    command = [str(REPO / "launch.sh"), "train", "configs/synthetic_seq2seq.py:runlocal",
               "--num_processes", str(num_processes), "--workdir", str(workdir),
               *(flag(key, value) for key, value in overrides.items())]
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log = proc.communicate(timeout=RUN_TIMEOUT_S)[0].decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # launch.sh and every process it started
        log = proc.communicate()[0].decode(errors="replace")
        pytest.fail(f"{num_processes}-process run timed out after {RUN_TIMEOUT_S} s:\n"
                    f"{log[-3000:]}")
    assert proc.returncode == 0, f"{num_processes}-process run failed:\n{log[-3000:]}"
    return log


def config_for(data_dir):
    config = synthetic_seq2seq.get_config("runlocal")
    for key, value in {**OVERRIDES, "data.data_dir": str(data_dir)}.items():
        section, field = key.split(".")
        config[section][field] = value
    return config


def test_two_processes_then_one_then_two(tmp_path):
    workdir, data_dir, cache_dir = tmp_path / "run", tmp_path / "data", tmp_path / "jax_cache"
    launch(workdir, data_dir, cache_dir, num_processes=2, num_steps=2)
    assert sorted(p.name for p in (workdir / "checkpoints" / "2" / "data").glob("*.json")) == [
        "process_0-of-2.json", "process_1-of-2.json"]
    # Both processes wrote their shards of the state (orbax ocdbt: one directory per process).
    state_dir = workdir / "checkpoints" / "2" / "state"
    assert sorted(p.name for p in state_dir.glob("ocdbt.process_*")) == [
        "ocdbt.process_0", "ocdbt.process_1"]
    log2 = launch(workdir, data_dir, cache_dir, num_processes=1, num_steps=4)
    assert "saved by a different number of processes" in log2
    log3 = launch(workdir, data_dir, cache_dir, num_processes=2, num_steps=6,
                  **{"eval.generation_metric": "exact_match"})
    assert "saved by a different number of processes" in log3
    # One console: only process 0 prints eval lines and the final metrics.
    for log in (log2, log3):
        assert log.count("step 6: eval") + log.count("step 4: eval") == 1, log[-3000:]
        assert log.count('"workdir": ') == 1, log[-3000:]

    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r["step"] for r in records if "train_loss" in r]
    assert train_steps == [1, 2, 3, 4, 5, 6]
    eval_loss = {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}
    assert sorted(eval_loss) == [2, 4, 6]
    assert eval_loss[2] > eval_loss[4] > eval_loss[6]
    assert [r for r in records if r["step"] == 6 and "eval_exact_match" in r]

    # This process has 8 devices: the same config gives fsdp=8, a third mesh for the same state.
    experiment = setup(config_for(data_dir), workdir)
    assert dict(experiment.mesh.shape) == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1}
    _, shardings = state_shardings(experiment)
    _, eval_fn = train.jit_steps(experiment, shardings)
    batch = sharding.shard_batch(next(iter(experiment.data.eval_batches("validation"))),
                                 experiment.mesh, rules=experiment.rules)
    compiled_eval = None
    for step in (2, 4):
        params, restored_step = restore_params(experiment, step)
        compiled_eval = compiled_eval or eval_fn.lower(params, batch).compile(FAST_COMPILE)
        assert restored_step == step
        kernel = params["encoder"]["stack"]["layer_0"]["feed_forward"]["wi"]["kernel"]
        assert kernel.addressable_shards[0].data.shape == (4, 64)  # 32 / fsdp=8 rows each
        results = evaluate(experiment, params, compiled_eval)
        assert results["eval_loss"] == pytest.approx(eval_loss[step], rel=1e-5)


def test_a_lost_process_is_one_line_naming_it_and_the_resume_command(tmp_path):
    """SIGKILL of one of two processes once training has saved a checkpoint: launch.sh says at
    once which process ended and how, stops the other (which otherwise waited ~100 s for the
    coordination service and aborted with a C++ stack dump), and prints the command that
    resumes; bash's own "Killed" notices stay off the console."""
    workdir, data_dir, cache_dir = tmp_path / "run", tmp_path / "data", tmp_path / "jax_cache"
    overrides = {**OVERRIDES, "data.data_dir": str(data_dir), "train.num_steps": 10_000}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "TPU_", "TFM_", "XLA_FLAGS"))}
    env.update(JAX_PLATFORMS="cpu", PYTHON=str(python_wrapper(tmp_path)),
               JAX_COMPILATION_CACHE_DIR=str(cache_dir))
    command = [str(REPO / "launch.sh"), "train", "configs/synthetic_seq2seq.py:runlocal",
               "--num_processes", "2", "--workdir", str(workdir),
               *(flag(key, value) for key, value in overrides.items())]
    log_path = tmp_path / "console.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not (workdir / "checkpoints" / "2").exists():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint: " + log_path.read_text()[-3000:]
            time.sleep(0.5)
        [lost] = [pid for pid in children(proc.pid) if process_id(pid) == "1"]
        [survivor] = [pid for pid in children(proc.pid) if process_id(pid) == "0"]
        killed_at = time.monotonic()
        os.kill(lost, signal.SIGKILL)
        proc.wait(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = log_path.read_text(errors="replace")
    assert took < 15, (took, log[-3000:])
    assert proc.returncode == 128 + signal.SIGKILL
    assert not alive(survivor)
    after = log[log.index("launch.sh: process 1"):]
    assert after.count("\n") == 1, log[-3000:]  # the last line, nothing after it
    assert after.startswith(
        f"launch.sh: process 1 (pid {lost}) ended with signal KILL; stopped the other process. "
        "To resume from the last checkpoint, run the same command again: ./launch.sh train "
        f"configs/synthetic_seq2seq.py:runlocal --workdir={workdir} ")
    assert after.rstrip().endswith("--num_processes 2 --devices_per_process 1")
    for dump in ("Killed", "Check failure", "SIGABRT", "Aborted", "terminate called"):
        assert dump not in log, log[-3000:]


def children(pid: int) -> list[int]:
    """Pids of the live child processes of `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def process_id(pid: int) -> str | None:
    """The TFM_PROCESS_ID launch.sh gave process `pid`."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"TFM_PROCESS_ID="):
            return item.split(b"=", 1)[1].decode()
    return None
