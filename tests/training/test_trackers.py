"""Experiment trackers (tfm/training/trackers.py) through real training runs: each tracker gets
the same metrics as metrics.jsonl (wandb read back from its offline run files), the config,
and a resumed run continues the same wandb run; train.tracker is validated, and a missing
wandb package is one line naming the pip extra, before anything is built."""

from __future__ import annotations

import json
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from compile_cache import persistent_compilation_cache
from tensorboard_events import _read_events as tensorboard_scalars

from configs import synthetic_lm
from tfm.checks import ConfigError
from tfm.training import trackers, train
from tfm.training.experiment import parse_config
from tfm.training.metrics import MetricWriter, read_metrics

NUM_STEPS = 4


@pytest.fixture(scope="module", autouse=True)
def compilation_cache_dir(tmp_path_factory):
    """The module's runs share one model: later runs load its compiled steps."""
    with persistent_compilation_cache(tmp_path_factory.mktemp("jax_cache")):
        yield


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture
def wandb_offline(monkeypatch, tmp_path):
    """wandb, offline, its settings and caches inside tmp_path; skips without the package."""
    pytest.importorskip("wandb", reason='the wandb tracker needs pip install -e ".[wandb]"')
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb_home"))


def tiny_lm_config(data_dir: Path, num_steps: int = NUM_STEPS, **train_overrides):
    """A decoder-only model small enough that a run takes seconds; train and eval metrics
    logged every 2 steps."""
    config = synthetic_lm.get_config("runlocal")
    config.model.update(d_model=32, num_heads=2, d_ff=64, num_decoder_layers=1)
    config.data.update(data_dir=str(data_dir), batch_size=8, num_train_examples=64,
                       num_eval_examples=8)
    config.optimizer.update(total_steps=num_steps, warmup_steps=1)
    config.train.update(num_steps=num_steps, log_every=2, eval_every=2, checkpoint_every=2,
                        progress_bar=False, **train_overrides)
    config.eval.update(max_batches=1, max_generation_examples=2)
    return config


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf Records of an offline run's `run-*.wandb` file: a LevelDB-style log (a
    7-byte file header, then 32 KiB blocks of chunks: u32 crc, u16 length, u8 type (1 full,
    2 first, 3 middle, 4 last), data)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32 * 1024
    assert data[:4] == b":W&B"
    offset, parts = 7, []
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        parts.append(data[offset + 7:offset + 7 + length])
        offset += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def wandb_history_and_config(workdir: Path) -> tuple[list[dict], dict, set[str]]:
    """(history rows without wandb's own `_` keys, the last config value of each key, the run
    ids) of every offline run folder in WORKDIR/wandb, oldest first."""
    history, config, run_ids = [], {}, set()
    for path in sorted((workdir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run_ids.add(record.run.run_id)
            elif kind == "config":
                config.update({item.key: json.loads(item.value_json)
                               for item in record.config.update})
            elif kind == "history":
                row = {"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                       for item in record.history.item}
                history.append({k: v for k, v in row.items() if not k.startswith("_")}
                               | {"step": record.history.step.num})
    return history, config, run_ids


def merged_by_step(records: list[dict]) -> dict[int, dict]:
    """Records of one step (train and eval metrics are logged separately) merged into one."""
    merged: dict[int, dict] = {}
    for record in records:
        merged.setdefault(record["step"], {}).update(record)
    return merged


def test_wandb_run_holds_the_config_and_every_metric_and_resumes(data_dir, tmp_path,
                                                                 wandb_offline):
    workdir = tmp_path / "run"
    train.train_and_evaluate(tiny_lm_config(data_dir, tracker="wandb"), workdir)
    run_id = (workdir / trackers.WANDB_RUN_ID_FILE).read_text().strip()
    # The resume continues the same wandb run (offline: a second folder with that id).
    train.train_and_evaluate(tiny_lm_config(data_dir, NUM_STEPS + 2, tracker="wandb"), workdir)

    history, config, run_ids = wandb_history_and_config(workdir)
    assert run_ids == {run_id}
    assert len(list((workdir / "wandb").glob("offline-run-*"))) == 2
    expected = merged_by_step(read_metrics(workdir))
    assert sorted(expected) == [2, 4, 6]
    assert "train_loss" in expected[2] and "eval_loss" in expected[2]
    assert merged_by_step(history) == expected  # the same names and values
    assert config["train"]["tracker"] == "wandb" and config["train"]["num_steps"] == NUM_STEPS + 2
    assert config["model"]["d_model"] == 32
    assert not (workdir / "tensorboard").exists()


def test_tensorboard_is_the_default_and_gets_every_metric(data_dir, tmp_path):
    workdir = tmp_path / "run"
    train.train_and_evaluate(tiny_lm_config(data_dir), workdir)
    expected = [(record["step"], name, value) for record in read_metrics(workdir)
                for name, value in record.items() if name != "step"]
    scalars = tensorboard_scalars(workdir / "tensorboard")
    assert [(step, name) for step, name, _ in scalars] == [(s, n) for s, n, _ in expected]
    assert [value for *_, value in scalars] == pytest.approx([v for *_, v in expected], rel=1e-6)


def test_none_writes_only_metrics_jsonl(data_dir, tmp_path):
    workdir = tmp_path / "run"
    train.train_and_evaluate(tiny_lm_config(data_dir, tracker="none"), workdir)
    assert [r["step"] for r in read_metrics(workdir) if "train_loss" in r] == [2, 4]
    assert not (workdir / "tensorboard").exists() and not (workdir / "wandb").exists()


class RecordingTracker(trackers.Tracker):
    """A tracker that keeps what it is given: another tracker is one class in TRACKERS."""

    calls: list[tuple] = []

    def __init__(self, workdir: Path, run: trackers.RunInfo) -> None:
        self.calls.append(("init", workdir, run))

    def log_config(self, config):
        self.calls.append(("config", dict(config)))

    def log_metrics(self, step, scalars):
        self.calls.append(("metrics", step, dict(scalars)))

    def close(self):
        self.calls.append(("close",))


def test_a_tracker_registered_by_name_gets_what_metrics_jsonl_gets(tmp_path, monkeypatch):
    monkeypatch.setitem(trackers.TRACKERS, "recording", RecordingTracker)
    assert parse_config(tiny_lm_config(tmp_path, tracker="recording")).train.tracker == "recording"
    run = trackers.RunInfo("proj", "name")
    with MetricWriter(tmp_path, process_index=0, tracker="recording", run=run) as writer:
        writer.write_config({"train": {"seed": 0}})
        writer.write(1, {"loss": 2.5})
    assert RecordingTracker.calls == [
        ("init", tmp_path, run), ("config", {"train": {"seed": 0}}),
        ("metrics", 1, {"loss": 2.5}), ("close",),
    ]
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.5}]
    RecordingTracker.calls.clear()
    MetricWriter(tmp_path / "other", process_index=1, tracker="recording").close()
    assert RecordingTracker.calls == []  # only process 0 logs


def test_unknown_tracker_is_a_config_error_listing_the_choices(tmp_path):
    with pytest.raises(ConfigError) as error:
        parse_config(tiny_lm_config(tmp_path, tracker="mlflow"))
    assert str(error.value) == (
        "train.tracker='mlflow' is unknown; choose one of: tensorboard, wandb, none")
    with pytest.raises(ConfigError, match="train.tracker_project=''"):
        parse_config(tiny_lm_config(tmp_path, tracker_project=""))


def test_missing_wandb_is_one_line_naming_the_extra_before_anything_is_built(
        data_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    workdir = tmp_path / "run"
    with pytest.raises(ConfigError) as error:
        train.train_and_evaluate(tiny_lm_config(data_dir, tracker="wandb"), workdir)
    assert "\n" not in str(error.value) and 'pip install -e ".[wandb]"' in str(error.value)
    assert not workdir.exists()  # raised before setup: no data, no compilation, no files
