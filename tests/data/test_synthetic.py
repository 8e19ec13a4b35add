"""Synthetic tasks: answers verified independently, length ranges, determinism, tfds builder."""

import sys

import pytest

from tfm.data import builders, synthetic


@pytest.mark.parametrize("task", synthetic.TASKS)
def test_generated_answers_are_correct_and_lengths_in_range(task):
    for split, lengths in (("train", (1, 6)), ("test", (7, 12))):
        for index in range(150):
            source, target = synthetic.generate(
                task, index, seed=3, split=split, lengths=lengths, num_symbols=7
            )
            assert (
                synthetic.check_example(task, source, target, lengths=lengths, num_symbols=7)
                is None
            ), (source, target)


def test_known_answers():
    assert synthetic.solve("copy", "3141") == "3141"
    assert synthetic.solve("reverse", "3141") == "1413"
    assert synthetic.solve("sort", "3141") == "1134"
    assert synthetic.solve("addition", "123+4567") == "4690"
    assert synthetic.solve("addition", "999+1") == "1000"


@pytest.mark.parametrize(
    "task,source,wrong",
    [
        ("copy", "123", "124"),
        ("reverse", "123", "123"),
        ("sort", "312", "312"),
        ("sort", "3112", "123"),  # a lost duplicate
        ("addition", "95+7", "92"),  # a lost carry
        ("addition", "95+7", "0102"),
    ],
)
def test_checker_rejects_wrong_answers(task, source, wrong):
    assert synthetic.check_example(task, source, wrong, lengths=(1, 5)) is not None
    assert (
        synthetic.check_example(task, source, synthetic.solve(task, source), lengths=(1, 5)) is None
    )


def test_checker_rejects_lengths_outside_the_range():
    assert "outside" in synthetic.check_example("copy", "12345", "12345", lengths=(1, 4))
    assert "outside" in synthetic.check_example("addition", "1+23", "24", lengths=(2, 3))
    assert "leading zero" in synthetic.check_example("addition", "01+23", "24", lengths=(1, 3))


def test_same_seed_same_examples_and_independent_of_count():
    kwargs = dict(split="train", lengths=(1, 8))
    first = [synthetic.generate("addition", i, seed=5, **kwargs) for i in range(50)]
    again = [synthetic.generate("addition", i, seed=5, **kwargs) for i in range(50)]
    other = [synthetic.generate("addition", i, seed=6, **kwargs) for i in range(50)]
    assert first == again
    assert first != other
    test_split = [
        synthetic.generate("addition", i, seed=5, **{**kwargs, "split": "validation"})
        for i in range(50)
    ]
    assert first != test_split


def test_addition_draws_every_digit_count_of_the_range():
    counts = set()
    for index in range(300):
        source, _ = synthetic.generate("addition", index, seed=0, split="train", lengths=(2, 4))
        counts.update(len(part) for part in source.split("+"))
    assert counts == {2, 3, 4}


def test_vocabulary_covers_every_symbol():
    vocab = synthetic.vocabulary("reverse", 5)
    assert vocab == ["0", "1", "2", "3", "4", "+", "="]
    assert set(synthetic.vocabulary("addition")) == set("0123456789+=")
    with pytest.raises(ValueError, match="task='rotate' is unknown"):
        synthetic.vocabulary("rotate")


def test_builder_prepares_and_reads_back_without_tensorflow(tmp_path):
    builder = builders.synthetic_builder(
        tmp_path,
        task="sort",
        seed=1,
        num_symbols=6,
        train_lengths=(1, 4),
        eval_lengths=(5, 9),
        num_train=40,
        num_validation=10,
        num_test=12,
    )
    sources = builders.prepare(builder)
    assert {split: len(s) for split, s in sources.items()} == {
        "train": 40,
        "validation": 10,
        "test": 12,
    }
    for split, lengths in (("train", (1, 4)), ("validation", (1, 4)), ("test", (5, 9))):
        for index in range(len(sources[split])):
            record = sources[split][index]
            source, target = record["source"].decode(), record["target"].decode()
            assert (source, target) == synthetic.generate(
                "sort", index, seed=1, split=split, lengths=lengths, num_symbols=6
            )
            assert (
                synthetic.check_example("sort", source, target, lengths=lengths, num_symbols=6)
                is None
            )
    assert "tensorflow" not in sys.modules
    # Preparing again reuses the data; another seed gets its own directory.
    assert builders.synthetic_builder(
        tmp_path,
        task="sort",
        seed=1,
        num_symbols=6,
        train_lengths=(1, 4),
        eval_lengths=(5, 9),
        num_train=40,
        num_validation=10,
        num_test=12,
    ).is_prepared()
    assert not builders.synthetic_builder(tmp_path, task="sort", seed=2).is_prepared()


def test_failed_generation_leaves_nothing_that_looks_prepared(tmp_path, monkeypatch):
    real = synthetic.generate

    def failing(task, index, **kwargs):
        if kwargs["split"] == "test" and index == 3:
            raise RuntimeError("disk full")
        return real(task, index, **kwargs)

    monkeypatch.setattr(synthetic, "generate", failing)
    builder = builders.synthetic_builder(
        tmp_path, task="copy", num_train=5, num_validation=5, num_test=5
    )
    with pytest.raises(RuntimeError, match="disk full"):
        builders.prepare(builder)
    assert not builder.is_prepared()
    assert not list(tmp_path.rglob("dataset_info.json"))
    assert not list(tmp_path.rglob("*.array_record*"))
    monkeypatch.setattr(synthetic, "generate", real)
    fresh = builders.synthetic_builder(
        tmp_path, task="copy", num_train=5, num_validation=5, num_test=5
    )
    assert len(builders.prepare(fresh)["test"]) == 5


def _prepare_copy_in_subprocess(data_dir, barrier) -> int:
    builder = builders.synthetic_builder(
        data_dir, task="copy", num_train=2_000, num_validation=5, num_test=5
    )
    barrier.wait()  # both processes made their builder before either prepares
    return len(builders.prepare(builder)["train"])


def test_two_processes_prepare_the_same_dataset_at_once(tmp_path):
    """A sweep's parallel runs prepare the same data together: both must get it (without the
    lock the second rename failed with FileExistsError)."""
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    barrier = context.Manager().Barrier(2)
    with context.Pool(2) as pool:
        sizes = pool.starmap(_prepare_copy_in_subprocess, [(tmp_path, barrier)] * 2)
    assert sizes == [2_000, 2_000]
    assert len(list(tmp_path.rglob("dataset_info.json"))) == 1
