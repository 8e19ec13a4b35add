"""tfm.sweeps.sweep: declaring runs, naming them, the dry run, the SLURM script, and one real sweep
(train subprocesses: a run that finishes and is then read back, not retrained; a run with a bad
override that fails while the sweep goes on; evaluation at several lengths)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tfm.nn.positions import POSITION_SCHEMES
from tfm.sweeps import sweep
from tfm.sweeps.sweep import product, run_name, zip_
from tfm.sweeps.sweep import sweep as axis

REPO = Path(__file__).resolve().parents[2]


def test_product_and_zip():
    schemes = axis("model.position_scheme", ["rope", "alibi"])
    seeds = axis("train.seed", [0, 1])
    assert product(schemes, seeds) == [
        {"model.position_scheme": "rope", "train.seed": 0},
        {"model.position_scheme": "rope", "train.seed": 1},
        {"model.position_scheme": "alibi", "train.seed": 0},
        {"model.position_scheme": "alibi", "train.seed": 1},
    ]
    sizes = zip_(axis("model.d_model", [64, 128]), axis("model.d_ff", [256, 512]))
    assert sizes == [{"model.d_model": 64, "model.d_ff": 256},
                     {"model.d_model": 128, "model.d_ff": 512}]
    assert len(product(sizes, schemes)) == 4
    with pytest.raises(ValueError, match="one length"):
        zip_(schemes, axis("train.seed", [0, 1, 2]))
    with pytest.raises(ValueError, match="same field"):
        product(schemes, schemes)


def test_seeds_cross_the_sweep():
    runs = sweep.with_seeds([{"model.position_scheme": "rope"}], [0, 2])
    assert runs == [{"model.position_scheme": "rope", "train.seed": 0},
                    {"model.position_scheme": "rope", "train.seed": 2}]
    assert sweep.with_seeds([], [5]) == [{"train.seed": 5}]
    assert sweep.with_seeds([{"a.b": 1}], None) == [{"a.b": 1}]


def test_run_names_are_readable_safe_and_stable():
    assert run_name({"model.position_scheme": "rope", "train.seed": 0}) == (
        "position_scheme=rope,seed=0")
    assert run_name({}) == "default"
    assert run_name({"data.train_lengths": (1, 12), "data.path": "/a b/c.txt"}) == (
        "train_lengths=1-12,path=a-b-c.txt")
    # The same short key twice: the full path names them.
    assert run_name({"data.seed": 1, "train.seed": 2}) == "data-seed=1,train-seed=2"
    long = {f"model.field_{i}": "x" * 20 for i in range(8)}
    assert len(run_name(long)) == 120 and run_name(long) == run_name(dict(long))
    # Distinct overrides that sanitise to one name get distinct directories.
    runs = sweep.make_runs("configs/x.py", [{"data.path": "a b"}, {"data.path": "a/b"}], Path("r"))
    assert runs[0].name != runs[1].name and runs[0].name.startswith("path=a-b~")


def test_commands_and_config_sweeps():
    runs = sweep.make_runs(
        "configs/synthetic_lm.py:runlocal",
        sweep.with_seeds([{"model.position_scheme": "alibi", "train.label_smoothing": 0.1}], [3]),
        Path("workdirs/s"), ["--config.train.num_steps=5"],
    )
    assert runs[0].command == [
        "./launch.sh", "train", "configs/synthetic_lm.py:runlocal",
        "--workdir", "workdirs/s/position_scheme=alibi,label_smoothing=0.1,seed=3",
        "--config.model.position_scheme=alibi", "--config.train.label_smoothing=0.1",
        "--config.train.seed=3", "--config.train.num_steps=5",
    ]
    # Every registered scheme, in the registry's order.
    assert sweep.load_sweep("configs/synthetic_lm.py:reverse,runlocal") == [
        {"model.position_scheme": s} for s in POSITION_SCHEMES]
    assert POSITION_SCHEMES[:7] == ("none", "sinusoidal", "learned", "rope", "relative",
                                    "t5_bias", "alibi")
    assert len(sweep.load_sweep("configs/synthetic_seq2seq.py")) == 3 * len(POSITION_SCHEMES)
    # Schemes in ARG keep just those (a pilot); the task and the variants still apply.
    assert sweep.load_sweep("configs/synthetic_lm.py:reverse,alibi,none,runlocal") == [
        {"model.position_scheme": "none"}, {"model.position_scheme": "alibi"}]
    assert len(sweep.load_sweep("configs/synthetic_seq2seq.py:rope")) == 3
    assert sweep.load_sweep("configs/char_lm.py")[3] == {"model.position_scheme": "rope"}
    assert sweep.load_sweep("configs/translate.py:small") == [
        {"model.position_scheme": "sinusoidal"}, {"model.position_scheme": "learned"}]


def test_the_pilot_sweeps_its_schemes_over_two_seeds_and_evaluates_three_times():
    runs = sweep.load_sweep("configs/pilot.py")
    assert runs == [{"train.seed": seed, "model.position_scheme": scheme}
                    for seed in (0, 1) for scheme in ("sinusoidal", "alibi")]
    assert [run["model.position_scheme"] for run in
            sweep.load_sweep("configs/pilot.py:sinusoidal,alibi,none")] == [
        "sinusoidal", "alibi", "none"] * 2
    assert sweep.default_root("configs/pilot.py") == Path("workdirs/sweeps/pilot")
    from tfm.training.experiment import parse_config

    config = sweep._load_module("configs/pilot.py").get_config()
    sections = parse_config(config)  # a valid config, checked as training checks it
    train, optimizer = sections.train, sections.optimizer
    assert optimizer.total_steps == train.num_steps  # the schedule ends where training does
    assert train.num_steps // train.eval_every == 3  # a learning curve, not one point
    assert config.data.train_lengths[1] < config.data.eval_lengths[0]  # "test" is longer


def test_dry_run_lists_runs_and_commands(capsys):
    assert sweep.main(["configs/translate.py:small", "--seeds", "0,1", "--dry_run",
                       "--workdir", "/tmp/never_written"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("4 runs of configs/translate.py:small under /tmp/never_written:")
    assert "position_scheme=learned,seed=1\n" in out
    assert ("./launch.sh train configs/translate.py:small --workdir "
            "/tmp/never_written/position_scheme=sinusoidal,seed=0 "
            "--config.model.position_scheme=sinusoidal --config.train.seed=0") in out
    assert not Path("/tmp/never_written").exists()


def test_only_keeps_the_matching_runs_under_the_whole_sweeps_names(capsys):
    args = ["configs/synthetic_lm.py:short", "--seeds", "1", "--dry_run", "--workdir", "/tmp/nw"]
    assert sweep.main([*args, "--only", "data.task=reverse", "--only", "seed=1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{len(POSITION_SCHEMES)} runs of configs/synthetic_lm.py:short "
                          "under /tmp/nw:")
    assert "task=reverse,position_scheme=alibi,seed=1\n" in out  # the task stays in the name
    assert "task=copy" not in out
    assert sweep.main([*args, "--only", "position_scheme=rope"]) == 0
    assert capsys.readouterr().out.startswith("3 runs")  # rope on copy, reverse, addition
    for bad, message in [("data.task=sort", "no run has data.task=sort; values: addition, copy"),
                         ("d_model=64", "'d_model' is not one swept field; swept: data.task"),
                         ("reverse", "must be FIELD=VALUE")]:
        assert sweep.main([*args, "--only", bad]) == 2
        assert message in capsys.readouterr().err
    assert not Path("/tmp/nw").exists()


def test_launch_sh_sweep_dry_run():
    result = subprocess.run(
        ["bash", str(REPO / "launch.sh"), "sweep", "configs/synthetic_lm.py:reverse,runlocal",
         "--dry_run", "--workdir", "/tmp/never_written"],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("./launch.sh train configs/synthetic_lm.py:reverse,runlocal") == len(
        POSITION_SCHEMES)


def test_slurm_script(tmp_path, capsys):
    root = tmp_path / "sweep"
    assert sweep.main(["configs/translate.py:small", "--seeds", "0,1", "--slurm",
                       "--workdir", str(root), "--parallel", "2",
                       "--sbatch=--time=4:00:00", "--sbatch=--gres=gpu:1",
                       "--config.train.num_steps=100"]) == 0
    assert "submit with: sbatch" in capsys.readouterr().out
    script = (root / "sweep.sbatch").read_text()
    lines = script.splitlines()
    assert lines[0] == "#!/usr/bin/env bash"
    assert "#SBATCH --array=0-3%2" in lines
    assert f"#SBATCH --output={root}/slurm-%A_%a.out" in lines
    assert "#SBATCH --time=4:00:00" in lines and "#SBATCH --gres=gpu:1" in lines
    assert "#SBATCH --job-name=tfm_translate_small" in lines
    assert f"cd {REPO}" in lines
    tasks = [line.strip() for line in lines if line.strip()[:2] in ("0)", "1)", "2)", "3)")]
    assert len(tasks) == 4
    assert tasks[3] == (
        f"3) ./launch.sh train configs/translate.py:small --workdir "
        f"{root}/position_scheme=learned,seed=1 --config.model.position_scheme=learned "
        "--config.train.seed=1 --config.train.num_steps=100 ;;")
    manifest = json.loads((root / "sweep.json").read_text())
    assert [run["status"] for run in manifest["runs"]] == ["pending"] * 4
    # The script is valid bash, and task 1 would run run 1's command.
    syntax = subprocess.run(["bash", "-n", str(root / "sweep.sbatch")], capture_output=True)
    assert syntax.returncode == 0, syntax.stderr


TINY_CONFIG = '''
from configs.char_lm import get_config as char_lm_config


def get_config(arg=None):
    config = char_lm_config("runlocal")
    config.model.update(d_model=16, num_heads=2, d_ff=32, num_decoder_layers=1, max_len=32)
    config.data.update(path={text!r}, data_dir={data_dir!r}, seq_len=16, eval_seq_len=16,
                       batch_size=4, eval_batch_size=4)
    config.optimizer.update(total_steps=2, warmup_steps=1)
    config.train.update(num_steps=2, log_every=1, eval_every=2, checkpoint_every=2,
                        async_checkpoints=False)
    config.eval.max_batches = 2
    return config


def get_sweep(arg=None):
    return [{{"model.position_scheme": "rope"}}, {{"model.position_scheme": "rotary"}}]
'''


def test_sweep_runs_resumes_and_records_failures(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(f"para {i}: the quick brown fox jumps over it" for i in range(40)))
    config = tmp_path / "tiny.py"
    config.write_text(TINY_CONFIG.format(text=str(text), data_dir=str(tmp_path / "data")))
    root = tmp_path / "sweep"
    runs = sweep.make_runs(str(config), sweep.load_sweep(str(config)), root,
                           eval_args=["--eval_seq_len", "8,64"])
    lines: list[str] = []
    records = sweep.run_sweep(runs, root, parallel=2, say=lines.append)

    good, bad = records
    assert good["status"] == "done", (root / runs[0].name / "train.log").read_text()[-2000:]
    assert bad["status"] == "failed" and bad["returncode"] != 0
    assert "position_scheme='rotary' is unknown" in bad["error"]
    manifest = json.loads((root / "sweep.json").read_text())
    assert [run["status"] for run in manifest["runs"]] == ["done", "failed"]
    assert "rotary" in manifest["runs"][1]["error"]
    assert any("FAILED" in line for line in lines) and "1 failed" in lines[-1]
    # Evaluated past the training rows (16) with rope: 8 and 64 both have numbers.
    lengths = json.loads((runs[0].workdir / "eval_seq_len.json").read_text())
    assert set(lengths) == {"8", "64"} and lengths["64"]["step"] == 2
    assert lengths["8"]["eval_loss"] > 0 and lengths["64"]["eval_loss"] > 0

    # Again: the finished run is read back (its logs untouched), the failed one runs again.
    log_time = (runs[0].workdir / "train.log").stat().st_mtime_ns
    lines.clear()
    again = sweep.run_sweep(runs, root, parallel=1, say=lines.append)
    assert f"[1/2] {runs[0].name}: finished before, read back" in lines
    assert (runs[0].workdir / "train.log").stat().st_mtime_ns == log_time
    assert again[0]["status"] == "done" and again[1]["status"] == "failed"
    assert shlex.join(runs[0].command) == again[0]["command"]


def test_eval_lengths_learned_past_max_len_is_not_available(tmp_path):
    from configs import char_lm
    from tfm.main import evaluate_lengths

    config = char_lm.get_config("runlocal,learned")
    config.model.max_len = 128
    results = evaluate_lengths(config, tmp_path, ["256"])
    assert results == {"256": {"n/a": "position_scheme='learned' has no positions past "
                                      "model.max_len=128"}}
    assert json.loads((tmp_path / "eval_seq_len.json").read_text()) == results


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU affinity")
def test_cpu_slots_split_the_cores():
    cpus = sorted(os.sched_getaffinity(0))
    slots = sweep.cpu_slots(len(cpus))
    assert sorted(c for slot in slots for c in slot) == cpus
    assert all(slot for slot in sweep.cpu_slots(len(cpus) + 3))


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux CPU affinity")
def test_a_parallel_run_is_pinned_to_its_cpus(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    show = "import os; print(sorted(os.sched_getaffinity(0)), os.environ['OMP_NUM_THREADS'])"
    run = sweep.Run(0, {}, "pinned", tmp_path / "pinned", [sys.executable, "-c", show])
    record = sweep.execute(run, [cpu])
    assert record["status"] == "done"
    assert (run.workdir / "train.log").read_text().strip() == f"[{cpu}] 1"


def _python_run(root: Path, index: int, code: str) -> sweep.Run:
    return sweep.Run(index, {"run": index}, f"run={index}", root / f"run={index}",
                     [sys.executable, "-c", code])


def test_a_stopped_sweep_stops_its_runs_and_records_them_for_resuming(tmp_path):
    """SIGTERM to the sweep: the running child gets SIGTERM too, is recorded "stopped" (not
    "done"), later runs are "not started", and a rerun would run them all."""
    slow = "import time; print('started', flush=True); time.sleep(120)"
    runs = [_python_run(tmp_path, i, slow) for i in range(3)]
    handler_before = signal.getsignal(signal.SIGTERM)

    def stop_the_sweep_once_started():
        log = runs[0].workdir / "train.log"
        deadline = time.time() + 60
        while time.time() < deadline and "started" not in (
                log.read_text() if log.exists() else ""):
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_the_sweep_once_started, daemon=True).start()
    lines: list[str] = []
    start = time.time()
    records = sweep.run_sweep(runs, tmp_path, parallel=1, say=lines.append)
    assert time.time() - start < 60  # the child did not sleep its 120 s
    assert [r["status"] for r in records] == ["stopped", "not started", "not started"]
    assert records[0]["returncode"] == -signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is handler_before
    assert not any(sweep.is_finished(run) for run in runs)
    assert "1 stopped" in lines[-1] and "2 not started" in lines[-1] and "resume" in lines[-1]


def test_training_that_saved_and_stopped_on_a_signal_is_not_done(tmp_path):
    """`./launch.sh train` exits 128 + signum after a SIGTERM made it save and stop."""
    run = _python_run(tmp_path, 0, "import sys; sys.exit(143)")
    record = sweep.execute(run)
    assert record["status"] == "stopped" and "rerun" in record["error"]
    assert json.loads((run.workdir / sweep.RUN_FILE).read_text())["status"] == "stopped"


def test_a_restricted_sweep_into_the_same_root_keeps_the_other_runs_listed(tmp_path):
    first = [_python_run(tmp_path, i, "pass") for i in range(2)]
    sweep.write_manifest(tmp_path, first, {0: {"status": "done"}, 1: {"status": "stopped"}})
    rerun = [_python_run(tmp_path, 1, "pass"), _python_run(tmp_path, 2, "pass")]
    sweep.write_manifest(tmp_path, rerun, {1: {"status": "done"}})
    runs = json.loads((tmp_path / sweep.SWEEP_FILE).read_text())["runs"]
    assert [(run["name"], run["status"]) for run in runs] == [
        ("run=0", "done"), ("run=1", "done"), ("run=2", "pending")]
