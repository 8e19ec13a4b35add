"""Tokenizers: special ids, exact round trips, saving and loading, pickling."""

import pickle

import numpy as np
import pytest

from tfm.data import tokenizers
from tfm.data.tokenizers import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    UNK_ID,
    ByteTokenizer,
    CharTokenizer,
    SentencePieceTokenizer,
    train_sentencepiece,
)


def _random_unicode(rng: np.random.Generator, length: int) -> str:
    """Any code point except surrogates (which no UTF-8 string can hold)."""
    points = []
    while len(points) < length:
        point = int(rng.integers(0, 0x110000))
        if not 0xD800 <= point <= 0xDFFF:
            points.append(point)
    return "".join(map(chr, points))


def test_special_ids_are_shared():
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    for tok in (ByteTokenizer(), CharTokenizer(["a"])):
        assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
        assert isinstance(tok, tokenizers.Tokenizer)


def test_byte_tokenizer_round_trips_arbitrary_unicode():
    tok = ByteTokenizer()
    rng = np.random.default_rng(0)
    samples = ["", "\x00", "héllo wörld", "漢字かな", "🙂👍🏽", "e\u0301", "\r\n\t", "\U0010ffff"]
    samples += [_random_unicode(rng, int(rng.integers(1, 40))) for _ in range(200)]
    for text in samples:
        ids = tok.encode(text)
        assert ids == [b + 3 for b in text.encode("utf-8")]
        assert all(3 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.vocab_size == 259


def test_decode_skips_pad_and_bos_and_stops_at_eos():
    tok = ByteTokenizer()
    ids = [BOS_ID, *tok.encode("ab"), PAD_ID, *tok.encode("c"), EOS_ID, *tok.encode("zzz")]
    assert tok.decode(ids) == "abc"
    assert tok.decode(np.asarray(ids, np.int32)) == "abc"
    # Generated ids may be invalid UTF-8: replaced, never an exception.
    assert tok.decode([0xFF + 3, *tok.encode("x")]) == "\ufffdx"


def test_char_tokenizer_vocab_from_corpus_and_json_round_trip(tmp_path):
    tok = CharTokenizer.from_texts(["hello", "world ß"])
    assert tok.chars == sorted(set("helloworld ß"))
    assert tok.vocab_size == 4 + len(tok.chars)
    ids = tok.encode("hello ß")
    assert min(ids) >= 4 and tok.decode(ids) == "hello ß"
    assert tok.encode("hex")[-1] == UNK_ID  # 'x' was never seen
    path = tmp_path / "char.json"
    tok.save(path)
    loaded = CharTokenizer.load(path)
    assert loaded == tok and loaded.encode("world") == tok.encode("world")
    assert pickle.loads(pickle.dumps(tok)) == tok


def test_sentencepiece_trains_with_fixed_special_ids_saves_and_pickles(tmp_path):
    corpus = [f"the {w} sat on the mat number {i}" for i, w in enumerate(["cat", "dog"] * 30)]
    tok = train_sentencepiece(corpus, vocab_size=60)
    assert isinstance(tok, SentencePieceTokenizer)
    assert 4 < tok.vocab_size <= 60
    proc = tok._processor
    assert (proc.pad_id(), proc.bos_id(), proc.eos_id(), proc.unk_id()) == (0, 1, 2, 3)
    text = "the dog sat on the mat"
    ids = tok.encode(text)
    assert all(3 <= i < tok.vocab_size for i in ids)  # never pad/bos/eos inside text
    assert tok.decode(ids) == text
    assert tok.decode([BOS_ID, *ids, EOS_ID, *ids]) == text
    path = tmp_path / "spm.model"
    tok.save(path)
    assert SentencePieceTokenizer.load(path).encode(text) == ids
    assert pickle.loads(pickle.dumps(tok)).encode(text) == ids
    # Same corpus -> same model.
    assert train_sentencepiece(corpus, vocab_size=60).encode(text) == ids


def test_sentencepiece_keeps_newlines():
    tok = train_sentencepiece(["first line\nsecond line", "another line here"] * 10, 40)
    assert tok.decode(tok.encode("first line\nsecond")) == "first line\nsecond"


def test_sentencepiece_rejects_bad_arguments():
    with pytest.raises(ValueError, match="model_type"):
        train_sentencepiece(["a b c"], 10, model_type="word_piece")
    with pytest.raises(ValueError, match="empty"):
        train_sentencepiece(["", "  "], 10)
