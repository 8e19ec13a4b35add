"""build_data: config validation, every data kind end to end, tokenizer reuse, eval texts."""

import gzip

import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds

from tfm.checks import ConfigError
from tfm.data import Data, DataConfig, build_data, builders, synthetic
from tfm.data.tokenizers import BOS_ID, EOS_ID


def test_unknown_field_and_bad_values_name_the_data_field():
    with pytest.raises(ConfigError, match=r"data.sequence_length is unknown; known data fields"):
        DataConfig.from_dict({"sequence_length": 5})
    with pytest.raises(ConfigError, match=r"data.kind='csv' is unknown; choose one of: synthetic"):
        DataConfig.from_dict({"kind": "csv"})
    with pytest.raises(ConfigError, match=r"data.task='rotate' is unknown"):
        DataConfig(task="rotate")
    with pytest.raises(ConfigError, match=r"data.path is required for data.kind='text'"):
        DataConfig(kind="text")
    with pytest.raises(ConfigError, match=r"data.path='x.txt' is only used by data.kind='text'"):
        DataConfig(kind="synthetic", path="x.txt")
    with pytest.raises(ConfigError, match=r"data.train_lengths=\(5, 2\) must be"):
        DataConfig(train_lengths=(5, 2))
    with pytest.raises(ConfigError, match=r"data.long_eval_lengths=\(30, 20\) must be"):
        DataConfig(long_eval_lengths=(30, 20))
    with pytest.raises(ConfigError, match=r"data.long_eval_lengths=\(3, 4\) is only used by"):
        DataConfig(kind="text", path="a.txt", long_eval_lengths=(3, 4))
    with pytest.raises(ConfigError, match=r"data.batch_size=0 must be an integer > 0"):
        DataConfig(batch_size=0)
    with pytest.raises(ConfigError, match=r"data.length_policy='split' only applies"):
        DataConfig(length_policy="split")
    with pytest.raises(ConfigError, match=r"data.tokenizer='sentencepiece' would merge"):
        DataConfig(tokenizer="sentencepiece")
    with pytest.raises(ConfigError, match=r"data.mode='seq2seq' needs pairs"):
        DataConfig(kind="text", path="a.txt", mode="seq2seq")
    with pytest.raises(ConfigError, match=r"data.features is required"):
        DataConfig(kind="tfds", name="lm1b")
    with pytest.raises(ConfigError, match=r"data.passkey_rows=5 is only used by data.kind='text'"):
        DataConfig(passkey_rows=5)
    with pytest.raises(ConfigError, match=r"data.passkey_rows: data.seq_len=64 is too short"):
        DataConfig(kind="text", path="a.txt", passkey_rows=5, seq_len=64)
    with pytest.raises(ConfigError, match=r"data.passkey_alphabet='7' needs at least two"):
        DataConfig(kind="text", path="a.txt", passkey_rows=5, seq_len=256, passkey_alphabet="7")
    with pytest.raises(ConfigError, match=r"data.passkey_rows=-2 must be an integer > 0"):
        DataConfig(kind="text", path="a.txt", passkey_rows=-2)
    DataConfig(kind="text", path="a.txt", passkey_rows=5, seq_len=256)


def test_config_dict_input_and_resolved_defaults():
    config = DataConfig.from_dict(
        ml_collections.ConfigDict({"kind": "synthetic", "train_lengths": [2, 3], "seq_len": 16})
    )
    assert config.train_lengths == (2, 3)
    assert config.resolved_tokenizer == "char"
    assert config.resolved_length_policy == "filter"
    assert config.resolved_eval_splits == ("validation", "test")
    longer = DataConfig.from_dict({"kind": "synthetic", "long_eval_lengths": [33, 64]})
    assert longer.long_eval_lengths == (33, 64)
    assert longer.resolved_eval_splits == ("validation", "test", "test_long")
    text = DataConfig(kind="text", path="a.txt")
    assert (text.resolved_tokenizer, text.resolved_length_policy) == ("byte", "split")


def _synthetic(tmp_path, **overrides):
    config = dict(
        kind="synthetic",
        task="addition",
        train_lengths=(1, 3),
        eval_lengths=(4, 5),
        num_train_examples=60,
        num_eval_examples=7,
        seq_len=24,
        batch_size=4,
        data_dir=str(tmp_path),
        read_threads=0,
        prefetch=0,
    )
    config.update(overrides)
    return config


def test_synthetic_seq2seq_end_to_end(tmp_path):
    data = build_data(_synthetic(tmp_path))
    assert isinstance(data, Data)
    assert data.vocab_size == data.source_vocab_size == 4 + 12
    batch = next(data.train_iterator())
    assert batch["source"].shape == (4, 24) and batch["inputs"].shape == (4, 24)
    # Every packed segment is a correct addition example within the training lengths.
    for row in range(4):
        for segment in np.unique(batch["segment_ids"][row]):
            if segment == 0:
                continue
            source = data.tokenizer.decode(
                batch["source"][row][batch["source_segment_ids"][row] == segment]
            )
            target = data.decode(batch["targets"][row][batch["segment_ids"][row] == segment])
            assert synthetic.check_example("addition", source, target, lengths=(1, 3)) is None
    # Test split: evaluation lengths, padded to its longest example, nothing dropped.
    batches = list(data.eval_batches("test"))
    sources, targets = data.eval_texts("test")
    assert len(batches) == 2 and sum(b["example_weights"].sum() for b in batches) == 7
    rows = [(b, r) for b in batches for r in range(4) if b["example_weights"][r]]
    for (batch, row), source, target in zip(rows, sources, targets, strict=True):
        assert synthetic.check_example("addition", source, target, lengths=(4, 5)) is None
        assert data.tokenizer.decode(batch["source"][row]) == source
        assert data.decode(batch["targets"][row]) == target
        assert batch["source"][row].tolist()[: len(source) + 1] == data.encode_prompt(source)


def test_synthetic_long_test_split(tmp_path):
    """long_eval_lengths adds test_long, its own examples at its own lengths; the other splits
    stay what they were without it (same examples, same prepared directory)."""
    plain = build_data(_synthetic(tmp_path, mode="lm"))
    data = build_data(_synthetic(tmp_path, mode="lm", long_eval_lengths=(8, 10)))
    assert data.eval_splits == ("validation", "test", "test_long")
    assert "test_long" not in plain.sources
    for split in ("validation", "test"):
        assert plain.eval_texts(split) == data.eval_texts(split)
    sources, targets = data.eval_texts("test_long")
    assert len(sources) == 7 and sources != data.eval_texts("test")[0]
    for source, target in zip(sources, targets, strict=True):
        assert synthetic.check_example("addition", source, target, lengths=(8, 10)) is None
    # Eval rows fit the longest example although seq_len is shorter.
    batch = next(data.eval_batches("test_long"))
    answers = map(len, targets)
    longest = max(len(data.encode_prompt(s)) + n for s, n in zip(sources, answers, strict=True))
    assert batch["inputs"].shape[1] == longest > data.config.seq_len


def test_synthetic_decoder_only_weights_the_answer(tmp_path):
    data = build_data(_synthetic(tmp_path, mode="lm", task="reverse", num_symbols=5))
    assert data.source_vocab_size is None
    (batch, *_) = list(data.eval_batches("validation"))
    sources, targets = data.eval_texts("validation")
    for row in range(4):
        weighted = batch["targets"][row][batch["weights"][row] > 0]
        assert weighted.tolist() == [*data.tokenizer.encode(targets[row]), EOS_ID]
        prompt = data.encode_prompt(sources[row])
        assert prompt[0] == BOS_ID and data.tokenizer.decode(prompt[-1:]) == "="
        assert batch["inputs"][row].tolist()[: len(prompt)] == prompt


def test_same_config_same_batches_and_resume(tmp_path):
    config = _synthetic(tmp_path, seed=3)
    first = build_data(config).train_iterator()
    second = build_data(config).train_iterator()
    for _ in range(3):
        a, b = next(first), next(second)
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    state = first.get_state()
    expected = next(first)
    resumed = build_data(config).train_iterator()
    resumed.set_state(state)
    np.testing.assert_array_equal(next(resumed)["source"], expected["source"])


def test_batch_is_divided_among_processes(tmp_path):
    data = build_data(_synthetic(tmp_path, batch_size=4), process_index=1, process_count=2)
    assert next(data.train_iterator())["inputs"].shape == (2, 24)
    with pytest.raises(ConfigError, match=r"data.batch_size=4 is not divisible by process_count=3"):
        build_data(
            _synthetic(tmp_path, batch_size=4), process_index=0, process_count=3
        ).train_iterator()


def test_nothing_fits_is_an_early_error(tmp_path):
    with pytest.raises(ConfigError, match=r"data.seq_len=3 .* filters out all"):
        build_data(_synthetic(tmp_path, seq_len=3))


def test_text_char_lm_with_split_windows(tmp_path):
    path = tmp_path / "corpus.txt"
    paragraphs = [f"Para {i}: " + "words and more words " * (i % 4 + 1) for i in range(12)]
    path.write_text("\n\n".join(paragraphs))
    data = build_data(
        dict(
            kind="text",
            path=str(path),
            tokenizer="char",
            seq_len=16,
            batch_size=2,
            validation_fraction=0.2,
            data_dir=str(tmp_path / "data"),
            read_threads=0,
            prefetch=0,
        )
    )
    assert data.vocab_size == 4 + len(set("".join(paragraphs[:10])))
    batch = next(data.train_iterator())
    assert batch["inputs"].shape == (2, 16) and batch["segment_ids"].min() >= 1  # full rows
    # Validation: windows of seq_len that reassemble the held-out paragraphs exactly.
    rows = [
        b["inputs"][r][b["segment_ids"][r] > 0]
        for b in data.eval_batches("validation")
        for r in range(2)
        if b["example_weights"][r]
    ]
    stream = np.concatenate(rows).tolist()
    expected = []
    for paragraph in paragraphs[10:]:
        expected += [BOS_ID, *data.tokenizer.encode(paragraph)]
    assert stream == expected
    with pytest.raises(ValueError, match="needs source/target pairs"):
        data.eval_texts("validation")
    # The char vocabulary was saved next to the prepared data and is reused.
    (saved,) = (tmp_path / "data" / "tokenizers").rglob("char-text-*.json")
    modified = saved.stat().st_mtime_ns
    assert build_data(data.config).tokenizer == data.tokenizer
    assert saved.stat().st_mtime_ns == modified


def test_text_blocks_evaluate_contiguous_windows_of_exactly_eval_seq_len(tmp_path, monkeypatch):
    """text_unit="block": training windows run across paragraphs, and eval reads the validation
    text as one stream cut into full windows of eval_seq_len (the remainder dropped)."""
    monkeypatch.setattr(builders, "TEXT_BLOCK_CHARS", 50)
    rng = np.random.default_rng(0)
    paragraphs = ["\n".join("".join(rng.choice(list("abcde "), 9)) for _ in range(3))
                  for _ in range(20)]
    text = "\n\n".join(paragraphs) + "\n"
    path = tmp_path / "corpus.txt"
    path.write_text(text)
    config = dict(kind="text", path=str(path), tokenizer="char", text_unit="block", seq_len=16,
                  eval_seq_len=32, batch_size=4, eval_batch_size=8, validation_fraction=0.2,
                  data_dir=str(tmp_path / "data"), read_threads=0, prefetch=0)
    data = build_data(config)
    records = data.sources["validation"]
    validation = "".join(records[i]["text"].decode() for i in range(len(records)))
    assert len(text) == 619 and validation == text[-119:]  # the last 3 of 13 blocks
    newline = data.tokenizer.encode("\n")[0]
    batch = next(data.train_iterator())
    assert (batch["segment_ids"] >= 1).all()  # full rows
    assert any(newline in row and [newline, newline] in [row[i : i + 2].tolist()
               for i in range(15)] for row in batch["inputs"])  # across a paragraph break
    batches = list(data.eval_batches("validation"))
    rows = [r for b in batches for r, w in zip(b["inputs"], b["example_weights"], strict=True) if w]
    stream = [BOS_ID, *data.tokenizer.encode(validation), EOS_ID]
    count = (len(stream) - 1) // 32
    assert len(rows) == count == 3 and all(b["inputs"].shape == (8, 32) for b in batches)
    assert np.concatenate(rows).tolist() == stream[: count * 32]
    targets = [r for b in batches for r, w in zip(b["targets"], b["example_weights"], strict=True)
               if w]
    assert np.concatenate(targets).tolist() == stream[1 : count * 32 + 1]
    assert all((b["weights"][b["example_weights"] > 0] == 1).all() for b in batches)
    # Other lengths: the same stream, other windows.
    longer = build_data({**config, "eval_seq_len": 64})
    assert len(longer.eval_examples("validation")) == (len(stream) - 1) // 64
    with pytest.raises(ConfigError, match=r"data.eval_seq_len=512: split 'validation' is too"):
        build_data({**config, "eval_seq_len": 512}).eval_examples("validation")


def test_parallel_gzip_shared_sentencepiece(tmp_path):
    german = [f"der hund {i} läuft schnell nach hause" for i in range(40)]
    english = [f"the dog {i} runs home quickly" for i in range(40)]
    for name, lines in (("train.de.gz", german), ("train.en.gz", english)):
        (tmp_path / name).write_bytes(gzip.compress("\n".join(lines).encode()))
    config = dict(
        kind="parallel",
        source_path=str(tmp_path / "train.de.gz"),
        target_path=str(tmp_path / "train.en.gz"),
        tokenizer="sentencepiece",
        vocab_size=80,
        seq_len=32,
        batch_size=2,
        data_dir=str(tmp_path / "data"),
        read_threads=0,
        prefetch=0,
    )
    data = build_data(config)
    assert data.source_tokenizer is data.tokenizer and data.vocab_size <= 80
    assert len(list((tmp_path / "data" / "tokenizers").rglob("*.model"))) == 1
    batch = next(data.train_iterator())
    assert batch["source"].shape == (2, 32)
    sources, targets = data.eval_texts("validation")  # held-out tail: 4 of 40 pairs
    assert (sources, targets) == (german[36:], english[36:])
    assert data.decode(data.tokenizer.encode(targets[0])) == targets[0]
    separate = build_data({**config, "shared_vocab": False})
    assert separate.source_tokenizer is not separate.tokenizer
    assert "läuft" in separate.source_tokenizer.decode(separate.source_tokenizer.encode("läuft"))


def test_tfds_catalog_dataset_end_to_end():
    config = dict(
        kind="tfds",
        name="wmt14_translate/de-en",
        features={"source": "de", "target": "en"},
        seq_len=48,
        batch_size=2,
        read_threads=0,
        prefetch=0,
    )
    with tfds.testing.mock_data(num_examples=8):
        data = build_data(config)
        batch = next(data.train_iterator())
        assert batch["source"].shape == (2, 48) and data.vocab_size == 259
        sources, targets = data.eval_texts("validation")
        assert len(sources) == 8
        (first, *_) = list(data.eval_batches("validation"))
        assert data.decode(first["targets"][0]) == targets[0]
        with pytest.raises(ConfigError, match=r"data.features.target='fr'"):
            build_data({**config, "features": {"source": "de", "target": "fr"}})


def test_translate_config_packs_parallel_training_rows(tmp_path):
    """configs/translate.py's data settings on a Multi30k-like corpus (short caption pairs,
    rows of 64): training rows hold several pairs each (Multi30k itself: 2.8 per row with the
    runlocal vocabulary), every packed source segment matches its target segment, and eval rows
    hold one pair each (padded, for per-example decoding)."""
    from configs import translate

    german = [f"ein hund {i} läuft über die wiese" for i in range(200)]
    english = [f"a dog {i} runs across the meadow" for i in range(200)]
    for name, lines in (("train.de.gz", german), ("train.en.gz", english)):
        (tmp_path / name).write_bytes(gzip.compress("\n".join(lines).encode()))
    config = translate.get_config("runlocal").data
    assert config.packing and config.seq_len == 64
    config.update(source_path=str(tmp_path / "train.de.gz"),
                  target_path=str(tmp_path / "train.en.gz"), eval_source_path=None,
                  eval_target_path=None, vocab_size=120, data_dir=str(tmp_path / "data"))
    data = build_data(config)
    batch = next(data.train_iterator())
    segments = [len(np.unique(row[row > 0])) for row in batch["segment_ids"]]
    source_segments = [len(np.unique(row[row > 0])) for row in batch["source_segment_ids"]]
    assert segments == source_segments and np.mean(segments) >= 2, segments
    pairs = dict(zip(german, english, strict=True))
    for row in range(batch["source"].shape[0]):
        for segment in np.unique(batch["segment_ids"][row][batch["segment_ids"][row] > 0]):
            source = batch["source"][row][batch["source_segment_ids"][row] == segment]
            target = batch["targets"][row][batch["segment_ids"][row] == segment]
            assert pairs[data.source_tokenizer.decode(source)] == data.decode(target)
    eval_batch = next(data.eval_batches("validation"))
    assert eval_batch["segment_ids"].max(axis=1).tolist() == [1] * len(eval_batch["segment_ids"])


def test_the_family_picks_the_record_format():
    pairs = DataConfig()
    assert (pairs.resolved_mode, pairs.record_format) == ("seq2seq", "source_target")
    assert DataConfig(mode="lm").record_format == "prompt_answer"
    text = DataConfig(kind="text", path="a.txt")
    assert (text.resolved_mode, text.record_format) == ("lm", "text")
    with pytest.raises(ConfigError, match=r"data.mode='seq2seq' needs pairs"):
        DataConfig(kind="tfds", name="x", features={"text": "text"}, mode="seq2seq")
    with pytest.raises(ConfigError,
                       match=r"data.mode='encoder' is unknown; choose one of: lm, seq2seq$"):
        DataConfig(mode="encoder")  # a family tfm loads but does not train
