"""Metric logging: JSON lines plus TensorBoard event files, and a console progress bar.

Only process 0 writes, so every host can call the same code in a multi-host run.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tqdm


def _scalar(value: Any) -> float | int:
    """A Python number from a number, numpy or jax scalar (device arrays are fetched)."""
    value = np.asarray(value)
    if value.size != 1:
        raise ValueError(f"metric values must be scalars; got shape {value.shape}")
    return value.item()


class MetricWriter:
    """Writes `{workdir}/metrics.jsonl` (one JSON object per `write`: {"step": ..., name:
    value, ...}) and TensorBoard scalars under `{workdir}/tensorboard/`.

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
    ) -> None:
        if process_index is None:
            process_index = jax.process_index()
        self.active = process_index == 0
        self.path = Path(workdir) / "metrics.jsonl"
        self._jsonl = None
        self._tensorboard = None
        if self.active:
            writer_class = _tensorboardx_writer()  # imported lazily: only process 0 needs it
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if resume_step is not None and self.path.exists():
                _drop_records_after(self.path, resume_step)
            self._jsonl = self.path.open("a")
            self._tensorboard = writer_class(str(Path(workdir) / "tensorboard"))

    def write(self, step: int, values: Mapping[str, Any]) -> None:
        """Logs scalar `values` (numbers or 0-d arrays, e.g. {"train/loss": 2.3}) at `step`.
        NaN/inf are kept (JSON gets Python's NaN/Infinity tokens; json.loads reads them)."""
        if not self.active:
            return
        scalars = {name: _scalar(value) for name, value in values.items()}
        self._jsonl.write(json.dumps({"step": int(step), **scalars}) + "\n")
        self._jsonl.flush()
        for name, value in scalars.items():
            self._tensorboard.add_scalar(name, float(value), int(step))

    def write_text(self, step: int, name: str, text: str) -> None:
        """Logs text (e.g. the experiment config, sample translations) to TensorBoard only."""
        if self.active:
            self._tensorboard.add_text(name, text, int(step))

    def flush(self) -> None:
        if self.active:
            self._jsonl.flush()
            self._tensorboard.flush()

    def close(self) -> None:
        if self.active and self._jsonl is not None:
            self._jsonl.close()
            self._tensorboard.close()
            self._jsonl = None
            self.active = False

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _tensorboardx_writer() -> type:
    """tensorboardX's SummaryWriter, imported without torch: tensorboardX imports torch when it
    is installed (2-3 s on a CPU laptop, at every run's start) only to accept torch tensors,
    which tfm never passes. A process that already imported torch keeps it."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # `import torch` raises ImportError while this is set
    try:
        from tensorboardX import SummaryWriter
    finally:
        del sys.modules["torch"]
    return SummaryWriter


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


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_absl_message(prefix: str) -> None:
    """Drops absl log records (tfds and orbax log through absl) whose message starts with
    `prefix`: for warnings about what tfm does on purpose, printed on every command."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _DropMessages) and f.prefix == prefix for f in logger.filters):
        logger.addFilter(_DropMessages(prefix))
