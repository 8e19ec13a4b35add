"""Local tfds builders (text file, parallel files), bad input, and catalog datasets (mocked)."""

import gzip
import sys

import pytest
import tensorflow_datasets as tfds

from tfm.checks import ConfigError
from tfm.data import builders, passkey
from tfm.data.builders import DataError


def _texts(source, key="text"):
    return [source[i][key].decode() for i in range(len(source))]


def test_text_file_paragraphs_with_deterministic_tail_validation(tmp_path):
    paragraphs = [f"Speaker {i}:\nline one of {i}\nline two é" for i in range(10)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    builder = builders.text_file_builder(tmp_path / "data", path, validation_fraction=0.2)
    sources = builders.prepare(builder)
    assert _texts(sources["train"]) == paragraphs[:8]
    assert _texts(sources["validation"]) == paragraphs[8:]
    assert "tensorflow" not in sys.modules


def test_text_file_lines_gzip_and_crlf(tmp_path):
    path = tmp_path / "lines.txt.gz"
    path.write_bytes(gzip.compress(b"alpha\r\n\r\nbeta\r\ngamma\r\ndelta\r\n"))
    sources = builders.prepare(
        builders.text_file_builder(tmp_path, path, text_unit="line", validation_fraction=0.25)
    )
    assert _texts(sources["train"]) == ["alpha", "beta", "gamma"]
    assert _texts(sources["validation"]) == ["delta"]


def test_text_file_blocks_keep_the_text_contiguous(tmp_path, monkeypatch):
    monkeypatch.setattr(builders, "TEXT_BLOCK_CHARS", 7)
    text = "ab\n\ncd ef\n" * 6  # 60 characters: 8 blocks of 7 and one of 4
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    sources = builders.prepare(
        builders.text_file_builder(tmp_path, path, text_unit="block", validation_fraction=0.25)
    )
    train, validation = _texts(sources["train"]), _texts(sources["validation"])
    assert [len(b) for b in train + validation] == [7] * 8 + [4]
    assert (len(train), len(validation)) == (7, 2)
    assert "".join(train + validation) == text  # nothing stripped or dropped


def test_text_without_blank_lines_is_read_a_line_an_example(tmp_path, caplog):
    """One sentence a line, no blank lines, as many corpora come: with the default
    text_unit="paragraph" the whole file was one example, and the holdout failed with "1
    example(s) are too few"; now each line is an example, said in one logged line."""
    sentences = [f"Sentence number {i} ends here." for i in range(10)]
    path = tmp_path / "sentences.txt"
    path.write_text("\n".join(sentences) + "\n", encoding="utf-8")
    with caplog.at_level("WARNING", logger="tfm.data.builders"):
        sources = builders.prepare(builders.text_file_builder(tmp_path / "data", path))
    assert _texts(sources["train"]) == sentences[:9]
    assert _texts(sources["validation"]) == sentences[9:]
    [note] = [r.getMessage() for r in caplog.records if "no blank lines" in r.getMessage()]
    assert f"{path} has no blank lines, so each of its 10 lines is an example" in note


def test_too_few_text_units_name_text_unit_and_the_one_that_fits(tmp_path, monkeypatch):
    monkeypatch.setattr(builders, "TEXT_BLOCK_CHARS", 7)
    path = tmp_path / "one_line.txt"
    path.write_text("a single line of text, no line breaks\n", encoding="utf-8")  # 6 blocks
    for unit in ("paragraph", "line"):
        with pytest.raises(DataError) as info:
            builders.prepare(builders.text_file_builder(tmp_path / unit, path, text_unit=unit))
        assert str(info.value) == (
            f"data.path: {path} holds 1 {unit}(s) (data.text_unit={unit!r}; choose one of: "
            "paragraph, line, block), too few to hold out a validation split of 0.1: set "
            "--config.data.text_unit=block (6 blocks of 7 characters)")
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("abc\n", encoding="utf-8")
    with pytest.raises(DataError, match="add text or lower --config.data.validation_fraction"):
        builders.prepare(builders.text_file_builder(tmp_path / "tiny", tiny))


def test_fast_records_equal_tfds_decoding(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("one\n\ntwo ü\n\nthree 漢\n\nfour\n", encoding="utf-8")
    builder = builders.text_file_builder(tmp_path, path, validation_fraction=0.25)
    fast = builders.prepare(builder)["train"]
    reference = builder.as_data_source(split="train")
    assert [fast[i] for i in range(len(fast))] == [reference[i] for i in range(len(reference))]
    assert fast.__getitems__([2, 0]) == [reference[2], reference[0]]


def _write_parallel(directory, name, source_lines, target_lines, gz=False):
    paths = []
    for suffix, lines in (("de", source_lines), ("en", target_lines)):
        data = "".join(f"{line}\n" for line in lines).encode()
        path = directory / (f"{name}.{suffix}" + (".gz" if gz else ""))
        path.write_bytes(gzip.compress(data) if gz else data)
        paths.append(path)
    return paths


def test_parallel_files_plain_and_gzip_with_eval_files(tmp_path):
    train = _write_parallel(
        tmp_path, "train", ["ein Hund", "zwei", "drei"], ["a dog", "two", "3"], gz=True
    )
    val = _write_parallel(tmp_path, "val", ["vier"], ["four"])
    sources = builders.prepare(builders.parallel_files_builder(tmp_path / "d", *train, *val))
    assert _texts(sources["train"], "source") == ["ein Hund", "zwei", "drei"]
    assert _texts(sources["train"], "target") == ["a dog", "two", "3"]
    assert _texts(sources["validation"], "target") == ["four"]


def test_parallel_files_holdout_without_eval_files(tmp_path):
    lines = [f"s{i}" for i in range(20)]
    paths = _write_parallel(tmp_path, "all", lines, [f"t{i}" for i in range(20)])
    builder = builders.parallel_files_builder(tmp_path / "d", *paths, validation_fraction=0.1)
    sources = builders.prepare(builder)
    assert _texts(sources["train"], "source") == lines[:18]
    assert _texts(sources["validation"], "target") == ["t18", "t19"]


@pytest.mark.parametrize(
    "content,pattern",
    [
        (b"", r"is empty"),
        (b"  \n\n", r"is empty"),
        (b"text\nmore\x00binary", r"looks binary: NUL byte at byte offset 9 \(line 2\)"),
        (b"good line\nbad \xff byte\n", r"not valid UTF-8: byte 0xff at byte offset 14 \(line 2\)"),
        (b"\x1f\x8b\x08garbage", r"not a valid gzip file"),
    ],
)
def test_bad_text_file_is_a_clear_error_naming_the_path(tmp_path, content, pattern):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=pattern) as error:
        builders.read_text_file(path, "data.path")
    assert str(path) in str(error.value) and str(error.value).startswith("data.path")


def test_failed_preparation_leaves_no_dataset(tmp_path):
    path = tmp_path / "binary.txt"
    path.write_bytes(b"\x00\x01\x02 not text")
    builder = builders.text_file_builder(tmp_path / "data", path)
    with pytest.raises(DataError, match="looks binary"):
        builders.prepare(builder)
    assert not builder.is_prepared()
    assert not list((tmp_path / "data").rglob("dataset_info.json"))
    assert not list((tmp_path / "data").rglob("*.array_record*"))


def test_missing_file_names_the_field_and_path(tmp_path):
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=f"data.path: file not found: {missing}"):
        builders.text_file_builder(tmp_path, missing)
    present = _write_parallel(tmp_path, "x", ["a"], ["b"])
    with pytest.raises(FileNotFoundError, match="data.target_path: file not found"):
        builders.parallel_files_builder(tmp_path, present[0], missing)


def test_parallel_line_count_mismatch_names_both_files(tmp_path):
    source, target = _write_parallel(tmp_path, "m", ["a", "b", "c"], ["x", "y"])
    builder = builders.parallel_files_builder(tmp_path / "d", source, target)
    with pytest.raises(DataError) as error:
        builders.prepare(builder)
    message = str(error.value)
    assert f"{source} has 3 lines" in message and f"{target} has 2 lines" in message
    assert not builder.is_prepared()


def test_changed_file_is_prepared_again(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("a\n\nb\n\nc\n")
    first = builders.text_file_builder(tmp_path / "d", path)
    builders.prepare(first)
    path.write_text("a\n\nb\n\nc\n\nd and more\n")
    second = builders.text_file_builder(tmp_path / "d", path)
    assert second.data_dir != first.data_dir and not second.is_prepared()
    assert _texts(builders.prepare(second)["validation"]) == ["d and more"]


def test_catalog_dataset_by_name_with_feature_mapping():
    with tfds.testing.mock_data(num_examples=6):
        sources = builders.catalog_sources(
            "wmt14_translate/de-en", {"source": "de", "target": "en"}, ["train", "validation"]
        )
        assert len(sources["train"]) == 6
        assert set(sources["validation"][0]) == {"de", "en"}
        lm = builders.catalog_sources("lm1b", {"text": "text"}, ["train"])
        assert set(lm["train"][0]) == {"text"}


def test_catalog_errors_name_the_field():
    with tfds.testing.mock_data(num_examples=2):
        with pytest.raises(ConfigError, match=r"data.name='lm1bb' is not a tfds dataset.*lm1b"):
            builders.catalog_sources("lm1bb", {"text": "text"}, ["train"])
        with pytest.raises(ConfigError, match=r"data.features.source='fr'.*keys are: de, en"):
            builders.catalog_sources(
                "wmt14_translate/de-en", {"source": "fr", "target": "en"}, ["train"]
            )
        with pytest.raises(ConfigError, match=r"data.features has unknown field\(s\) txt"):
            builders.catalog_sources("lm1b", {"txt": "text"}, ["train"])


def test_catalog_dataset_not_prepared_is_a_clear_error(tmp_path):
    with pytest.raises(DataError, match=r"'lm1b' split 'train' is not prepared.*data.download"):
        builders.catalog_sources("lm1b", {"text": "text"}, ["train"], data_dir=tmp_path)


def test_building_prints_no_custom_configuration_warning(tmp_path, caplog):
    """tfds warned "Using custom data configuration: ..." on every command (every tfm builder
    is built from a config object, on purpose)."""
    with caplog.at_level("INFO"):
        builders.prepare(builders.synthetic_builder(
            tmp_path, task="copy", seed=0, num_symbols=4, train_lengths=(1, 3),
            eval_lengths=(4, 5), num_train=8, num_validation=4, num_test=4))
    assert not [r for r in caplog.records if "custom data configuration" in r.getMessage()]


def test_passkey_rows_join_the_training_split_only(tmp_path, monkeypatch):
    monkeypatch.setattr(builders, "TEXT_BLOCK_CHARS", 7)
    text = "ab\n\ncd ef\n" * 6
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    plain = builders.prepare(builders.text_file_builder(
        tmp_path, path, text_unit="block", validation_fraction=0.25))
    mixed = builders.prepare(builders.text_file_builder(
        tmp_path, path, text_unit="block", validation_fraction=0.25, passkey_rows=5,
        passkey_length=160, passkey_alphabet="xyz", passkey_key_length=3))
    train = _texts(mixed["train"])
    assert train[:7] == _texts(plain["train"])
    assert train[7:] == passkey.training_texts(5, 160, alphabet="xyz", key_length=3)
    assert _texts(mixed["validation"]) == _texts(plain["validation"])
