"""tensorflow-datasets builders for local data, and access to catalog datasets, without TensorFlow.

Three local builders, prepared in `array_record` format and read back with `as_data_source()`
(random access, what grain needs; no TensorFlow involved):

    TfmSynthetic      copy / reverse / sort / addition (see synthetic.py); splits train, validation
                      (training lengths, other examples), test (evaluation lengths) and, when
                      `long_eval_lengths` is set, test_long (a second, longer test range)
    TfmTextFile       one UTF-8 text file (plain or .gz); examples are paragraphs, lines or
                      contiguous blocks of TEXT_BLOCK_CHARS characters; the last
                      `validation_fraction` of them is the validation split (deterministic)
    TfmParallelFiles  aligned source/target files (line i of each is a pair; plain or .gz); the
                      validation split comes from separate files or the last fraction of the pairs

Records have text features `text` or `source`/`target` (bytes when read back). Each configuration
(task, seed, lengths, sizes, file path + size + mtime...) gets its own directory
`<data_dir>/<builder>/<config name>-<hash>/1.0.0`, so different settings never share data and a
changed input file is prepared again.

Input files are checked before anything is written: missing, empty, binary (NUL bytes), not UTF-8 or
not gzip, and parallel files with different line counts each raise an error naming the field, the
path and where the problem is. tfds writes into an `incomplete.*` directory and renames it only when
every split is complete (it deletes it on failure), so a failed preparation leaves nothing that
looks prepared.

`catalog_sources` opens any tfds catalog dataset by name (lm1b, wmt14_translate/de-en, ...) with a
mapping from our fields to its feature keys, e.g. {"source": "de", "target": "en"}.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import fcntl
import gzip
import hashlib
import json
import logging
import os
import re
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tensorflow_datasets as tfds
from etils import epath
from tensorflow_datasets.proto import tf_example_pb2

from tfm.checks import ConfigError
from tfm.data import passkey, synthetic
from tfm.logs import silence_absl_message

logger = logging.getLogger(__name__)

# Every tfm builder is built from a config object (the task's parameters), which tfds warns
# about on every command.
silence_absl_message("Using custom data configuration")

VERSION = "1.0.0"
TEXT_UNITS = ("paragraph", "line", "block")
# text_unit="block": the text cut into pieces of this many characters, nothing dropped, so the
# pieces of a split joined back are its text exactly. With bos, a block is 1,024 tokens (char
# tokenizer): training windows of any power of two up to 1,024 tile it without a remainder.
TEXT_BLOCK_CHARS = 1023


class DataError(ValueError):
    """An input file or dataset cannot be used; the message names the field and the path."""


# --------------------------------------------------------------------------------------------
# Reading and checking local files.


def _file_bytes(path: Path, field: str) -> bytes:
    if not path.exists():
        raise FileNotFoundError(f"{field}: file not found: {path}")
    if not path.is_file():
        raise DataError(f"{field}: {path} is not a regular file")
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b" or path.suffix == ".gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as error:
            raise DataError(f"{field}: {path} is not a valid gzip file ({error})") from None
    return data


def read_text_file(path: str | os.PathLike, field: str = "path") -> str:
    """The whole file as text, with line endings normalised to "\\n" (gzip read transparently).

    Raises FileNotFoundError (missing) or DataError (empty, binary, not UTF-8, bad gzip); the
    message starts with `field` and names the path, and for bad bytes the byte offset and line.
    """
    path = Path(path).expanduser()
    data = _file_bytes(path, field)
    if not data.strip():
        raise DataError(f"{field}: {path} is empty")
    nul = data.find(b"\x00")
    if nul >= 0:
        line = data.count(b"\n", 0, nul) + 1
        raise DataError(
            f"{field}: {path} looks binary: NUL byte at byte offset {nul} (line {line}); "
            "expected UTF-8 text"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise DataError(
            f"{field}: {path} is not valid UTF-8: byte 0x{data[error.start]:02x} at byte offset "
            f"{error.start} (line {line}) cannot be decoded"
        ) from None
    return text.removeprefix("\ufeff").replace("\r\n", "\n")


def split_lines(text: str) -> list[str]:
    """Lines split on "\\n" only (so files with odd Unicode separators still align line by line)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def split_units(text: str, unit: str) -> list[str]:
    """Paragraphs (separated by blank lines), non-blank lines, or consecutive blocks of
    TEXT_BLOCK_CHARS characters (all of the text, in order) of `text`."""
    if unit == "block":
        return [text[i : i + TEXT_BLOCK_CHARS] for i in range(0, len(text), TEXT_BLOCK_CHARS)]
    if unit == "paragraph":
        return [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text) if p.strip()]
    if unit == "line":
        return [line for line in split_lines(text) if line.strip()]
    raise ConfigError(f"data.text_unit={unit!r} is unknown; choose one of: {', '.join(TEXT_UNITS)}")


def text_splits(
    text: str, unit: str, validation_fraction: float, path: str | os.PathLike = "the file"
) -> tuple[list[str], list[str]]:
    """(train, validation) units of `text` (see split_units and holdout). A text without blank
    lines is one paragraph, too few to hold out anything: with unit="paragraph" its non-blank
    lines are the units instead (many corpora come one sentence a line), with a one-line note.
    Too few units for `validation_fraction` is a DataError naming data.text_unit and the unit
    that would fit."""
    units = split_units(text, unit)
    if unit == "paragraph" and len(units) == 1 and len(lines := split_units(text, "line")) > 1:
        logger.warning(
            "data.path: %s has no blank lines, so each of its %d lines is an example "
            "(data.text_unit='paragraph' reads lines when there are no paragraphs; "
            "--config.data.text_unit=block keeps the text contiguous)", path, len(lines))
        units = lines
    try:
        return holdout(units, validation_fraction, "data.path")
    except DataError:
        counts = {other: len(split_units(text, other)) for other in TEXT_UNITS if other != unit}
        fits = [other for other, n in counts.items()
                if n - max(1, round(n * validation_fraction)) >= 1]
        advice = (
            f"set --config.data.text_unit={fits[0]} ({counts[fits[0]]} {fits[0]}s"
            + (f" of {TEXT_BLOCK_CHARS} characters)" if fits[0] == "block" else ")")
            if fits else "add text or lower --config.data.validation_fraction"
        )
        raise DataError(
            f"data.path: {path} holds {len(units)} {unit}(s) (data.text_unit={unit!r}; choose "
            f"one of: {', '.join(TEXT_UNITS)}), too few to hold out a validation split of "
            f"{validation_fraction}: {advice}"
        ) from None


def read_parallel_files(
    source_path: str | os.PathLike,
    target_path: str | os.PathLike,
    fields: tuple[str, str] = ("source_path", "target_path"),
) -> list[tuple[str, str]]:
    """(source line, target line) pairs of two aligned files; DataError if line counts differ."""
    source = split_lines(read_text_file(source_path, fields[0]))
    target = split_lines(read_text_file(target_path, fields[1]))
    if len(source) != len(target):
        raise DataError(
            f"parallel files differ in length: {fields[0]}={source_path} has {len(source)} lines "
            f"but {fields[1]}={target_path} has {len(target)} lines"
        )
    return list(zip(source, target, strict=True))


def holdout(items: Sequence[Any], fraction: float, field: str) -> tuple[list[Any], list[Any]]:
    """(train, validation): the last `fraction` of `items` (at least one) is held out."""
    count = max(1, round(len(items) * fraction))
    if len(items) - count < 1:
        raise DataError(
            f"{field}: {len(items)} example(s) are too few to hold out a validation split of "
            f"{fraction}"
        )
    return list(items[:-count]), list(items[-count:])


def _fingerprint(path: str | os.PathLike | None, field: str) -> dict[str, Any] | None:
    if path is None:
        return None
    resolved = Path(path).expanduser().resolve()
    if not resolved.exists():
        from tfm.data import download  # not at the top: `python -m tfm.data.download` runs it

        hint = download.hint(resolved)
        raise FileNotFoundError(
            f"{field}: file not found: {resolved}{'; ' + hint if hint else ''}"
        )
    stat = resolved.stat()
    return {"path": str(resolved), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def _config_name(prefix: str, params: Mapping[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:10]
    return f"{re.sub(r'[^a-zA-Z0-9_]', '_', prefix)}-{digest}"


# --------------------------------------------------------------------------------------------
# Builders.


def _text_info(builder: tfds.core.DatasetBuilder, *names: str) -> tfds.core.DatasetInfo:
    """Text features `names`; records keep generation order (example i is record i)."""
    return tfds.core.DatasetInfo(
        builder=builder,
        description=type(builder).__doc__,
        features=tfds.features.FeaturesDict({name: tfds.features.Text() for name in names}),
        disable_shuffling=True,
    )


class _LocalBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Shared settings of the local builders."""

    VERSION = tfds.core.Version(VERSION)

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls) -> epath.Path:
        # tfds finds this through importlib.resources on the top-level package, which fails when
        # an editable install makes `tfm` look like a namespace package; the builders live here.
        return epath.Path(__file__)


@dataclasses.dataclass(eq=False)
class SyntheticConfig(tfds.core.BuilderConfig):
    task: str = "reverse"
    seed: int = 0
    num_symbols: int = 10
    train_lengths: tuple[int, int] = (1, 16)
    eval_lengths: tuple[int, int] = (17, 32)
    long_eval_lengths: tuple[int, int] | None = None
    num_train: int = 10_000
    num_validation: int = 1_000
    num_test: int = 1_000


class TfmSynthetic(_LocalBuilder):
    """Synthetic algorithmic tasks (synthetic.py): train/validation use `train_lengths`, test uses
    `eval_lengths`, test_long (only when set) `long_eval_lengths`, with num_test examples."""

    def _info(self) -> tfds.core.DatasetInfo:
        return _text_info(self, "source", "target")

    def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
        del dl_manager
        config = self.builder_config
        splits = {
            "train": self._generate_examples("train", config.num_train, config.train_lengths),
            "validation": self._generate_examples(
                "validation", config.num_validation, config.train_lengths
            ),
            "test": self._generate_examples("test", config.num_test, config.eval_lengths),
        }
        if config.long_eval_lengths is not None:
            splits["test_long"] = self._generate_examples(
                "test_long", config.num_test, config.long_eval_lengths
            )
        return splits

    def _generate_examples(self, split: str, count: int, lengths: tuple[int, int]) -> Any:
        config = self.builder_config
        for index in range(count):
            source, target = synthetic.generate(
                config.task,
                index,
                seed=config.seed,
                split=split,
                lengths=tuple(lengths),
                num_symbols=config.num_symbols,
            )
            yield index, {"source": source, "target": target}


@dataclasses.dataclass(eq=False)
class TextFileConfig(tfds.core.BuilderConfig):
    path: str = ""
    text_unit: str = "paragraph"
    validation_fraction: float = 0.1
    passkey_rows: int = 0  # passkey examples added to the training split (tfm.data.passkey)
    passkey_length: int = 0  # their prompts' length in characters
    passkey_alphabet: str = "0123456789"
    passkey_key_length: int = 5


class TfmTextFile(_LocalBuilder):
    """Paragraphs, lines or blocks of one local text file; the last fraction is the validation
    split. `passkey_rows` > 0 adds that many passkey examples (prompt and answer as one record)
    to the training split, shuffled in with the text by the training pipeline."""

    def _info(self) -> tfds.core.DatasetInfo:
        return _text_info(self, "text")

    def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
        del dl_manager
        config = self.builder_config
        # Everything is read and checked before the first record is written.
        text = read_text_file(config.path, "data.path")
        train, validation = text_splits(
            text, config.text_unit, config.validation_fraction, config.path)
        train = train + passkey.training_texts(
            config.passkey_rows, config.passkey_length, alphabet=config.passkey_alphabet,
            key_length=config.passkey_key_length)
        return {
            "train": self._generate_examples(train),
            "validation": self._generate_examples(validation),
        }

    def _generate_examples(self, texts: list[str]) -> Any:
        for index, text in enumerate(texts):
            yield index, {"text": text}


@dataclasses.dataclass(eq=False)
class ParallelFilesConfig(tfds.core.BuilderConfig):
    source_path: str = ""
    target_path: str = ""
    eval_source_path: str | None = None
    eval_target_path: str | None = None
    validation_fraction: float = 0.1


class TfmParallelFiles(_LocalBuilder):
    """Aligned source/target files, one pair per line; plain or gzip."""

    def _info(self) -> tfds.core.DatasetInfo:
        return _text_info(self, "source", "target")

    def _split_generators(self, dl_manager: Any) -> dict[str, Any]:
        del dl_manager
        config = self.builder_config
        pairs = read_parallel_files(
            config.source_path, config.target_path, ("data.source_path", "data.target_path")
        )
        if config.eval_source_path is not None:
            train = pairs
            validation = read_parallel_files(
                config.eval_source_path,
                config.eval_target_path,
                ("data.eval_source_path", "data.eval_target_path"),
            )
        else:
            train, validation = holdout(pairs, config.validation_fraction, "data.source_path")
        return {
            "train": self._generate_examples(train),
            "validation": self._generate_examples(validation),
        }

    def _generate_examples(self, pairs: list[tuple[str, str]]) -> Any:
        for index, (source, target) in enumerate(pairs):
            yield index, {"source": source, "target": target}


# --------------------------------------------------------------------------------------------
# Constructing, preparing and reading.


def synthetic_builder(data_dir: str | os.PathLike, **params: Any) -> TfmSynthetic:
    """A TfmSynthetic builder for `params` (the SyntheticConfig fields), not yet prepared.
    A None parameter keeps its default and stays out of the name, so adding an optional field
    leaves the data prepared before it where it was."""
    params = {k: list(v) if isinstance(v, tuple) else v for k, v in params.items() if v is not None}
    config = SyntheticConfig(name=_config_name(params.get("task", "reverse"), params), **params)
    synthetic.check_task(config.task, config.num_symbols)
    return TfmSynthetic(config=config, data_dir=str(data_dir), file_format="array_record")


def text_file_builder(
    data_dir: str | os.PathLike, path: str | os.PathLike, **params: Any
) -> TfmTextFile:
    """A TfmTextFile builder for one local file; fails early if the file is missing."""
    fingerprint = _fingerprint(path, "data.path")
    config = TextFileConfig(
        name=_config_name(Path(path).name, {"file": fingerprint, **params}),
        path=fingerprint["path"],
        **params,
    )
    return TfmTextFile(config=config, data_dir=str(data_dir), file_format="array_record")


def parallel_files_builder(
    data_dir: str | os.PathLike,
    source_path: str | os.PathLike,
    target_path: str | os.PathLike,
    eval_source_path: str | os.PathLike | None = None,
    eval_target_path: str | os.PathLike | None = None,
    **params: Any,
) -> TfmParallelFiles:
    """A TfmParallelFiles builder; fails early if a file is missing."""
    if (eval_source_path is None) != (eval_target_path is None):
        raise ConfigError(
            "data.eval_source_path and data.eval_target_path must be given together (or neither)"
        )
    files = {
        "source": _fingerprint(source_path, "data.source_path"),
        "target": _fingerprint(target_path, "data.target_path"),
        "eval_source": _fingerprint(eval_source_path, "data.eval_source_path"),
        "eval_target": _fingerprint(eval_target_path, "data.eval_target_path"),
    }
    name = f"{Path(source_path).name}-{Path(target_path).name}"
    config = ParallelFilesConfig(
        name=_config_name(name, {"files": files, **params}),
        source_path=files["source"]["path"],
        target_path=files["target"]["path"],
        eval_source_path=files["eval_source"] and files["eval_source"]["path"],
        eval_target_path=files["eval_target"] and files["eval_target"]["path"],
        **params,
    )
    return TfmParallelFiles(config=config, data_dir=str(data_dir), file_format="array_record")


class TextRecords:
    """Random access to the records of a split whose features are all text, as {name: bytes}.

    Reads the stored tf.train.Example bytes (tfds `DeserializeMethod.RAW_BYTES`) and parses just
    the text fields with the protobuf classes tfds ships for TensorFlow-free reading: the same
    records as `builder.as_data_source()`, about five times faster (tests check they agree).
    """

    def __init__(self, raw: Any, names: Sequence[str]):
        self.raw = raw
        self.names = tuple(names)

    def __len__(self) -> int:
        return len(self.raw)

    def _parse(self, data: bytes) -> dict[str, bytes]:
        feature = tf_example_pb2.Example.FromString(data).features.feature
        return {name: feature[name].bytes_list.value[0] for name in self.names}

    def __getitem__(self, index: int) -> dict[str, bytes]:
        return self._parse(self.raw[index])

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, bytes]]:
        return [self._parse(data) for data in self.raw.__getitems__(list(indices))]

    def __repr__(self) -> str:
        return f"TextRecords({self.raw!r}, names={self.names})"


@contextlib.contextmanager
def _preparation_lock(builder: tfds.core.DatasetBuilder):
    """Holds an exclusive lock on `<data_dir>/<builder>.lock` while preparing, so processes that
    need the same dataset at once (a sweep's parallel runs) prepare it once: without it the
    second process's final rename fails because the first one's directory already exists."""
    root = os.fspath(builder.data_dir_root)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, f"{builder.name}.lock"), "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def prepare(builder: tfds.core.DatasetBuilder) -> dict[str, TextRecords]:
    """Prepares one of our builders (no-op when already prepared): {split: records}.
    Safe when several processes prepare the same dataset at once."""
    with _preparation_lock(builder):
        reused = builder.data_path.exists()
        builder.download_and_prepare()
        if reused:  # maybe prepared by another process after this builder read its info
            builder.info.read_from_directory(builder.data_dir)
    names = list(builder.info.features.keys())
    raw = builder.as_data_source(deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES)
    return {split: TextRecords(source, names) for split, source in raw.items()}


# --------------------------------------------------------------------------------------------
# tfds catalog datasets.

OUR_FIELDS = ("text", "source", "target")
# Catalog builders living in packages that tfds imports lazily.
_LAZY_CATALOG_PACKAGES = ("translate", "text", "summarization", "question_answering")


def _catalog_names() -> list[str]:
    try:
        return tfds.list_builders(with_community_datasets=False)
    except Exception:  # noqa: BLE001 - the list only improves an error message
        return []


def catalog_builder(
    name: str, data_dir: str | os.PathLike | None = None
) -> tfds.core.DatasetBuilder:
    """`tfds.builder(name)` writing array_record; ConfigError naming data.name if unknown."""
    kwargs = {"data_dir": None if data_dir is None else str(data_dir)}
    try:
        return tfds.builder(name, file_format="array_record", **kwargs)
    except tfds.core.registered.DatasetNotFoundError:
        pass
    for package in _LAZY_CATALOG_PACKAGES:  # legacy builders register on import
        try:
            __import__(f"tensorflow_datasets.{package}")
        except Exception:  # noqa: BLE001,S110 - a package needing TensorFlow is skipped
            continue
    try:
        return tfds.builder(name, file_format="array_record", **kwargs)
    except tfds.core.registered.DatasetNotFoundError:
        base = name.split("/")[0].split(":")[0]
        close = difflib.get_close_matches(base, _catalog_names(), n=3)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        raise ConfigError(
            f"data.name={name!r} is not a tfds dataset.{hint} See the catalog at "
            "https://www.tensorflow.org/datasets/catalog/overview or "
            "tfds.list_builders(with_community_datasets=False)."
        ) from None


def check_feature_mapping(features: Mapping[str, str], available: Sequence[str], name: str) -> None:
    """ConfigError unless `features` maps "text" or "source"+"target" to existing feature keys."""
    unknown = sorted(set(features) - set(OUR_FIELDS))
    if unknown:
        raise ConfigError(
            f"data.features has unknown field(s) {', '.join(unknown)}; map 'text' (language "
            "modelling) or 'source' and 'target' (pairs) to the dataset's feature keys"
        )
    if set(features) not in ({"text"}, {"source", "target"}):
        raise ConfigError(
            f"data.features={dict(features)} must map exactly 'text', or both 'source' and 'target'"
        )
    for ours, theirs in features.items():
        if theirs not in available:
            raise ConfigError(
                f"data.features.{ours}={theirs!r} is not a feature of tfds dataset {name!r}; "
                f"its feature keys are: {', '.join(available)}"
            )


def catalog_sources(
    name: str,
    features: Mapping[str, str],
    splits: Sequence[str],
    data_dir: str | os.PathLike | None = None,
    download: bool = False,
) -> dict[str, Any]:
    """{split: data source} of tfds catalog dataset `name`, after checking `features`.

    With `download=True` the dataset is downloaded and prepared in array_record format first
    (this needs network access and, for some builders, TensorFlow for preparation only).
    """
    builder = catalog_builder(name, data_dir)
    check_feature_mapping(features, list(builder.info.features.keys()), name)
    known_splits = list(builder.info.splits.keys())
    for split in splits:
        base_split = re.split(r"[\[+]", split)[0]
        if known_splits and base_split not in known_splits:
            raise ConfigError(
                f"split {split!r} is not in tfds dataset {name!r}; its splits are: "
                f"{', '.join(known_splits)}"
            )
    if download:
        builder.download_and_prepare()
    sources = {}
    for split in splits:
        try:
            sources[split] = builder.as_data_source(split=split)
        except (AssertionError, FileNotFoundError, KeyError) as error:
            raise DataError(
                f"tfds dataset {name!r} split {split!r} is not prepared in array_record format "
                f"under {builder.data_dir} ({error}); set data.download=True to download and "
                "prepare it, or prepare it with `tfds build --file_format=array_record`"
            ) from None
    return sources
