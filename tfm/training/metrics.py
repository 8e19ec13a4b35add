"""Metric logging: JSON lines plus an experiment tracker (TensorBoard by default:
tfm/training/trackers.py), and a console progress bar.

Only process 0 writes, so every host can call the same code in a multi-host run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tqdm

from tfm.training import trackers


def _scalar(value: Any) -> float | int:
    """A Python number from a number, numpy or jax scalar (device arrays are fetched)."""
    value = np.asarray(value)
    if value.size != 1:
        raise ValueError(f"metric values must be scalars; got shape {value.shape}")
    return value.item()


class MetricWriter:
    """Writes `{workdir}/metrics.jsonl` (one JSON object per `write`: {"step": ..., name:
    value, ...}), always, and the same scalars to an experiment tracker: `tracker` names one of
    trackers.TRACKERS ("tensorboard": scalars under `{workdir}/tensorboard/`; "wandb"; "none"),
    `run` says what the tracker files the run under (default: project "tfm", the workdir's name).

    `process_index` defaults to jax.process_index(); on any other process than 0 every method
    is a no-op. `resume_step`: the step a resumed run restarts from; records of later steps
    (written before a crash that lost those steps, which the run now replays) are dropped, so
    each step is recorded once. Use as a context manager or call `close()`.
    """

    def __init__(
        self,
        workdir: str | Path,
        process_index: int | None = None,
        *,
        resume_step: int | None = None,
        tracker: str = "tensorboard",
        run: trackers.RunInfo | None = None,
    ) -> None:
        if process_index is None:
            process_index = jax.process_index()
        self.active = process_index == 0
        self.path = Path(workdir) / "metrics.jsonl"
        self._jsonl = None
        self._tracker: trackers.Tracker | None = None
        if self.active:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and self.path.exists():
                _drop_records_after(self.path, resume_step)
            self._tracker = trackers.TRACKERS[tracker](Path(workdir), run or trackers.RunInfo())
            self._jsonl = self.path.open("a")

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        """Logs scalar `values` (numbers or 0-d arrays, e.g. {"train/loss": 2.3}) at `step`.
        NaN/inf are kept (JSON gets Python's NaN/Infinity tokens; json.loads reads them)."""
        if not self.active:
            return
        scalars = {name: _scalar(value) for name, value in values.items()}
        self._jsonl.write(json.dumps({"step": int(step), **scalars}) + "\n")
        self._jsonl.flush()
        self._tracker.log_metrics(int(step), scalars)

    def write_config(self, config: Mapping[str, Any]) -> None:
        """Logs the resolved experiment config (a nested dict) to the tracker."""
        if self.active:
            self._tracker.log_config(config)

    def write_text(self, step: int, name: str, text: str) -> None:
        """Logs text (e.g. sample translations) to the tracker only."""
        if self.active:
            self._tracker.log_text(int(step), name, text)

    def flush(self) -> None:
        if self.active:
            self._jsonl.flush()
            self._tracker.flush()

    def close(self) -> None:
        if self.active and self._jsonl is not None:
            self._jsonl.close()
            self._tracker.close()
            self._jsonl = None
            self.active = False

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _drop_records_after(path: Path, step: int) -> None:
    """Rewrites `path` without the records of steps after `step`, and without a last line a
    kill cut short (atomically: a crash leaves the old file or the new one)."""
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record["step"] <= step:
            kept.append(line + "\n")
    if len(kept) == len(lines) and path.read_text().endswith("\n"):
        return
    partial = path.with_name(path.name + ".tmp")
    partial.write_text("".join(kept))
    os.replace(partial, path)


def read_metrics(workdir: str | Path) -> list[dict[str, Any]]:
    """All records of `{workdir}/metrics.jsonl`, in order."""
    lines = (Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def progress_bar(
    total_steps: int,
    *,
    initial_step: int = 0,
    enabled: bool = True,
    desc: str = "train",
    unit: str = "step",
    leave: bool = True,
) -> tqdm.tqdm:
    """A tqdm bar over steps with rate and ETA; `bar.update(n)` per step and
    `bar.set_postfix(loss=...)` for live numbers. enabled=False gives a silent no-op bar
    (e.g. on processes other than 0, or in tests); leave=False clears it when closed."""
    return tqdm.tqdm(
        total=total_steps, initial=initial_step, desc=desc, disable=not enabled,
        dynamic_ncols=True, unit=unit, smoothing=0.1, leave=leave,
    )
