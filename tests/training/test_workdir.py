"""What a run's workdir records and what resuming it checks (tfm/training/workdir.py), and the
learning-rate schedule that follows train.num_steps (tfm/training/optim.py).

The traps these guard against made a wrong experiment look right: a raised train.num_steps ran
its extra steps at learning rate 0, and a workdir resumed another corpus's checkpoint.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
from compile_cache import persistent_compilation_cache

from configs import char_lm, synthetic_lm
from tfm.checks import ConfigError
from tfm.training import optim, train, workdir
from tfm.training.checkpoint import ConfigMismatchError
from tfm.training.config import parse_config

# ------------------------------------------------------------------------------ the schedule


@pytest.mark.parametrize("make_config", [
    lambda: char_lm.get_config("runlocal"),
    lambda: char_lm.get_config("small"),
    lambda: synthetic_lm.get_config("reverse,runlocal"),
])
def test_schedule_follows_a_raised_num_steps(make_config):
    """--config.train.num_steps=5x: the cosine schedule ends at the run's last step, so the
    rate in its last fifth is still well above 0 (with the length fixed at config-build time it
    was 0 there: the extra steps did not train)."""
    config = make_config()
    default_steps = config.train.num_steps
    config.train.num_steps = 5 * default_steps
    sections = parse_config(config)
    assert sections.optimizer.total_steps == 5 * default_steps
    schedule = optim.make_schedule(optim.dataclasses.asdict(sections.optimizer))
    peak = sections.optimizer.learning_rate
    at_old_end = float(schedule(default_steps + 10))
    assert at_old_end > 0.5 * peak  # cosine over 5x the steps: barely decayed there
    assert float(schedule(5 * default_steps - 1)) <= peak * (sections.optimizer.end_fraction
                                                            + 1e-3)


def test_explicit_total_steps_is_kept_and_noted():
    config = char_lm.get_config("runlocal")
    config.optimizer.total_steps = 40
    sections = parse_config(config)
    assert sections.optimizer.total_steps == 40
    note = optim.schedule_length_note(sections.optimizer, sections.train.num_steps)
    assert "optimizer.total_steps=40" in note and "last 60" in note
    config.optimizer.total_steps = None
    sections = parse_config(config)
    assert optim.schedule_length_note(sections.optimizer, sections.train.num_steps) is None


def test_schedule_counts_updates_under_gradient_accumulation():
    config = char_lm.get_config("runlocal")
    config.optimizer.grad_accum_steps = 4
    config.train.num_steps = 101
    assert parse_config(config).optimizer.total_steps == 26  # ceil(101 / 4)


def test_warmup_longer_than_the_run_names_both_fields():
    config = char_lm.get_config("runlocal")  # warmup_steps=10
    config.train.num_steps = 8
    with pytest.raises(ConfigError, match=r"optimizer.warmup_steps=10 .*train.num_steps=8"):
        parse_config(config)


def test_paper_schedule_has_no_length():
    sections = parse_config(char_lm.get_config("runlocal").copy_and_resolve_references())
    assert sections.optimizer.schedule == "cosine"
    values = optim.resolve_optimizer_config({"name": "adam_paper"}, num_steps=100)
    assert values["schedule"] == "paper" and values["total_steps"] == 100
    assert optim.schedule_length_note(optim.OptimizerConfig(**values), 100) is None


# ------------------------------------------------------------------ what a workdir holds


def _saved(**data):
    return {"data": {"kind": "text", "path": None, "tokenizer": "char", **data},
            "model": {"vocab_size": 65, "d_model": 64}}


def test_data_differences_name_the_field(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("one corpus\n")
    b.write_text("another one\n")
    lines = workdir.data_differences(_saved(path=str(a)), _saved(path=str(b)))
    assert lines == [f"data.path: saved {str(a)!r}, current {str(b)!r}"]


def test_a_copied_corpus_is_the_same_data(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "copy" / "a.txt"
    b.parent.mkdir()
    a.write_text("the same bytes\n")
    b.write_text("the same bytes\n")
    assert workdir.data_differences(_saved(path=str(a)), _saved(path=str(b))) == []
    b.write_text("the same bytes!\n")
    assert workdir.data_differences(_saved(path=str(a)), _saved(path=str(b))) != []


def test_check_resume_is_one_line_naming_data_and_model_fields(tmp_path):
    saved = _saved(path="x.txt")
    current = _saved(path="y.txt")
    current["model"]["vocab_size"] = 70
    with pytest.raises(ConfigMismatchError) as raised:
        workdir.check_resume(tmp_path, saved, current)
    message = str(raised.value)
    assert "\n" not in message
    assert message.index("data.path") < message.index("model.vocab_size")
    assert "--workdir" in message
    # Eval settings, row lengths and the learning rate may change on resume.
    changed = _saved(path="x.txt", seq_len=256, eval_seq_len=512, batch_size=3)
    workdir.check_resume(tmp_path, saved, changed)


# ---------------------------------------------------------------- resuming through train


@pytest.fixture(scope="module", autouse=True)
def compilation_cache_dir(tmp_path_factory):
    with persistent_compilation_cache(tmp_path_factory.mktemp("jax_cache")):
        yield


def _corpus(path, words):
    rng = random.Random(0)
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(12))
                                for _ in range(120)) + "\n")


def _tiny_text_config(data_dir, corpus, num_steps=4):
    config = char_lm.get_config("runlocal")
    config.model.update(d_model=16, num_heads=2, d_ff=32, num_decoder_layers=1)
    config.data.update(data_dir=str(data_dir), path=str(corpus), seq_len=16, eval_seq_len=16,
                       batch_size=8, eval_batch_size=8)
    config.optimizer.warmup_steps = 1
    config.train.update(num_steps=num_steps, log_every=2, eval_every=0,
                        checkpoint_every=num_steps, progress_bar=False)
    config.eval.max_batches = 1
    return config


def test_resuming_another_corpus_of_the_same_vocabulary_size_is_refused(tmp_path):
    """Two corpora over the same characters (so the same vocabulary size, the same parameter
    shapes): the second run in the first one's workdir fails before any step, naming
    data.path, and leaves the first run's config.json and checkpoints as they were. Then the
    first run resumed with more steps says where it resumed and that the schedule changed."""
    first, second = tmp_path / "first.txt", tmp_path / "second.txt"
    _corpus(first, ["abc", "cab", "bca"])
    _corpus(second, ["cba", "acb", "bac"])
    run = tmp_path / "run"
    train.train_and_evaluate(_tiny_text_config(tmp_path / "data", first), run)
    record = (run / "config.json").read_text()
    assert json.loads(record)["optimizer"]["total_steps"] == 4  # resolved, in the record

    with pytest.raises(ConfigMismatchError, match="data.path") as raised:
        train.train_and_evaluate(_tiny_text_config(tmp_path / "data", second), run)
    assert "--workdir" in str(raised.value) and "model.vocab_size" not in str(raised.value)
    assert (run / "config.json").read_text() == record
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == ["4"]

    lines: list[str] = []
    original = train._Log.__init__

    def capture(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.say = lines.append

    train._Log.__init__ = capture
    try:
        result = train.train_and_evaluate(_tiny_text_config(tmp_path / "data", first, 6), run)
    finally:
        train._Log.__init__ = original
    assert result["step"] == 6
    resumed = [line for line in lines if line.startswith("resumed from step 4 of 6")]
    assert len(resumed) == 1, lines
    assert f"workdir {run}" in resumed[0]
    assert "optimizer.total_steps: saved 4, current 6" in resumed[0]
    assert np.isfinite(result["train_loss"])


def test_config_json_is_replaced_whole(tmp_path, monkeypatch):
    """Another process of the run reads config.json while process 0 writes it: a reader sees
    the old text or the new, never an empty or partial file (it once saw "": JSONDecodeError)."""
    workdir.write_config(tmp_path, '{"old": 1}')
    seen = []
    original = workdir.Path.write_text

    def write_then_read(self, text, *args, **kwargs):
        result = original(self, text, *args, **kwargs)
        seen.append(workdir.read_config(tmp_path))  # a reader between write and rename
        return result

    monkeypatch.setattr(workdir.Path, "write_text", write_then_read)
    workdir.write_config(tmp_path, '{"new": 2}')
    assert seen == [{"old": 1}]
    assert workdir.read_config(tmp_path) == {"new": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_a_workdir_from_before_passkey_rows_resumes_and_new_rows_are_another_dataset():
    before = _saved(path="x.txt")  # written before the passkey fields existed
    now = _saved(path="x.txt", passkey_rows=0, passkey_alphabet="0123456789",
                 passkey_key_length=5)
    assert workdir.data_differences(before, now) == []
    mixed = _saved(path="x.txt", passkey_rows=100, passkey_alphabet="0123456789",
                   passkey_key_length=5)
    assert workdir.data_differences(before, mixed) == ["data.passkey_rows: saved 0, current 100"]
