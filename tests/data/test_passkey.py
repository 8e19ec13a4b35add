"""Passkey and multi-key prompts: the length each asks for, the key where the depth says,
one answer, deterministic, and the accuracy table."""

from __future__ import annotations

import re

import pytest

from tfm.data import passkey

ENCODE = lambda text: text.encode()  # noqa: E731  (bytes: one token per ASCII character)


@pytest.mark.parametrize("length", [200, 1000, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_the_prompt_fills_its_length_and_holds_the_key_at_its_depth(length, depth):
    example = passkey.make_example("passkey", length, depth, 0, encode=ENCODE, seed=3)
    size = len(ENCODE(example.prompt))
    assert length - 25 <= size <= length  # filler is cut at a word
    key = example.answer.strip()
    assert len(key) == 5 and key.isdigit()
    start = example.prompt.index(f"The pass key is {key}")
    body_start = len(passkey.INTRO) + 1
    body_end = example.prompt.index("What is the pass key?")
    line = len(f"The pass key is {key}. Remember it. {key} is the pass key.") + 1
    where = (start - body_start) / max(1, body_end - body_start - line)
    assert where == pytest.approx(depth, abs=0.03 + 30 / length)
    assert example.prompt.endswith("What is the pass key? The pass key is")


def test_examples_are_deterministic_and_differ_by_index_and_seed():
    make = lambda index, seed: passkey.make_example(  # noqa: E731
        "passkey", 300, 0.5, index, encode=ENCODE, seed=seed)
    assert make(0, 0) == make(0, 0)
    keys = {make(index, 0).answer for index in range(20)}
    assert len(keys) > 15
    assert make(0, 0).answer != make(0, 1).answer


def test_multi_key_asks_for_one_of_several_keys_all_present():
    example = passkey.make_example("multi_key", 800, 0.25, 2, encode=ENCODE, num_keys=4,
                                   alphabet="abcdefgh")
    keys = dict(re.findall(r"The pass key of (\w+) is (\w+)\.", example.prompt))
    assert len(keys) == 4
    asked = example.prompt.rsplit("What is the pass key of ", 1)[1].split("?")[0]
    assert example.prompt.endswith(f"What is the pass key of {asked}? The pass key of {asked} is")
    assert example.answer == f" {keys[asked]}"
    assert set(example.answer.strip()) <= set("abcdefgh")


def test_too_short_a_length_and_a_bad_depth_are_clear_errors():
    with pytest.raises(ValueError, match="length=50 is too short"):
        passkey.make_example("passkey", 50, 0.5, 0, encode=ENCODE)
    with pytest.raises(ValueError, match="depth=1.5 must be in"):
        passkey.make_example("passkey", 500, 1.5, 0, encode=ENCODE)
    with pytest.raises(ValueError, match="task='needle' is unknown"):
        passkey.make_example("needle", 500, 0.5, 0, encode=ENCODE)


def test_accuracy_by_cell_counts_exact_keys():
    cells = passkey.make_cells("passkey", [200, 400], [0.0, 1.0], 2, encode=ENCODE)
    assert len(cells) == 8
    predictions = [example.answer + " and more" if i % 2 == 0 else " 00000x"
                   for i, example in enumerate(cells)]
    table = passkey.accuracy_by_cell(cells, predictions)
    assert table == {(200, 0.0): 0.5, (200, 1.0): 0.5, (400, 0.0): 0.5, (400, 1.0): 0.5}


def test_training_rows_hold_their_key_at_spread_depths_and_fit_their_length():
    """Training rows: prompt (at most `length` characters) + " " + key, the key inside the
    prompt once, at depths that cover [0, 1]; none equals an evaluation example's text."""
    texts = passkey.training_texts(40, 249, alphabet="abcdefghij", key_length=4)
    assert texts == passkey.training_texts(40, 249, alphabet="abcdefghij", key_length=4)
    fractions = []
    for text in texts:
        prompt, key = text.rsplit(" ", 1)
        assert len(prompt) <= 249 and len(key) == 4 and set(key) <= set("abcdefghij")
        assert prompt.endswith("What is the pass key? The pass key is")
        assert prompt.count(f"The pass key is {key}. Remember it. {key} is the pass key.") == 1
        fractions.append(prompt.index("The pass key is") / len(prompt))
    assert min(fractions) < 0.25 and max(fractions) > 0.6  # near the start and near the end
    assert len({round(f, 1) for f in fractions}) >= 6
    evaluation = passkey.make_cells("passkey", [249], [0.0, 0.5, 1.0], 8, encode=list,
                                    alphabet="abcdefghij", key_length=4)
    assert not {e.prompt + e.answer for e in evaluation} & set(texts)
