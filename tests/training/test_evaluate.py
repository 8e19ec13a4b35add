"""Generation checks of tfm/training/evaluate.py that run before any checkpoint is read or
anything compiles: generation past the trained context (a warning for every position scheme)
and past a learned position table (an error). The metrics themselves are tested end to end in
tests/training/test_train.py."""

from __future__ import annotations

import dataclasses

import pytest

from configs import char_lm
from tfm.training.evaluate import PromptError, check_prompts, generate_from_checkpoint
from tfm.training.experiment import setup

LOGGER = "tfm.training.train"


def char_experiment(tmp_path, max_new_tokens: int = 100, **model):
    """configs/char_lm.py:small as the issue reproduced it: learned positions, 64-character
    training rows, model.max_len=256, 100 new tokens."""
    config = char_lm.get_config("small")
    config.data.seq_len = 64
    config.data.update(batch_size=8, eval_batch_size=8)  # divisible by the 8 test devices
    config.model.update({"position_scheme": "learned", "max_len": 256, **model})
    config.generate.max_new_tokens = max_new_tokens
    return config, setup(config, tmp_path / "run")


def warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name == LOGGER]


@pytest.mark.parametrize("scheme", ["learned", "rope", "alibi"])
def test_generating_past_the_trained_context_is_one_warning_for_every_scheme(
        tmp_path, caplog, scheme):
    """'ROMEO:' is 7 tokens with BOS; 7 + 100 new ones reach position 107, 43 past the
    64-character rows: one line, whatever the scheme; 7 + 57 = 64 stays silent."""
    _, experiment = char_experiment(tmp_path, position_scheme=scheme)
    with caplog.at_level("WARNING", logger=LOGGER):
        check_prompts(experiment, ["ROMEO:", "AB"], map_unknown=False)
    assert warnings(caplog) == [
        "generating 43 tokens past the trained context of 64 (data.seq_len): prompt 1 "
        f"'ROMEO:' is 7 tokens + generate.max_new_tokens=100; quality may degrade "
        f"(position_scheme={scheme!r})"]
    caplog.clear()
    fits = dataclasses.replace(experiment.generate.decode, max_new_tokens=57)
    experiment.generate = dataclasses.replace(experiment.generate, decode=fits)
    with caplog.at_level("WARNING", logger=LOGGER):
        check_prompts(experiment, ["ROMEO:"], map_unknown=False)
    assert warnings(caplog) == []


def test_a_prompt_already_past_the_trained_context_counts_every_new_token(tmp_path, caplog):
    _, experiment = char_experiment(tmp_path, max_new_tokens=10, position_scheme="rope")
    with caplog.at_level("WARNING", logger=LOGGER):
        check_prompts(experiment, ["x" * 80], map_unknown=False)
    [message] = warnings(caplog)
    assert message.startswith("generating 10 tokens past the trained context of 64 ")


def test_learned_positions_past_max_len_are_refused_before_reading_a_checkpoint(tmp_path):
    """7 + 250 positions > model.max_len=256: one line naming the fields and numbers, raised
    before the (empty) workdir is read or anything compiles."""
    config, _ = char_experiment(tmp_path, max_new_tokens=250)
    with pytest.raises(PromptError) as error:
        generate_from_checkpoint(config, tmp_path / "run", ["ROMEO:"])
    assert str(error.value) == (
        "prompt 1 'ROMEO:' is 7 tokens; its prompt and output needs 257 positions, past "
        "model.max_len=256 of the learned position table; shorten the prompt or lower "
        "generate.max_new_tokens")
