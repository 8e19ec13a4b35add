"""The first state of a run: init.checkpoint starts from another run's parameters (a fine-tune,
e.g. at a longer context with a RoPE scaling), with a fresh optimizer and step 0; what cannot
be started from is refused in one line naming the field."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest
from compile_cache import persistent_compilation_cache

from configs import char_lm
from tfm.checks import ConfigError
from tfm.training import state, train
from tfm.training.config import parse_config
from tfm.training.experiment import setup


@pytest.fixture(scope="module", autouse=True)
def compilation_cache_dir(tmp_path_factory):
    with persistent_compilation_cache(tmp_path_factory.mktemp("jax_cache")):
        yield


def _config(tmp_path, **model):
    corpus = tmp_path / "corpus.txt"
    if not corpus.exists():
        rng = random.Random(0)
        words = ["abc", "cab", "bca"]
        corpus.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(12))
                                      for _ in range(120)) + "\n")
    config = char_lm.get_config("runlocal")
    config.model.update({**dict(d_model=16, num_heads=2, d_ff=32, num_decoder_layers=1,
                                position_scheme="rope", rope_original_max_len=16), **model})
    config.data.update(data_dir=str(tmp_path / "data"), path=str(corpus), seq_len=16,
                       eval_seq_len=16, batch_size=8, eval_batch_size=8)
    config.optimizer.warmup_steps = 1
    config.train.update(num_steps=3, log_every=3, eval_every=0, checkpoint_every=3,
                        progress_bar=False)
    config.eval.max_batches = 1
    return config


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(folder, its config, params after 3 steps)."""
    folder = tmp_path_factory.mktemp("first")
    config = _config(folder)
    train.train_and_evaluate(config, folder / "run")
    params, _ = state.restore_params(setup(parse_config(config), folder / "run"))
    return folder, config, params


def _initial_state(config, workdir):
    experiment = setup(parse_config(config), workdir)
    _, shardings = state.state_shardings(experiment)
    return experiment, state.init_state(experiment, shardings)


def test_a_fine_tune_starts_from_the_checkpoint_params_at_a_longer_length(trained, tmp_path):
    folder, config, params = trained
    fine_tune = _config(folder, rope_scaling="yarn", rope_scaling_factor=2.0)  # EVAL_TIME
    fine_tune.data.seq_len = 32
    fine_tune.init.checkpoint = str(folder / "run")
    experiment, first = _initial_state(fine_tune, tmp_path / "fine_tune")
    assert int(first.step) == 0
    jax.tree.map(np.testing.assert_array_equal, first.params, params)
    fresh = experiment.optimizer.init(params)
    jax.tree.map(np.testing.assert_array_equal, first.opt_state, fresh)
    # The same run without init.checkpoint starts elsewhere.
    fine_tune.init.checkpoint = None
    _, other = _initial_state(fine_tune, tmp_path / "scratch")
    differs = jax.tree.map(lambda a, b: not np.array_equal(a, b), other.params, params)
    assert any(jax.tree.leaves(differs))


def test_another_model_is_refused_naming_the_field(trained, tmp_path):
    folder, _, _ = trained
    config = _config(folder, d_ff=64)
    config.init.checkpoint = str(folder / "run")
    with pytest.raises(ConfigError, match=r"init.checkpoint=.*model.d_ff: saved 32") as raised:
        _initial_state(config, tmp_path / "other")
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize("init, pattern", [
    (dict(checkpoint="/nonexistent/run"), r"init.checkpoint='/nonexistent/run' must be a tfm "
                                          "workdir"),
    (dict(checkpoint_step=3), "init.checkpoint_step is set without init.checkpoint"),
    (dict(checkpoint_step=-1, checkpoint="WORKDIR"), "init.checkpoint_step=-1"),
    (dict(pretrained=None, checkpoint="WORKDIR", extra=1), "init.extra is unknown"),
])
def test_bad_init_settings_are_one_line_errors(trained, init, pattern):
    folder, _, _ = trained
    config = _config(folder)
    with config.unlocked():
        for key, value in init.items():
            config.init[key] = str(folder / "run") if value == "WORKDIR" else value
    with pytest.raises(ConfigError, match=pattern) as raised:
        parse_config(config)
    assert "\n" not in str(raised.value)
