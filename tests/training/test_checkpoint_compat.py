"""Checkpoints written by earlier code restore and resume with today's
(tests/fixtures/checkpoints/, written by tests/fixtures/make_checkpoint_fixtures.py at 5abb8e2,
before the package was regrouped into tfm/nn, tfm/training, ...)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from tfm.training import metrics, train
from tfm.training.experiment import setup
from tfm.training.state import restore_params

FIXTURES = Path(__file__).parents[1] / "fixtures" / "checkpoints"
SAVED_STEP = 4


def load_config(fixture: Path, tmp_path: Path) -> ml_collections.ConfigDict:
    """The fixture's experiment config as today's code takes it."""
    config = ml_collections.ConfigDict(json.loads((fixture / "config.json").read_text()))
    config.data.data_dir = str(tmp_path / "data")
    # Saved with attention_backend="reference" (the old default); today's default is "auto".
    assert config.model.attention_backend == "reference"
    config.model.attention_backend = "auto"
    for section, values in config.items():  # JSON turned tuples into lists
        for key, value in values.items() if isinstance(values, ml_collections.ConfigDict) else ():
            if isinstance(value, list):
                config[section][key] = tuple(value)
    return config


def assert_restores_to_the_saved_logits(config, workdir: Path, fixture: Path) -> None:
    experiment = setup(config, workdir)
    params, step = restore_params(experiment)
    assert step == SAVED_STEP
    expected = np.load(fixture / "expected.npz")
    batch = {key: jnp.asarray(expected[key]) for key in expected.files if key != "logits"}
    logits = experiment.family.logits(experiment.model, params, batch, deterministic=True)
    np.testing.assert_allclose(np.asarray(logits), expected["logits"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["lm", "seq2seq"])
def test_old_checkpoint_restores_to_the_same_logits_and_resumes(family, tmp_path):
    fixture = FIXTURES / family
    workdir = tmp_path / "workdir"
    shutil.copytree(fixture / "workdir", workdir)
    config = load_config(fixture, tmp_path)
    assert_restores_to_the_saved_logits(config, workdir, fixture)

    config.train.num_steps = SAVED_STEP + 1
    result = train.train_and_evaluate(config, workdir)
    assert result["step"] == SAVED_STEP + 1
    steps = [r["step"] for r in metrics.read_metrics(workdir) if "train_loss" in r]
    assert steps == list(range(1, SAVED_STEP + 2))  # 1-4 from the old run, 5 resumed


@pytest.mark.parametrize("remat", ["full", "dots_saveable", "none"])
def test_checkpoint_saved_with_remat_true_restores_under_a_policy_name(remat, tmp_path):
    """model.remat was a bool; a checkpoint saved with remat=True restores (remat chooses no
    parameters) with remat set to any policy."""
    fixture = FIXTURES / "lm"
    workdir = tmp_path / "workdir"
    shutil.copytree(fixture / "workdir", workdir)
    saved = workdir / "checkpoints" / str(SAVED_STEP) / "config" / "metadata"
    values = json.loads(saved.read_text())
    assert values["model"]["remat"] is False
    values["model"]["remat"] = True
    saved.write_text(json.dumps(values))
    config = load_config(fixture, tmp_path)
    config.model = ml_collections.ConfigDict({**config.model.to_dict(), "remat": remat})
    assert_restores_to_the_saved_logits(config, workdir, fixture)
