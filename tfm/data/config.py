"""The `data` section of an experiment config (a dict or ml_collections ConfigDict), validated
once by `DataConfig.from_dict`; a bad value raises `tfm.checks.ConfigError` naming `data.<field>`.
Fields (default), by topic; a kind-specific field may only differ from its default for its kind:

  kind ("synthetic"): "synthetic" | "text" | "parallel" | "tfds"
  mode (None): "lm" (decoder-only) | "seq2seq"; None = lm for text, seq2seq for pairs. Pairs in lm
      mode become prompt + separator + answer + eos with loss weights on answer and eos only
      (separator "=" for synthetic tasks, eos otherwise).
  synthetic: task ("reverse"; copy | reverse | sort | addition), num_symbols (10),
      train_lengths ((1, 16)), eval_lengths ((17, 32)), long_eval_lengths (None: a second test
      range, e.g. (33, 64)), num_train_examples (10000), num_eval_examples (1000, per eval
      split). Splits: train; validation (training lengths, other examples, which may repeat
      training ones at short lengths); test (eval lengths); test_long (long_eval_lengths, only
      when set; its metrics are eval_test_long_*).
  text: path (required), text_unit ("paragraph" | "line" | "block"), validation_fraction (0.1:
      the last tenth of the units is the validation split). "paragraph": text between blank
      lines; a file without blank lines (one sentence a line) is read a line an example instead,
      with a logged note, since one paragraph leaves nothing to hold out. "line": every non-blank
      line. Too few units for the split is an error naming the unit that fits. "block" keeps the
      text contiguous: pieces of builders.TEXT_BLOCK_CHARS characters, so training windows of
      seq_len run across lines and paragraphs, and evaluation reads the whole validation text
      as one stream cut into every non-overlapping window of exactly eval_seq_len (or seq_len)
      tokens, dropping the shorter remainder: every eval row has the full context (Press et al.
      2022's extrapolation evaluation). Paragraphs and lines are each cut into windows instead.
      passkey_rows (0): passkey retrieval examples (tfm.data.passkey, keys of
      passkey_key_length (5) characters of passkey_alphabet ("0123456789")) added to the
      training split, each one row: a prompt of seq_len - passkey_key_length - 2 characters
      and its answer, the key at depths spread over the row (a long-context study's training
      mix; the validation split stays the text's).
  parallel: source_path, target_path (required; plain or .gz; line i of each is a pair),
      eval_source_path, eval_target_path (None: hold out the last validation_fraction of pairs).
  tfds: name (e.g. "wmt14_translate/de-en", "lm1b"), features (our field -> feature key:
      {"source": "de", "target": "en"} or {"text": "text"}), download (False).
  splits: train_split ("train"), eval_splits (None = ("validation", "test") for synthetic, plus
      "test_long" when long_eval_lengths is set; ("validation",) otherwise).
  tokenizer (None = char over the task alphabet for synthetic, byte otherwise): "byte" | "char" |
      "sentencepiece" | "hf:DIR" (DIR/tokenizer.json of a Hugging Face model, with its own ids:
      fine-tune with --config.init.pretrained=DIR); vocab_size (8000) and
      sentencepiece_model_type ("unigram" | "bpe") for SentencePiece; shared_vocab (True): one
      vocabulary for source and target.
  lengths: seq_len (128): decoder / LM row length; source_seq_len (None = seq_len);
      eval_seq_len (None = the longest example of each eval split, so eval never truncates);
      length_policy (None = "split" for text LM, "filter" otherwise): "filter" drops too-long
      training examples, "truncate" cuts them, "split" cuts text into windows of seq_len.
  batching: packing (True), batch_size (32, global: each process gets batch_size / process_count
      rows), eval_batch_size (None = batch_size), seed (0: synthetic data and shuffling),
      shuffle (True), num_workers (0: grain worker processes; > 0 needs absl flags parsed, e.g.
      absl.app.run or flags.FLAGS.mark_as_parsed(), and an `if __name__ == "__main__"` guard),
      prefetch (2: batches a thread prepares ahead), read_threads (2: threads reading,
      tokenizing and packing records; each thread handles `chunk_size` = 256 records at a time).
  data_dir (None = tfds default: $TFDS_DATA_DIR or ~/tensorflow_datasets): prepared datasets,
      and trained tokenizers in <data_dir>/tokenizers/<dataset>/<config>/.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import tensorflow_datasets as tfds

from tfm.checks import ConfigError, check_choice, check_positive, section_dict
from tfm.data import builders, passkey, pipeline, synthetic
from tfm.data.tokenizers import (
    SENTENCEPIECE_MODEL_TYPES,
    TOKENIZER_KINDS,
    hf_tokenizer_folder,
)
from tfm.nn.families import MODES, Family, family_for_data

KINDS = ("synthetic", "text", "parallel", "tfds")
# Fields only one kind uses: they must keep their default for the other kinds.
_KIND_FIELDS = {
    "synthetic": (
        "task",
        "num_symbols",
        "train_lengths",
        "eval_lengths",
        "long_eval_lengths",
        "num_train_examples",
        "num_eval_examples",
    ),
    "text": ("path", "text_unit", "passkey_rows", "passkey_alphabet", "passkey_key_length"),
    "parallel": ("source_path", "target_path", "eval_source_path", "eval_target_path"),
    "tfds": ("name", "features", "download"),
}


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The `data` config section; see the module docstring for every field."""

    kind: str = "synthetic"
    mode: str | None = None
    # synthetic
    task: str = "reverse"
    num_symbols: int = 10
    train_lengths: tuple[int, int] = (1, 16)
    eval_lengths: tuple[int, int] = (17, 32)
    long_eval_lengths: tuple[int, int] | None = None
    num_train_examples: int = 10_000
    num_eval_examples: int = 1_000
    # text
    path: str | None = None
    text_unit: str = "paragraph"  # lines when the file has no blank lines (see above)
    validation_fraction: float = 0.1
    passkey_rows: int = 0
    passkey_alphabet: str = "0123456789"
    passkey_key_length: int = 5
    # parallel
    source_path: str | None = None
    target_path: str | None = None
    eval_source_path: str | None = None
    eval_target_path: str | None = None
    # tfds catalog
    name: str | None = None
    features: Mapping[str, str] | None = None
    download: bool = False
    train_split: str = "train"
    eval_splits: tuple[str, ...] | None = None
    # tokenizer
    tokenizer: str | None = None
    vocab_size: int = 8000
    sentencepiece_model_type: str = "unigram"
    shared_vocab: bool = True
    # lengths and batching
    seq_len: int = 128
    source_seq_len: int | None = None
    eval_seq_len: int | None = None
    length_policy: str | None = None
    packing: bool = True
    batch_size: int = 32
    eval_batch_size: int | None = None
    seed: int = 0
    shuffle: bool = True
    num_workers: int = 0
    prefetch: int = 2
    read_threads: int = 2
    data_dir: str | None = None

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | Any) -> DataConfig:
        """Validates a dict / ConfigDict; ConfigError naming `data.<field>` on a bad value."""
        values = section_dict(values, "data", [f.name for f in dataclasses.fields(cls)])
        for key in ("train_lengths", "eval_lengths", "long_eval_lengths", "eval_splits"):
            if isinstance(values.get(key), list):
                values[key] = tuple(values[key])
        return cls(**values)

    def __post_init__(self) -> None:
        check_choice("data.kind", self.kind, KINDS)
        if self.mode is not None:
            check_choice("data.mode", self.mode, MODES)
        for kind, fields in _KIND_FIELDS.items():
            for field in fields if kind != self.kind else ():
                if getattr(self, field) != _default(field):
                    raise ConfigError(
                        f"data.{field}={getattr(self, field)!r} is only used by "
                        f"data.kind='{kind}', not data.kind='{self.kind}'"
                    )
        _KIND_CHECKS[self.kind](self)
        family_for_data(self.is_text, self.mode)  # raises unless data.mode trains on them
        self._check_common_fields()

    def _check_common_fields(self) -> None:
        if not (isinstance(self.validation_fraction, float) and 0 < self.validation_fraction < 1):
            raise ConfigError(
                f"data.validation_fraction={self.validation_fraction!r} must be a float in (0, 1)"
            )
        if self.tokenizer is not None:
            _check_tokenizer(self.tokenizer)
            if self.kind == "synthetic" and self.tokenizer not in ("char", "byte"):
                raise ConfigError(
                    f"data.tokenizer={self.tokenizer!r} would merge the symbols of a synthetic "
                    "task; use 'char' (default) or 'byte'"
                )
        check_positive("data.vocab_size", self.vocab_size)
        check_choice(
            "data.sentencepiece_model_type", self.sentencepiece_model_type,
            SENTENCEPIECE_MODEL_TYPES,
        )
        check_positive("data.seq_len", self.seq_len)
        for field in ("source_seq_len", "eval_seq_len", "eval_batch_size"):
            if getattr(self, field) is not None:
                check_positive(f"data.{field}", getattr(self, field))
        if self.length_policy is not None:
            check_choice("data.length_policy", self.length_policy, pipeline.LENGTH_POLICIES)
            if self.length_policy == "split" and not self.is_text:
                raise ConfigError(
                    "data.length_policy='split' only applies to language modelling on text "
                    "(data.kind='text', or 'tfds' with features {'text': ...})"
                )
        check_positive("data.batch_size", self.batch_size)
        check_positive("data.seed", self.seed, allow_zero=True)
        check_positive("data.num_workers", self.num_workers, allow_zero=True)
        check_positive("data.prefetch", self.prefetch, allow_zero=True)
        check_positive("data.read_threads", self.read_threads, allow_zero=True)
        for field in ("packing", "shuffle", "shared_vocab", "download"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(f"data.{field}={getattr(self, field)!r} must be True or False")
        if self.eval_splits is not None and (
            not isinstance(self.eval_splits, tuple)
            or not all(isinstance(s, str) for s in self.eval_splits)
        ):
            raise ConfigError(f"data.eval_splits={self.eval_splits!r} must be a tuple of names")

    @property
    def passkey_prompt_length(self) -> int:
        """Characters of a passkey training row's prompt: bos, the prompt, a space and the key
        make one row of seq_len."""
        return self.seq_len - self.passkey_key_length - 2

    @property
    def is_text(self) -> bool:
        """Language modelling on plain text (no source/target pairs)."""
        return self.kind == "text" or (self.kind == "tfds" and set(self.features) == {"text"})

    @property
    def family(self) -> Family:
        """The model family this data trains: data.mode, or the default for text / pairs
        (tfm.nn.families.family_for_data)."""
        return family_for_data(self.is_text, self.mode)

    @property
    def resolved_mode(self) -> str:
        """The name of the family this data trains (one of tfm.nn.families.MODES)."""
        return self.family.name

    @property
    def record_format(self) -> str:
        """How records become examples (pipeline.FORMATS), as the family reads them."""
        family = self.family
        return family.text_format if self.is_text else family.pair_format

    @property
    def resolved_length_policy(self) -> str:
        if self.length_policy is not None:
            return self.length_policy
        return "split" if self.is_text else "filter"

    @property
    def resolved_tokenizer(self) -> str:
        if self.tokenizer is not None:
            return self.tokenizer
        return "char" if self.kind == "synthetic" else "byte"

    @property
    def resolved_eval_splits(self) -> tuple[str, ...]:
        if self.eval_splits is not None:
            return self.eval_splits
        if self.kind != "synthetic":
            return ("validation",)
        return ("validation", "test", *(("test_long",) if self.long_eval_lengths else ()))

    @property
    def resolved_data_dir(self) -> Path:
        return Path(self.data_dir or tfds.core.constants.DATA_DIR).expanduser()


# The checks of each data.kind's own fields.
def _check_synthetic(config: DataConfig) -> None:
        check_choice("data.task", config.task, synthetic.TASKS)
        if not (isinstance(config.num_symbols, int) and 2 <= config.num_symbols <= 36):
            raise ConfigError(f"data.num_symbols={config.num_symbols!r} must be in [2, 36]")
        for field in ("train_lengths", "eval_lengths", "long_eval_lengths"):
            value = getattr(config, field)
            if value is None and field == "long_eval_lengths":
                continue
            ok = isinstance(value, tuple) and len(value) == 2
            ok = ok and all(isinstance(v, int) for v in value) and 1 <= value[0] <= value[1]
            if not ok:
                raise ConfigError(
                    f"data.{field}={value!r} must be (low, high) with 1 <= low <= high"
                )
        check_positive("data.num_train_examples", config.num_train_examples)
        check_positive("data.num_eval_examples", config.num_eval_examples)


def _check_text(config: DataConfig) -> None:
        _required(config, "path")
        check_choice("data.text_unit", config.text_unit, builders.TEXT_UNITS)
        if not config.passkey_rows:
            return
        check_positive("data.passkey_rows", config.passkey_rows)
        check_positive("data.passkey_key_length", config.passkey_key_length)
        if not isinstance(config.passkey_alphabet, str) or len(set(config.passkey_alphabet)) < 2:
            raise ConfigError(f"data.passkey_alphabet={config.passkey_alphabet!r} needs at least "
                              "two different characters")
        try:
            passkey.make_example("passkey", config.passkey_prompt_length, 0.5, 0, encode=list,
                                 alphabet=config.passkey_alphabet,
                                 key_length=config.passkey_key_length)
        except ValueError as error:
            raise ConfigError(f"data.passkey_rows: data.seq_len={config.seq_len} is too short "
                              f"for a passkey row ({error})") from None


def _check_parallel(config: DataConfig) -> None:
        _required(config, "source_path")
        _required(config, "target_path")
        if (config.eval_source_path is None) != (config.eval_target_path is None):
            raise ConfigError(
                "data.eval_source_path and data.eval_target_path must be given together"
            )


def _check_tfds(config: DataConfig) -> None:
        _required(config, "name")
        _required(config, "features")
        if not isinstance(config.features, Mapping):
            raise ConfigError(
                f"data.features={config.features!r} must map our fields to feature keys, e.g. "
                "{'source': 'de', 'target': 'en'} or {'text': 'text'}"
            )


_KIND_CHECKS = {
    "synthetic": _check_synthetic,
    "text": _check_text,
    "parallel": _check_parallel,
    "tfds": _check_tfds,
}


def _check_tokenizer(name: Any) -> None:
    """One of TOKENIZER_KINDS, or "hf:DIR" with DIR/tokenizer.json present (checked here, before
    any data is prepared or anything compiles)."""
    folder = hf_tokenizer_folder(name)
    if folder is None:
        if name not in TOKENIZER_KINDS:
            raise ConfigError(
                f"data.tokenizer={name!r} is unknown; choose one of: "
                f"{', '.join(TOKENIZER_KINDS)}, hf:DIR (a Hugging Face folder with tokenizer.json)"
            )
    elif not (folder / "tokenizer.json").is_file():
        raise ConfigError(
            f"data.tokenizer={name!r} must name a Hugging Face folder holding tokenizer.json "
            f"(hf:DIR); {folder / 'tokenizer.json'} does not exist"
        )


def _default(field: str) -> Any:
    return next(f.default for f in dataclasses.fields(DataConfig) if f.name == field)


def _required(config: DataConfig, field: str) -> None:
    if getattr(config, field) is None:
        raise ConfigError(f"data.{field} is required for data.kind='{config.kind}'")
