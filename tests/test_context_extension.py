"""experiments/context_extension.py: the study's runs and evaluations say what its docstring
says (scalings set for the evaluated length, fine-tunes at the pretraining's tokens per step from
the RoPE run of the same seed), and its tables are means and sample stds over seeds."""

import importlib.util
import math
from pathlib import Path

import pytest

from configs import context_extension as study

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location(
        "context_extension_study", ROOT / "experiments" / "context_extension.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flag(command, name):
    [value] = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"--config.{name}=")]
    return value


def test_zero_shot_scalings_are_set_for_the_evaluated_length(script):
    assert script._zero_shot("linear", 1024) == {"rope_scaling": "linear",
                                                 "rope_scaling_factor": 4.0}
    assert script._zero_shot("yarn", 256) == {"rope_scaling": "yarn", "rope_scaling_factor": 1.0}
    assert script._zero_shot("dynamic", 4096)["rope_scaling_factor"] == 1.0  # sets its own


def test_a_fine_tune_starts_from_its_seeds_rope_run_at_the_same_tokens_per_step(script, tmp_path):
    for factor in script.FINETUNE_FACTORS:
        command = script.finetune_command(tmp_path, "yarn", factor, seed=2)
        length, rows = int(_flag(command, "data.seq_len")), int(_flag(command, "data.batch_size"))
        assert length == factor * study.TRAIN_LENGTH
        assert length * rows == study.TOKENS_PER_STEP
        assert _flag(command, "init.checkpoint") == str(script.pretrain_dir(tmp_path, "rope", 2))
        assert _flag(command, "model.rope_scaling_factor") == str(factor)
        assert int(_flag(command, "train.num_steps")) == study.FINETUNE_STEPS
        assert _flag(command, "eval.passkey_lengths") == f"({length - 7},)"


def test_every_row_has_every_seed_but_the_one_seed_schemes(script, tmp_path, monkeypatch):
    rows = script.variants(tmp_path, [0, 1, 2])
    seeds = {}
    for row in rows:
        seeds.setdefault(row["row"], []).append(row["seed"])
    assert "fire" in seeds and all(found == [0, 1, 2] for found in seeds.values())
    monkeypatch.setattr(script, "ONLY_SEEDS", {"fire": (0,)})
    fire = [row["seed"] for row in script.variants(tmp_path, [0, 1, 2]) if row["row"] == "fire"]
    assert fire == [0]
    assert "rope + yarn, fine-tuned at 4x" in seeds and "none + log-length temperature" in seeds


def test_tables_are_means_and_sample_stds_over_seeds(script):
    def metrics(loss, exact, nll):
        return {"eval_loss": loss, "passkey/passkey_len249": exact,
                "passkey/passkey_len249_key_nll": nll, "passkey/passkey_len249_key_chars": 10.0,
                **{f"passkey/passkey_len249_depth{d:g}": exact for d in script.PASSKEY_DEPTHS}}

    table = script.collect({"rope|0|256": metrics(1.0, 20.0, 1.5),
                            "rope|1|256": metrics(2.0, 40.0, 2.5)})
    cell = table["rope"][256]
    assert cell["ppl"] == pytest.approx([math.e, math.e**2])
    assert cell["passkey"] == [20.0, 40.0] and cell["depth"][0.5] == [20.0, 40.0]
    text = script.markdown(table, "key_nll", 2)
    # mean 2.0, sample std sqrt(((1.5 - 2)^2 + (2.5 - 2)^2) / 1) = 0.71
    assert "| rope | 2.00 ± 0.71 | - | - | - | - |" in text
