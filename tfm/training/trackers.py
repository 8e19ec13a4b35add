"""Experiment trackers: where a run's metrics go besides `{workdir}/metrics.jsonl`.

`train.tracker` picks one by name from TRACKERS: "tensorboard" (the default: event files under
`{workdir}/tensorboard/`), "wandb" (Weights & Biases, files under `{workdir}/wandb/`; offline
with WANDB_MODE=offline), or "none" (metrics.jsonl only). Another tracker (MLflow, aim) is one
Tracker subclass added to TRACKERS. metrics.MetricWriter owns the tracker and calls it on
process 0 only.
"""

from __future__ import annotations

import dataclasses
import html
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tfm.checks import ConfigError


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a tracker files a run under: `project` (wandb's project, MLflow's experiment) and
    `name` (None = the workdir's folder name)."""

    project: str = "tfm"
    name: str | None = None


class Tracker:
    """The interface, and the "none" tracker: every method does nothing.

    `scalars` are Python numbers, already converted by the MetricWriter; `step` is the train
    step they belong to (train and eval metrics of one step share it)."""

    def __init__(self, workdir: Path, run: RunInfo) -> None:
        del workdir, run

    @classmethod
    def check_installed(cls) -> None:
        """Raises ConfigError, one line naming the pip extra, if the tracker's package is
        missing: called when training starts, before anything compiles."""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The resolved experiment config, as a nested dict of JSON values."""

    def log_metrics(self, step: int, scalars: Mapping[str, float | int]) -> None:
        pass

    def log_text(self, step: int, name: str, text: str) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    """TensorBoard scalars and text under `{workdir}/tensorboard/` (tensorboardX). The config is
    not logged: config.json sits next to the events already."""

    def __init__(self, workdir: Path, run: RunInfo) -> None:
        writer_class = _tensorboardx_writer()  # imported lazily: only process 0 needs it
        self._writer = writer_class(str(Path(workdir) / "tensorboard"))

    def log_metrics(self, step: int, scalars: Mapping[str, float | int]) -> None:
        for name, value in scalars.items():
            self._writer.add_scalar(name, float(value), int(step))

    def log_text(self, step: int, name: str, text: str) -> None:
        self._writer.add_text(name, text, int(step))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


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


WANDB_RUN_ID_FILE = "wandb_run_id"  # in the workdir: a resumed run continues the same wandb run


class WandbTracker(Tracker):
    """A Weights & Biases run whose files land in `{workdir}/wandb/`. Its id is kept in
    `{workdir}/wandb_run_id`, so a resumed training run continues the same wandb run (offline,
    each resume writes another run folder with that id; `wandb sync` joins them). wandb drops
    steps below its last logged one, so steps a resume replays keep their first values there."""

    def __init__(self, workdir: Path, run: RunInfo) -> None:
        wandb = _import_wandb()
        workdir = Path(workdir)
        id_file = workdir / WANDB_RUN_ID_FILE
        if not id_file.exists():
            id_file.write_text(uuid.uuid4().hex[:12] + "\n")  # wandb ids: [a-z0-9]
        self._run = wandb.init(
            project=run.project, name=run.name or workdir.resolve().name, dir=str(workdir),
            id=id_file.read_text().strip(), resume="allow",
        )

    @classmethod
    def check_installed(cls) -> None:
        _import_wandb()

    def log_config(self, config: Mapping[str, Any]) -> None:
        # allow_val_change: a resumed run may change e.g. train.num_steps.
        self._run.config.update(dict(config), allow_val_change=True)

    def log_metrics(self, step: int, scalars: Mapping[str, float | int]) -> None:
        self._run.log(dict(scalars), step=int(step))

    def log_text(self, step: int, name: str, text: str) -> None:
        wandb = _import_wandb()
        self._run.log({name: wandb.Html(f"<pre>{html.escape(text)}</pre>")}, step=int(step))

    def close(self) -> None:
        self._run.finish()


def _import_wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ConfigError(
            'train.tracker="wandb" needs the wandb package: pip install -e ".[wandb]"'
        ) from None
    return wandb


# train.tracker's choices; a new tracker is one entry here.
TRACKERS: dict[str, type[Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "none": Tracker,
}
