"""The training loop's data entry point: `build_data(config.data, process_index, process_count)`.

The `data` section of an experiment config (a dict or ml_collections ConfigDict) is validated by
`DataConfig.from_dict`; a bad value raises `tfm.checks.ConfigError` naming `data.<field>`.
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

Usage:

    data = build_data(config.data, jax.process_index(), jax.process_count())
    model_config = model_config.replace(vocab_size=data.vocab_size, ...)
    train_iter = data.train_iterator()              # infinite, resumable (get_state/set_state)
    for batch in data.eval_batches("validation"):   # finite, padded, batch["example_weights"]
        ...
    sources, targets = data.eval_texts("validation")  # raw texts, same order as eval rows
    prompt_ids = data.encode_prompt(sources[0])       # what generation conditions on
    hypothesis = data.decode(generated_ids)           # stops at eos
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds

from tfm.checks import ConfigError, check_choice, check_positive, section_dict
from tfm.data import builders, pipeline, synthetic
from tfm.data.tokenizers import (
    SENTENCEPIECE_MODEL_TYPES,
    TOKENIZER_KINDS,
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    hf_tokenizer_folder,
    train_sentencepiece,
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
    "text": ("path", "text_unit"),
    "parallel": ("source_path", "target_path", "eval_source_path", "eval_target_path"),
    "tfds": ("name", "features", "download"),
}
TOKENIZER_TEXT_LIMIT = 1_000_000  # records read to train a tokenizer (evenly spaced)


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


def _load_hf_tokenizer(name: str) -> HFTokenizer:
    """The tokenizer of data.tokenizer="hf:DIR"; an unreadable folder is a ConfigError."""
    try:
        return HFTokenizer.load(hf_tokenizer_folder(name))
    except Exception as error:  # tokenizers raises plain Exception for a bad tokenizer.json
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"data.tokenizer={name!r} cannot be used: {message}") from None


def _default(field: str) -> Any:
    return next(f.default for f in dataclasses.fields(DataConfig) if f.name == field)


def _required(config: DataConfig, field: str) -> None:
    if getattr(config, field) is None:
        raise ConfigError(f"data.{field} is required for data.kind='{config.kind}'")


# --------------------------------------------------------------------------------------------


def _prepare_sources(config: DataConfig) -> tuple[dict[str, Any], str]:
    """({split: data source}, dataset id used for the tokenizer directory)."""
    data_dir = config.resolved_data_dir
    if config.kind == "tfds":
        splits = [config.train_split, *config.resolved_eval_splits]
        sources = builders.catalog_sources(
            config.name, config.features, splits, data_dir, download=config.download
        )
        return sources, config.name.replace("/", "__").replace(":", "_")
    if config.kind == "synthetic":
        builder = builders.synthetic_builder(
            data_dir,
            task=config.task,
            seed=config.seed,
            num_symbols=config.num_symbols,
            train_lengths=config.train_lengths,
            eval_lengths=config.eval_lengths,
            long_eval_lengths=config.long_eval_lengths,
            num_train=config.num_train_examples,
            num_validation=config.num_eval_examples,
            num_test=config.num_eval_examples,
        )
    elif config.kind == "text":
        builder = builders.text_file_builder(
            data_dir,
            config.path,
            text_unit=config.text_unit,
            validation_fraction=config.validation_fraction,
        )
    else:
        builder = builders.parallel_files_builder(
            data_dir,
            config.source_path,
            config.target_path,
            config.eval_source_path,
            config.eval_target_path,
            validation_fraction=config.validation_fraction,
        )
    sources = builders.prepare(builder)
    for split in [config.train_split, *config.resolved_eval_splits]:
        if split not in sources:
            field = "train_split" if split == config.train_split else "eval_splits"
            raise ConfigError(
                f"data.{field}: split {split!r} does not exist for data.kind='{config.kind}'; "
                f"splits: {', '.join(sources)}"
            )
    return sources, f"{builder.name}/{builder.builder_config.name}"


def _tokenizer_texts(
    source: Sequence[Any], encoder: pipeline.RecordEncoder, field: str
) -> list[str]:
    """Texts of (at most TOKENIZER_TEXT_LIMIT evenly spaced) training records: one field, or
    source and target for a shared vocabulary."""
    indices = list(range(0, len(source), max(1, len(source) // TOKENIZER_TEXT_LIMIT)))
    texts = []
    for start in range(0, len(indices), 1024):
        for record in pipeline.read_records(source, indices[start : start + 1024]):
            record = encoder.texts(record)
            texts.extend(record.values() if field == "shared" else [record[field]])
    return texts


def _load_or_train(
    config: DataConfig,
    source: Sequence[Any],
    fields: tuple[tuple[str, str], ...],
    role: str,
    directory: Path,
) -> Tokenizer:
    """The tokenizer for `role` ("text", "shared", "source" or "target"): loaded from `directory`
    when it was trained before, else trained on the training split and saved there."""
    kind = config.resolved_tokenizer
    if kind == "byte":
        return ByteTokenizer()
    if hf_tokenizer_folder(kind) is not None:  # the model's own, never trained here
        return _load_hf_tokenizer(kind)
    if config.kind == "synthetic":
        return CharTokenizer(synthetic.vocabulary(config.task, config.num_symbols))
    key = json.dumps({"fields": fields, "train_split": config.train_split}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    record_format = "text" if role == "text" else "source_target"
    reader = pipeline.RecordEncoder(record_format, ByteTokenizer(), fields=fields)
    if kind == "char":
        path = directory / f"char-{role}-{digest}.json"
        if path.exists():
            return CharTokenizer.load(path)
        tokenizer = CharTokenizer.from_texts(_tokenizer_texts(source, reader, role))
    else:
        name = f"sentencepiece-{config.sentencepiece_model_type}-{config.vocab_size}"
        path = directory / f"{name}-{role}-{digest}.model"
        if path.exists():
            return SentencePieceTokenizer.load(path)
        tokenizer = train_sentencepiece(
            _tokenizer_texts(source, reader, role),
            config.vocab_size,
            model_type=config.sentencepiece_model_type,
        )
    tokenizer.save(path)  # atomic: a crash never leaves a half-written tokenizer
    return tokenizer


@dataclasses.dataclass
class Data:
    """Tokenizers, training iterator and evaluation batches of one data config (`build_data`)."""

    config: DataConfig
    sources: dict[str, Any]  # split -> random-access records
    tokenizer: Tokenizer  # LM / target side
    source_tokenizer: Tokenizer | None  # seq2seq source side (the same object when shared)
    encoder: pipeline.RecordEncoder
    process_index: int = 0
    process_count: int = 1
    _eval_cache: dict[str, list[pipeline.Example]] = dataclasses.field(default_factory=dict)

    @property
    def mode(self) -> str:
        """The model family this data trains, one of tfm.nn.families.MODES."""
        return self.config.resolved_mode

    @property
    def vocab_size(self) -> int:
        """Decoder (target / LM) vocabulary size, for ModelConfig.vocab_size."""
        return self.tokenizer.vocab_size

    @property
    def source_vocab_size(self) -> int | None:
        """Encoder vocabulary size (seq2seq), for ModelConfig.source_vocab_size; None for LMs."""
        return None if self.source_tokenizer is None else self.source_tokenizer.vocab_size

    @property
    def eval_splits(self) -> tuple[str, ...]:
        return self.config.resolved_eval_splits

    @property
    def train_lengths(self) -> dict[str, int]:
        """Row length of each feature in training batches."""
        has_source = self.encoder.has_source
        source_len = (self.config.source_seq_len or self.config.seq_len) if has_source else None
        return pipeline.feature_lengths(self.config.seq_len, source_len)

    def _local(self, batch_size: int, field: str) -> int:
        if batch_size % self.process_count:
            raise ConfigError(
                f"data.{field}={batch_size} is not divisible by process_count={self.process_count}"
            )
        return batch_size // self.process_count

    def train_dataset(self) -> grain.IterDataset:
        """This process's infinite training pipeline (`pipeline.make_train_dataset`)."""
        config = self.config
        return pipeline.make_train_dataset(
            self.sources[config.train_split],
            self.encoder,
            lengths=self.train_lengths,
            batch_size=self._local(config.batch_size, "batch_size"),
            seed=config.seed,
            length_policy=config.resolved_length_policy,
            packing=config.packing,
            shuffle=config.shuffle,
            process_index=self.process_index,
            process_count=self.process_count,
            num_workers=config.num_workers,
            prefetch=config.prefetch,
            read_threads=config.read_threads,
        )

    def train_iterator(self) -> Any:
        """A fresh training iterator (grain DatasetIterator: `get_state()` / `set_state()`; save it
        with `pipeline.checkpoint_save_args(it)` inside `ocp.args.Composite`)."""
        return iter(self.train_dataset())

    def _check_split(self, split: str) -> None:
        if split not in self.sources:
            raise ValueError(f"split={split!r} is unknown; splits: {', '.join(self.sources)}")

    def eval_examples(self, split: str) -> list[pipeline.Example]:
        """Every example of `split` (all processes), in order; cached."""
        self._check_split(split)
        if split not in self._eval_cache:
            windows = self.config.resolved_length_policy == "split"
            length = self.config.eval_seq_len or self.config.seq_len
            if windows and self.config.text_unit == "block":
                try:
                    examples = pipeline.contiguous_windows(
                        self.sources[split], self.encoder, length
                    )
                except ValueError as error:
                    field = "eval_seq_len" if self.config.eval_seq_len else "seq_len"
                    raise ConfigError(
                        f"data.{field}={length}: split {split!r} is too short ({error})"
                    ) from None
            else:
                examples = pipeline.eval_examples(
                    self.sources[split], self.encoder, split_length=length if windows else None
                )
            self._eval_cache[split] = examples
        return self._eval_cache[split]

    def eval_lengths(self, split: str) -> dict[str, int]:
        """Row lengths of eval batches: `data.eval_seq_len`, or the longest example of the split."""
        if self.config.eval_seq_len is not None:
            return {key: self.config.eval_seq_len for key in self.train_lengths}
        return pipeline.longest(self.eval_examples(split))

    def eval_batches(self, split: str) -> Iterator[pipeline.Example]:
        """Finite padded batches of `split` for this process; `example_weights` [B] marks real rows.
        Each call starts again from the first batch."""
        return pipeline.make_eval_batches(
            self.eval_examples(split),
            lengths=self.eval_lengths(split),
            batch_size=self._local(
                self.config.eval_batch_size or self.config.batch_size, "eval_batch_size"
            ),
            process_index=self.process_index,
            process_count=self.process_count,
        )

    def eval_texts(self, split: str) -> tuple[list[str], list[str]]:
        """(sources, targets) of this process's eval rows, in eval-batch order (for exact match
        and BLEU); rows with example_weights 0 have no entry."""
        if self.config.is_text:
            raise ValueError("eval_texts needs source/target pairs; this is a text LM dataset")
        self._check_split(split)
        source = self.sources[split]
        indices, _ = pipeline.shard_rows(len(source), 1, self.process_index, self.process_count)
        texts = [self.encoder.texts(r) for r in pipeline.read_records(source, list(indices))]
        return [t["source"] for t in texts], [t["target"] for t in texts]

    def encode_prompt(self, source_text: str) -> list[int]:
        """Token ids to condition generation on: the encoder input (seq2seq) or the decoder prefix
        [bos] + prompt + separator (decoder-only)."""
        return self.encoder.encode_prompt(source_text)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Target-side text of generated ids (stops at the first eos)."""
        return self.tokenizer.decode(ids)


def build_data(
    data_config: Mapping[str, Any] | DataConfig | Any,
    process_index: int = 0,
    process_count: int = 1,
) -> Data:
    """Validates the config, prepares the dataset (once; later calls reuse it), loads or trains
    the tokenizers, and returns the `Data` of this process."""
    config = (
        data_config if isinstance(data_config, DataConfig) else DataConfig.from_dict(data_config)
    )
    if not 0 <= process_index < process_count:
        raise ValueError(
            f"process_index={process_index} must be in [0, process_count={process_count})"
        )
    sources, dataset_id = _prepare_sources(config)
    train = sources[config.train_split]
    if len(train) == 0:
        raise builders.DataError(f"data.train_split={config.train_split!r} has no examples")
    directory = config.resolved_data_dir / "tokenizers" / dataset_id
    fields = tuple(sorted(config.features.items())) if config.kind == "tfds" else ()
    record_format = config.record_format
    source_tokenizer = None
    if record_format == "text":
        tokenizer = _load_or_train(config, train, fields, "text", directory)
    elif record_format == "prompt_answer" or config.shared_vocab:
        tokenizer = _load_or_train(config, train, fields, "shared", directory)
        source_tokenizer = tokenizer if record_format == "source_target" else None
    else:
        source_tokenizer = _load_or_train(config, train, fields, "source", directory)
        tokenizer = _load_or_train(config, train, fields, "target", directory)
    separator = ()
    if record_format == "prompt_answer":
        separator = (
            tuple(tokenizer.encode(synthetic.SEPARATOR))
            if config.kind == "synthetic"
            else (tokenizer.eos_id,)
        )
    encoder = pipeline.RecordEncoder(
        record_format,
        tokenizer,
        source_tokenizer,
        separator_ids=separator,
        fields=fields,
    )
    data = Data(config, sources, tokenizer, source_tokenizer, encoder, process_index, process_count)
    _check_fits(data, train)
    return data


def _check_fits(data: Data, train: Sequence[Any]) -> None:
    """With length_policy "filter", fail early if no training example fits (the infinite
    iterator would otherwise search forever)."""
    if data.config.resolved_length_policy != "filter":
        return
    fits = pipeline.FitsLengths(data.train_lengths)
    sample = [data.encoder(train[i]) for i in range(min(len(train), 200))]
    if not any(fits(example) for example in sample):
        longest = pipeline.longest(sample)
        raise ConfigError(
            f"data.seq_len={data.config.seq_len} (source_seq_len={data.config.source_seq_len}) "
            f"filters out all of the first {len(sample)} training examples (longest lengths: "
            f"{longest}); raise the lengths or set data.length_policy='truncate'"
        )


def dataset_summary(data: Data) -> dict[str, Any]:
    """Split sizes and vocabulary sizes, for logging."""
    return {
        "splits": {split: len(source) for split, source in data.sources.items()},
        "vocab_size": data.vocab_size,
        "source_vocab_size": data.source_vocab_size,
        "mode": data.mode,
        "format": data.encoder.format,
        "data_dir": os.fspath(data.config.resolved_data_dir),
    }
