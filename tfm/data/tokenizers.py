"""Tokenizers: byte-level, char-level and SentencePiece, all with the same special ids.

Special ids, identical for every tokenizer (see the API contract):

    pad = 0, bos = 1, eos = 2; char and SentencePiece tokenizers also have unk = 3.

`ByteTokenizer` maps each UTF-8 byte b to id b + 3 (vocabulary 259) and round-trips any Unicode
string exactly. `CharTokenizer` maps each character (code point) of a fixed alphabet, taken from
the training corpus and saved as JSON, to ids 4...; unseen characters become unk.
`SentencePieceTokenizer` wraps a model trained offline on the training split
(`train_sentencepiece`) and saved as a `.model` file next to the prepared data.

`decode` drops pad and bos and stops at the first eos, so it applies directly to generated ids.
Every tokenizer pickles (grain worker processes receive a copy).
"""

from __future__ import annotations

import io
import json
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import sentencepiece as spm

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
TOKENIZER_KINDS = ("byte", "char", "sentencepiece")
SENTENCEPIECE_MODEL_TYPES = ("unigram", "bpe")


@runtime_checkable
class Tokenizer(Protocol):
    """What the pipelines need from a tokenizer."""

    pad_id: int
    bos_id: int
    eos_id: int

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def content_ids(ids: Iterable[int], eos_id: int = EOS_ID, pad_id: int = PAD_ID) -> list[int]:
    """ids up to (not including) the first eos, with pad and bos removed: what a tokenizer
    decodes, e.g. of a generated row."""
    out = []
    for token in ids:
        token = int(token)
        if token == eos_id:
            break
        if token not in (pad_id, BOS_ID):
            out.append(token)
    return out


def _write_atomically(path: Path, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file and a rename, so readers never see half a
    file (a failed or concurrent write leaves either nothing or the complete old/new file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class ByteTokenizer:
    """UTF-8 bytes shifted by 3: id = byte + 3, vocabulary 259; exact for every Unicode string."""

    pad_id, bos_id, eos_id = PAD_ID, BOS_ID, EOS_ID
    offset = 3

    @property
    def vocab_size(self) -> int:
        return 256 + self.offset

    def encode(self, text: str) -> list[int]:
        return [byte + self.offset for byte in text.encode("utf-8")]

    def decode(self, ids: Iterable[int]) -> str:
        # Generated ids may form invalid UTF-8 (or hit unk=3, which bytes never use): replace them.
        data = bytes(t - self.offset for t in content_ids(ids) if t >= self.offset)
        return data.decode("utf-8", errors="replace")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ByteTokenizer)

    def __hash__(self) -> int:
        return hash(ByteTokenizer)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"


class CharTokenizer:
    """One id per character of a fixed alphabet: pad 0, bos 1, eos 2, unk 3, then the characters."""

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID
    offset = 4

    def __init__(self, chars: Sequence[str]):
        chars = list(chars)
        if any(len(c) != 1 for c in chars) or len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer needs distinct single characters")
        self.chars = chars
        self._ids = {c: i + self.offset for i, c in enumerate(chars)}

    @classmethod
    def from_texts(cls, texts: Iterable[str]) -> CharTokenizer:
        """The alphabet is every character in `texts`, sorted by code point."""
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        return cls(sorted(seen))

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + self.offset

    def encode(self, text: str) -> list[int]:
        ids = self._ids
        return [ids.get(c, UNK_ID) for c in text]

    def decode(self, ids: Iterable[int]) -> str:
        chars, offset = self.chars, self.offset
        return "".join(
            chars[t - offset] if offset <= t < offset + len(chars) else "\ufffd"
            for t in content_ids(ids)
        )

    def save(self, path: str | os.PathLike) -> None:
        data = {
            "type": "char",
            "special": ["<pad>", "<bos>", "<eos>", "<unk>"],
            "chars": self.chars,
        }
        _write_atomically(Path(path), json.dumps(data, ensure_ascii=False).encode("utf-8"))

    @classmethod
    def load(cls, path: str | os.PathLike) -> CharTokenizer:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if data.get("type") != "char":
            raise ValueError(f"{path} is not a char tokenizer file (type={data.get('type')!r})")
        return cls(data["chars"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and other.chars == self.chars

    def __hash__(self) -> int:
        return hash(tuple(self.chars))

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


class SentencePieceTokenizer:
    """A SentencePiece model trained with pad=0, bos=1, eos=2, unk=3 (see `train_sentencepiece`)."""

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID

    def __init__(self, model_proto: bytes):
        self.model_proto = bytes(model_proto)
        self._processor = spm.SentencePieceProcessor(model_proto=self.model_proto)
        found = (self._processor.pad_id(), self._processor.bos_id(), self._processor.eos_id())
        if found != (PAD_ID, BOS_ID, EOS_ID):
            raise ValueError(
                f"SentencePiece model has (pad, bos, eos) = {found}; tfm needs (0, 1, 2): "
                "train it with train_sentencepiece"
            )

    @classmethod
    def load(cls, path: str | os.PathLike) -> SentencePieceTokenizer:
        return cls(Path(path).read_bytes())

    def save(self, path: str | os.PathLike) -> None:
        _write_atomically(Path(path), self.model_proto)

    @property
    def vocab_size(self) -> int:
        return self._processor.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text, out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        return self._processor.decode(content_ids(ids))

    def __getstate__(self) -> dict:
        return {"model_proto": self.model_proto}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_proto"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SentencePieceTokenizer) and other.model_proto == self.model_proto

    def __hash__(self) -> int:
        return hash(self.model_proto)

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer(vocab_size={self.vocab_size})"


def train_sentencepiece(
    texts: Iterable[str],
    vocab_size: int,
    *,
    model_type: str = "unigram",
    max_sentence_length: int = 16384,
) -> SentencePieceTokenizer:
    """Trains a SentencePiece model offline on `texts` (one sentence or paragraph each).

    `vocab_size` is an upper bound: on a corpus too small for it, SentencePiece stops earlier
    (hard_vocab_limit=False); read the real size from `.vocab_size`. Newlines are kept as a
    piece of their own, so paragraphs of a text corpus decode with their line breaks.
    """
    if model_type not in SENTENCEPIECE_MODEL_TYPES:
        raise ValueError(
            f"model_type={model_type!r} is unknown; choose one of: "
            f"{', '.join(SENTENCEPIECE_MODEL_TYPES)}"
        )
    sentences = [t for t in texts if t.strip()]
    if not sentences:
        raise ValueError("cannot train SentencePiece on an empty corpus")
    model = io.BytesIO()
    spm.set_random_generator_seed(0)  # same corpus -> same model (sentence sampling is seeded)
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences),
        model_writer=model,
        vocab_size=vocab_size,
        model_type=model_type,
        pad_id=PAD_ID,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        unk_id=UNK_ID,
        hard_vocab_limit=False,
        character_coverage=1.0,
        user_defined_symbols=["\n"],
        max_sentence_length=max_sentence_length,
        input_sentence_size=2_000_000,
        shuffle_input_sentence=True,
        num_threads=1,  # deterministic and polite on a shared machine
        minloglevel=2,
    )
    return SentencePieceTokenizer(model.getvalue())


def unknown_characters(tokenizer: Tokenizer, text: str) -> list[str]:
    """The distinct characters of `text` the tokenizer can only encode as unk, in order of
    appearance (bytes cover every character: none for ByteTokenizer)."""
    if isinstance(tokenizer, ByteTokenizer):
        return []
    unknown: list[str] = []
    for char in dict.fromkeys(text):
        if UNK_ID in tokenizer.encode(char) and char not in unknown:
            unknown.append(char)
    return unknown
