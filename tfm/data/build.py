"""The training loop's data entry point: `build_data(config.data, process_index, process_count)`
returns the `Data` of a validated `DataConfig` (tfm/data/config.py describes every field).

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

from tfm.checks import ConfigError
from tfm.data import builders, pipeline, synthetic
from tfm.data.config import KINDS, DataConfig  # noqa: F401  (KINDS: re-exported)
from tfm.data.tokenizers import (
    ByteTokenizer,
    CharTokenizer,
    HFTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    hf_tokenizer_folder,
    train_sentencepiece,
)

TOKENIZER_TEXT_LIMIT = 1_000_000  # records read to train a tokenizer (evenly spaced)


def _load_hf_tokenizer(name: str) -> HFTokenizer:
    """The tokenizer of data.tokenizer="hf:DIR"; an unreadable folder is a ConfigError."""
    try:
        return HFTokenizer.load(hf_tokenizer_folder(name))
    except Exception as error:  # tokenizers raises plain Exception for a bad tokenizer.json
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"data.tokenizer={name!r} cannot be used: {message}") from None



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
        passkey_rows = {}  # only when set: data prepared without them keeps its name
        if config.passkey_rows:
            passkey_rows = dict(
                passkey_rows=config.passkey_rows,
                passkey_length=config.passkey_prompt_length,
                passkey_alphabet=config.passkey_alphabet,
                passkey_key_length=config.passkey_key_length,
            )
        builder = builders.text_file_builder(
            data_dir,
            config.path,
            text_unit=config.text_unit,
            validation_fraction=config.validation_fraction,
            **passkey_rows,
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
