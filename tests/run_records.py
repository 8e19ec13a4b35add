"""What a finished training run left in its workdir, read back for resume tests: the logged
train losses by step and a saved state, and bitwise comparison of states."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np

from tfm.training import checkpoint, metrics


def train_losses(workdir: Path) -> dict[int, float]:
    return {r["step"]: r["train_loss"] for r in metrics.read_metrics(workdir) if "train_loss" in r}


def saved_state(workdir: Path, step: int):
    """The state saved at `step`, as numpy arrays (restored as written, no config check)."""
    with checkpoint.Checkpointer(workdir / "checkpoints", async_save=False) as checkpointer:
        return jax.tree.map(np.asarray, checkpointer.restore(step))


def assert_trees_equal(a, b) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)
