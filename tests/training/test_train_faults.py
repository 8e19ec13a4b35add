"""Fault injection for tfm/training/train.py: training SIGKILLed at random points, inside steps and
inside
checkpoint saves, restarted each time, ends in exactly the state (and metrics.jsonl) of one
uninterrupted run. Each run is a fresh process, as after a real crash."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from child_flags import child_xla_flags
from run_records import assert_trees_equal, saved_state

from tfm.training import checkpoint, metrics

REPO = Path(__file__).resolve().parents[2]
NUM_STEPS = 16
RUN_TIMEOUT_S = 240

# A child training process: kills itself with SIGKILL when it is about to train global step
# KILL_STEP ("step"), or KILL_DELAY seconds after the save of step KILL_STEP started ("save";
# the save writes in the background, so the kill lands inside it).
CHILD = r"""
import json, os, signal, sys, time
from configs import synthetic_seq2seq
from tfm.training import checkpoint, train

workdir, data_dir, kill = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
config = synthetic_seq2seq.get_config("runlocal")
config.model.update(d_model=32, num_heads=2, d_ff=64, num_encoder_layers=1, num_decoder_layers=1,
                    dropout_rate=0.1)
config.data.update(data_dir=data_dir, batch_size=16, seq_len=12, train_lengths=(1, 6),
                   eval_lengths=(7, 9), num_train_examples=512, num_eval_examples=16)
config.optimizer.update(total_steps=16, warmup_steps=4)
config.train.update(num_steps=16, log_every=1, eval_every=8, checkpoint_every=4, max_to_keep=2,
                    keep_best_metric="eval_loss", label_smoothing=0.1, progress_bar=False)
config.eval.update(splits=("validation",), max_generation_examples=8)

with checkpoint.Checkpointer(os.path.join(workdir, "checkpoints")) as found:
    step = [found.latest_step() or 0]

def die():
    os.kill(os.getpid(), signal.SIGKILL)

if kill and kill["where"] == "step":
    shard_batch = train.sharding.shard_batch
    def killing_shard_batch(host_batch, *args, **kwargs):
        if "example_weights" not in host_batch:
            step[0] += 1
            if step[0] == kill["step"]:
                die()
        return shard_batch(host_batch, *args, **kwargs)
    train.sharding.shard_batch = killing_shard_batch
elif kill:
    save = checkpoint.Checkpointer.save
    def killing_save(self, save_step, *args, **kwargs):
        started = save(self, save_step, *args, **kwargs)
        if save_step == kill["step"]:
            time.sleep(kill["delay"])
            die()
        return started
    checkpoint.Checkpointer.save = killing_save
train.train_and_evaluate(config, workdir)
"""


def train_process(workdir: Path, data_dir: Path, cache_dir: Path, kill: dict | None) -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": child_xla_flags()}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(workdir), str(data_dir), json.dumps(kill)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )
    if result.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"training failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result.returncode


def test_random_sigkills_inside_steps_and_saves_end_in_the_uninterrupted_state(tmp_path):
    data_dir, cache_dir = tmp_path / "data", tmp_path / "jax_cache"
    reference = tmp_path / "reference"
    assert train_process(reference, data_dir, cache_dir, None) == 0

    rng = random.Random(12)
    # Four kills, in order: inside a step before the first checkpoint; inside the save of a
    # checkpoint step (4 or 8: one of them then resumes from step 0 or 4); inside a later step;
    # inside the save of step 12 or of the final step. Each restart resumes from the latest
    # complete checkpoint.
    kills = [
        {"where": "step", "step": rng.randint(2, 4)},
        {"where": "save", "step": rng.choice([4, 8]), "delay": rng.uniform(0.0, 0.05)},
        {"where": "step", "step": rng.randint(10, 14)},
        {"where": "save", "step": rng.choice([12, NUM_STEPS]), "delay": rng.uniform(0.0, 0.05)},
    ]
    workdir = tmp_path / "run"
    killed = 0
    for kill in kills:
        killed += train_process(workdir, data_dir, cache_dir, kill) == -signal.SIGKILL
    assert killed >= 3, kills  # a save kill may land after the step's last checkpoint write
    assert train_process(workdir, data_dir, cache_dir, None) == 0

    with checkpoint.Checkpointer(workdir / "checkpoints") as checkpointer:
        assert checkpointer.latest_step() == NUM_STEPS
    assert_trees_equal(saved_state(workdir, NUM_STEPS), saved_state(reference, NUM_STEPS))
    # metrics.jsonl: every step once (replayed steps are not recorded twice), same numbers.
    records, expected = metrics.read_metrics(workdir), metrics.read_metrics(reference)
    strip = lambda rs: [{k: v for k, v in r.items() if not k.endswith(("_per_second", "mfu"))}
                        for r in rs]
    assert strip(records) == strip(expected)


# The child's config as ./launch.sh flags: a truncated checkpoint is a user's experience at the
# console, so these runs go through launch.sh and tfm.main, as a user's would.
LAUNCH_FLAGS = [
    "--config.model.d_model=32", "--config.model.num_heads=2", "--config.model.d_ff=64",
    "--config.model.num_encoder_layers=1", "--config.model.num_decoder_layers=1",
    "--config.data.batch_size=16", "--config.data.seq_len=12", "--config.data.train_lengths=(1,6)",
    "--config.data.eval_lengths=(7,9)", "--config.data.num_train_examples=512",
    "--config.data.num_eval_examples=16", "--config.train.num_steps=4",
    "--config.train.log_every=2", "--config.train.eval_every=4",
    "--config.train.checkpoint_every=2", "--config.train.max_to_keep=3",
    "--config.train.progress_bar=False",
    "--config.optimizer.total_steps=16", "--config.optimizer.warmup_steps=1",
    "--config.eval.splits=('validation',)", "--config.eval.max_generation_examples=8",
]


def launch_train(workdir: Path, data_dir: Path, cache_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "JAX_COMPILATION_CACHE_DIR": str(cache_dir),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": child_xla_flags()}
    return subprocess.run(
        [str(REPO / "launch.sh"), "train", "configs/synthetic_seq2seq.py:runlocal",
         "--workdir", str(workdir), f"--config.data.data_dir={data_dir}", *LAUNCH_FLAGS],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )


def truncate_arrays(step_dir: Path) -> None:
    """Cuts every array file of a checkpoint step in half, as a full disk or a copy cut short
    would."""
    files = list(step_dir.glob("state/ocdbt.process_*/d/*"))
    assert files, step_dir
    for path in files:
        os.truncate(path, path.stat().st_size // 2)


def test_truncated_checkpoints_are_reported_in_a_few_lines(tmp_path):
    """A truncated newest step: training resumes from the step before, says so in one line per
    unreadable step (the reason in one line, where the step was moved: never deleted), and no
    tensorstore spec reaches the console (it was ~1,300 lines of "Exception ignored in:
    <coroutine object _read_array_index_and_device_put>"). Every step unreadable: one error
    naming each step tried and what to do, nothing moved."""
    data_dir, cache_dir, workdir = tmp_path / "data", tmp_path / "jax_cache", tmp_path / "run"
    checkpoints = workdir / "checkpoints"
    first = launch_train(workdir, data_dir, cache_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert sorted(int(p.name) for p in checkpoints.iterdir()) == [2, 4]
    truncate_arrays(checkpoints / "4")
    truncated_files = sorted(p.relative_to(checkpoints / "4")
                             for p in (checkpoints / "4").rglob("*"))

    resumed = launch_train(workdir, data_dir, cache_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = resumed.stderr
    assert "Exception ignored" not in log and "TensorStore" not in log, log[-3000:]
    assert len(log.splitlines()) <= 6, log
    [warning] = [line for line in log.splitlines() if "could not be read" in line]
    moved = workdir / "checkpoints_corrupt" / "4"
    assert "checkpoint step 4 could not be read (ValueError: OUT_OF_RANGE: Error reading" in warning
    assert f"training resumes from step 2, and step 4 was moved to {moved}" in warning
    assert sorted(p.relative_to(moved) for p in moved.rglob("*")) == truncated_files
    assert sorted(int(p.name) for p in checkpoints.iterdir()) == [2, 4]  # step 4 trained again

    for step_dir in checkpoints.iterdir():
        truncate_arrays(step_dir)
    failed = launch_train(workdir, data_dir, cache_dir)
    assert failed.returncode == 1
    log = failed.stderr
    assert "Exception ignored" not in log and "TensorStore" not in log, log[-3000:]
    [error] = log.splitlines()[-1:]
    assert len(log.splitlines()) <= 3, log  # the CPU warning, the error
    assert error.startswith(f"tfm.main train: CheckpointError: no checkpoint in {checkpoints} "
                            "could be read (corrupt or incomplete?); tried step 4 (ValueError: "
                            "OUT_OF_RANGE: Error reading"), error
    assert "; step 2 (ValueError: OUT_OF_RANGE: Error reading" in error
    assert "another --workdir" in error
    assert sorted(int(p.name) for p in checkpoints.iterdir()) == [2, 4]  # nothing moved
