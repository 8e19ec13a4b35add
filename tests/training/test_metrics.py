import math
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard_events import _read_events

from tfm.training.metrics import MetricWriter, progress_bar, read_metrics


def test_jsonl_and_tensorboard_round_trip(tmp_path):
    with MetricWriter(tmp_path, process_index=0) as writer:
        writer.write(10, {"train/loss": jnp.float32(2.5), "train/lr": 1e-3})
        writer.write(20, {"train/loss": np.float64(1.25), "eval/nan": float("nan")})
        writer.write_text(0, "config", "d_model: 16")
    records = read_metrics(tmp_path)
    assert records[0] == {"step": 10, "train/loss": 2.5, "train/lr": 1e-3}
    assert records[1]["step"] == 20 and records[1]["train/loss"] == 1.25
    assert math.isnan(records[1]["eval/nan"])
    scalars = _read_events(tmp_path / "tensorboard")
    assert (10, "train/loss", 2.5) in scalars and (20, "train/loss", 1.25) in scalars
    assert any(tag == "train/lr" and step == 10 and abs(v - 1e-3) < 1e-9
               for step, tag, v in scalars)


def test_appends_across_writers(tmp_path):
    for step in (1, 2):
        with MetricWriter(tmp_path, process_index=0) as writer:
            writer.write(step, {"x": step})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_resumed_writer_drops_records_of_replayed_steps(tmp_path):
    """A run killed after logging steps 1-5 (step 5's line cut short) with its last checkpoint
    at step 3 replays steps 4-5: each step ends up recorded once, the replayed values last."""
    with MetricWriter(tmp_path, process_index=0) as writer:
        for step in range(1, 6):
            writer.write(step, {"loss": float(step)})
    path = tmp_path / "metrics.jsonl"
    path.write_text(path.read_text()[:-8])  # SIGKILL inside the last write
    with MetricWriter(tmp_path, process_index=0, resume_step=3) as writer:
        for step in (4, 5):
            writer.write(step, {"loss": step + 0.5})
    records = read_metrics(tmp_path)
    assert [(r["step"], r["loss"]) for r in records] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.5), (5, 5.5)]
    with MetricWriter(tmp_path, process_index=0, resume_step=5):  # nothing to drop
        pass
    assert read_metrics(tmp_path) == records


def test_only_process_zero_writes(tmp_path):
    writer = MetricWriter(tmp_path / "other", process_index=1)
    writer.write(1, {"loss": 1.0})
    writer.close()
    assert not (tmp_path / "other").exists()


def test_rejects_non_scalars(tmp_path):
    with MetricWriter(tmp_path, process_index=0) as writer:
        with pytest.raises(ValueError, match="scalars"):
            writer.write(1, {"loss": np.ones(3)})


def test_progress_bar_counts_and_can_be_disabled(capsys):
    bar = progress_bar(10, initial_step=4, enabled=False)
    bar.update(3)  # a disabled tqdm bar does nothing at all
    bar.close()
    assert capsys.readouterr().err == ""
    bar = progress_bar(10, initial_step=4, enabled=True)
    bar.update(6)
    bar.close()
    assert "10/10" in capsys.readouterr().err and bar.n == 10


def test_tensorboard_writer_does_not_import_torch(tmp_path):
    """tensorboardX imports torch when it can (seconds at every run's start); the writer must
    work without it, and leave `import torch` working afterwards. A stand-in torch package on
    the path records whether it was imported."""
    fake = tmp_path / "site" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "import builtins\n"
        "builtins.FAKE_TORCH_IMPORTS = getattr(builtins, 'FAKE_TORCH_IMPORTS', 0) + 1\n"
        "class Tensor: pass\n"
    )
    script = textwrap.dedent(f"""
        import builtins, sys
        from tfm.training.metrics import MetricWriter, read_metrics
        with MetricWriter({str(tmp_path / "run")!r}, process_index=0) as writer:
            writer.write(1, {{"loss": 2.0}})
        imported_during_writer = getattr(builtins, "FAKE_TORCH_IMPORTS", 0)
        import torch
        print(imported_during_writer, builtins.FAKE_TORCH_IMPORTS,
              read_metrics({str(tmp_path / "run")!r})[0]["loss"])
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["0", "1", "2.0"]
