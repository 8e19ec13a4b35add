"""Tokenizers: byte-level, char-level, SentencePiece, and a Hugging Face model's own.

Special ids of the tokenizers tfm trains (see the API contract):

    pad = 0, bos = 1, eos = 2; char and SentencePiece tokenizers also have unk = 3.

`HFTokenizer` (data.tokenizer="hf:DIR") keeps the ids of a pretrained model's tokenizer.json, so
its pad / bos / eos are whatever that model uses; the pipelines read them from the tokenizer.

`ByteTokenizer` maps each UTF-8 byte b to id b + 3 (vocabulary 259) and round-trips any Unicode
string exactly. `CharTokenizer` maps each character (code point) of a fixed alphabet, taken from
the training corpus and saved as JSON, to ids 4...; unseen characters become unk.
`SentencePieceTokenizer` wraps a model trained offline on the training split
(`train_sentencepiece`) and saved as a `.model` file next to the prepared data.

`decode` drops pad and bos and stops at the first eos, so it applies directly to generated ids.
Every tokenizer pickles (grain worker processes receive a copy).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import sentencepiece as spm
import tokenizers as hf_tokenizers

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
UNK_ID = 3
TOKENIZER_KINDS = ("byte", "char", "sentencepiece")
HF_PREFIX = "hf:"  # data.tokenizer="hf:DIR": DIR/tokenizer.json
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


def content_ids(
    ids: Iterable[int], eos_id: int = EOS_ID, pad_id: int = PAD_ID, bos_id: int = BOS_ID
) -> list[int]:
    """ids up to (not including) the first eos, with pad and bos removed: what a tokenizer
    decodes, e.g. of a generated row."""
    out = []
    for token in ids:
        token = int(token)
        if token == eos_id:
            break
        if token not in (pad_id, bos_id):
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


# Conventional names of special tokens, for a folder whose tokenizer files do not name them.
_CONVENTIONAL_TOKENS = {
    "pad": ("<pad>", "<|pad|>", "[PAD]"),
    "bos": ("<s>", "<|begin_of_text|>", "<bos>", "[CLS]"),
    "eos": ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]"),
    "unk": ("<unk>", "[UNK]"),
}


def hf_tokenizer_folder(name: str | None) -> Path | None:
    """DIR of data.tokenizer="hf:DIR"; None for the other tokenizers."""
    if isinstance(name, str) and name.startswith(HF_PREFIX):
        return Path(name.removeprefix(HF_PREFIX)).expanduser()
    return None


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_content(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def hf_special_ids(directory: Path, tokenizer: hf_tokenizers.Tokenizer) -> dict[str, int | None]:
    """{"pad", "bos", "eos", "unk": id or None} of a Hugging Face folder. Each is the first token
    tokenizer.json knows among: tokenizer_config.json's, special_tokens_map.json's, the special
    tokens tokenizer.json declares under a conventional name (and its model's unk_token); else
    config.json's `<name>_token_id` (a tokenizer.json alone often declares none: the model
    config does)."""
    files = ("tokenizer_config.json", "special_tokens_map.json")
    named = [_read_json(directory / file) for file in files]
    declared = {t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special}
    model_config = _read_json(directory / "config.json")
    ids: dict[str, int | None] = {}
    for name, conventional in _CONVENTIONAL_TOKENS.items():
        tokens = [_token_content(values.get(f"{name}_token")) for values in named]
        tokens += [token for token in conventional if token in declared]
        if name == "unk":  # BPE, WordLevel and WordPiece models name theirs
            tokens.append(getattr(tokenizer.model, "unk_token", None))
        found = (tokenizer.token_to_id(token) for token in tokens if token is not None)
        fallback = model_config.get(f"{name}_token_id")
        fallback = fallback[0] if isinstance(fallback, list) and fallback else fallback
        ids[name] = next((i for i in found if i is not None), None)
        if ids[name] is None and isinstance(fallback, int):
            ids[name] = fallback
    return ids


class HFTokenizer:
    """A Hugging Face model's tokenizer.json (the `tokenizers` library) with the model's own ids,
    so a pretrained model fine-tunes and generates in its vocabulary (data.tokenizer="hf:DIR").

    `encode` adds no special tokens: the pipelines add bos and eos themselves, as for every
    tokenizer. Special ids: `hf_special_ids`. A model without a bos token (T5) starts with
    config.json's decoder_start_token_id, else with eos (GPT-2's <|endoftext|> both ends a
    document and starts the next). A model without a pad token (GPT-2, Llama) pads with eos:
    padding is masked by lengths and weights, never by its id, and eos is already an id that
    `decode` never shows, whereas a real token (GPT-2's id 0 is "!") would vanish from the text.
    """

    def __init__(self, tokenizer_json: str, special_ids: Mapping[str, int | None]):
        self.tokenizer_json = tokenizer_json
        self.special_ids = dict(special_ids)
        self.pad_id, self.bos_id, self.eos_id = (special_ids[n] for n in ("pad", "bos", "eos"))
        self.unk_id = special_ids.get("unk")
        self._tokenizer = hf_tokenizers.Tokenizer.from_str(tokenizer_json)

    @classmethod
    def load(cls, directory: str | os.PathLike) -> HFTokenizer:
        """DIR/tokenizer.json with DIR's special ids; ValueError when DIR names no eos token
        (every example ends with one)."""
        directory = Path(directory)
        text = (directory / "tokenizer.json").read_text(encoding="utf-8")
        ids = hf_special_ids(directory, hf_tokenizers.Tokenizer.from_str(text))
        if ids["eos"] is None:
            raise ValueError(
                f"{directory} names no eos token (tokenizer_config.json, special_tokens_map.json, "
                "tokenizer.json or config.json eos_token_id)"
            )
        start = _read_json(directory / "config.json").get("decoder_start_token_id")
        if ids["bos"] is None:
            ids["bos"] = start if isinstance(start, int) else ids["eos"]
        if ids["pad"] is None:
            ids["pad"] = ids["eos"]
        return cls(text, ids)

    @property
    def fingerprint(self) -> str:
        """sha256 of tokenizer.json and the special ids: what decides the ids it produces."""
        key = json.dumps(self.special_ids, sort_keys=True) + self.tokenizer_json
        return hashlib.sha256(key.encode("utf-8")).hexdigest()

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        content = content_ids(ids, self.eos_id, self.pad_id, self.bos_id)
        return self._tokenizer.decode(content, skip_special_tokens=True)

    def __getstate__(self) -> dict:
        return {"tokenizer_json": self.tokenizer_json, "special_ids": self.special_ids}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["tokenizer_json"], state["special_ids"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFTokenizer) and other.fingerprint == self.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        return f"HFTokenizer(vocab_size={self.vocab_size}, fingerprint={self.fingerprint[:8]})"


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
    appearance (none for a tokenizer without unk, e.g. bytes, which cover every character)."""
    unk_id = getattr(tokenizer, "unk_id", None)
    if unk_id is None:
        return []
    unknown: list[str] = []
    for char in dict.fromkeys(text):
        if unk_id in tokenizer.encode(char) and char not in unknown:
            unknown.append(char)
    return unknown
