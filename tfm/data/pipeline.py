"""grain input pipelines: records -> token arrays -> packed or padded batches, resumable exactly.

Train (infinite, `make_train_dataset`):

    source[process_index::process_count]        this process's shard (shards partition the data)
    -> seeded shuffle, reshuffled every epoch, repeated forever
    -> chunks of `chunk_size` records, each (in grain's parallel stage, `MakeRows`):
       batched read -> RecordEncoder (tokenize, see below) -> length policy: "filter" (drop
       too long), "truncate", or "split" (LM: cut into windows) -> pack several examples per
       row (first-fit decreasing: segment ids 1, 2, ... and positions restarting at 0 per
       segment) or pad each example to its own row -> rows in a seeded random order
    -> rows one by one -> batch (this process's share of the global batch)
    -> prefetch (a thread, or worker processes)

Eval (finite, `make_eval_batches`): one example per row, padded, never dropped: every process yields
the same number of batches and rows that only pad the last batch have `example_weights` 0.

Examples before batching (numpy, 1-D):
    text           inputs = [bos] + tokens, targets = tokens + [eos], weights (1 where the
                   loss counts)
    prompt_answer  inputs = [bos] + prompt + sep + answer, targets = shifted by one, weights 1
                   on the answer and its eos only (decoder-only use of (source, target) pairs)
    source_target  source = source tokens + [eos]; inputs = [bos] + target tokens;
                   targets = target tokens + [eos]; weights all 1
Batches add positions / segment_ids (and source_positions / source_segment_ids), as in the API
contract; padding has segment id 0, weight 0 and token id 0.

The iterator's `get_state()` / `set_state()` (or `checkpoint_save_args` / `checkpoint_restore_args`
inside `ocp.args.Composite`) resume exactly: a restored run sees the batches it would have seen.
Every transform here is a module-level picklable class, as grain worker processes require.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import grain
import numpy as np

from tfm.data.tokenizers import Tokenizer

# How a record becomes an example (the module docstring): a decoder-only model on text, a
# decoder-only model on (prompt, answer) pairs, or an encoder-decoder on (source, target) pairs.
# Each model family names the formats it trains on (tfm.nn.families: text_format, pair_format).
FORMATS = ("text", "prompt_answer", "source_target")
LENGTH_POLICIES = ("filter", "truncate", "split")
Example = dict[str, np.ndarray]


def _to_str(value: Any) -> str:
    if isinstance(value, np.ndarray):
        value = value.item()
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


@dataclasses.dataclass(frozen=True)
class RecordEncoder:
    """Turns one record into one example (see the module docstring).

    fields: (our field, record key) pairs: ("text", k) for LM; ("source", k), ("target", k) else.
    format: one of FORMATS: "text", "prompt_answer" (a pair as prompt + separator + answer)
    or "source_target" (a pair for an encoder-decoder).
    """

    format: str
    tokenizer: Tokenizer  # LM / target side
    source_tokenizer: Tokenizer | None = None  # seq2seq source side (None = tokenizer)
    separator_ids: tuple[int, ...] = ()  # prompt_answer: between prompt and answer
    fields: tuple[tuple[str, str], ...] = ()  # () = the record already uses our names

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format={self.format!r} is unknown; choose one of: {FORMATS}")

    @property
    def has_source(self) -> bool:
        """Examples carry an encoder input (`source`) besides the decoder's rows."""
        return self.format == "source_target"

    def texts(self, record: Mapping[str, Any]) -> dict[str, str]:
        """{"text": ...} or {"source": ..., "target": ...} of a record, as str."""
        names = ("text",) if self.format == "text" else ("source", "target")
        keys = dict(self.fields) or {name: name for name in names}
        return {name: _to_str(record[keys[name]]) for name in names}

    def encode_prompt(self, source: str) -> list[int]:
        """What the model conditions on: the encoder input (source_target) or the decoder prefix
        (prompt_answer)."""
        if self.has_source:
            source_tokenizer = self.source_tokenizer or self.tokenizer
            return [*source_tokenizer.encode(source), source_tokenizer.eos_id]
        return [self.tokenizer.bos_id, *self.tokenizer.encode(source), *self.separator_ids]

    def __call__(self, record: Mapping[str, Any]) -> Example:
        texts = self.texts(record)
        bos, eos = self.tokenizer.bos_id, self.tokenizer.eos_id  # the tokenizer's own ids
        if self.format == "text":
            ids = np.asarray([bos, *self.tokenizer.encode(texts["text"]), eos], np.int32)
            return {
                "inputs": ids[:-1],
                "targets": ids[1:],
                "weights": np.ones(len(ids) - 1, np.float32),
            }
        target = self.tokenizer.encode(texts["target"])
        if self.format == "prompt_answer":
            prompt = self.encode_prompt(texts["source"])
            ids = np.asarray([*prompt, *target, eos], np.int32)
            weights = np.zeros(len(ids) - 1, np.float32)
            weights[len(prompt) - 1 :] = 1.0  # targets from the first answer token to eos
            return {"inputs": ids[:-1], "targets": ids[1:], "weights": weights}
        return {
            "source": np.asarray(self.encode_prompt(texts["source"]), np.int32),
            "inputs": np.asarray([bos, *target], np.int32),
            "targets": np.asarray([*target, eos], np.int32),
            "weights": np.ones(len(target) + 1, np.float32),
        }


def feature_lengths(seq_len: int, source_seq_len: int | None = None) -> dict[str, int]:
    """Row length of every example feature: decoder side `seq_len`, source `source_seq_len`."""
    lengths = {"inputs": seq_len, "targets": seq_len, "weights": seq_len}
    if source_seq_len is not None:
        lengths["source"] = source_seq_len
    return lengths


@dataclasses.dataclass(frozen=True)
class FitsLengths:
    """Filter predicate: every feature fits its row length."""

    lengths: Mapping[str, int]

    def __call__(self, example: Example) -> bool:
        return all(len(example[key]) <= length for key, length in self.lengths.items())


@dataclasses.dataclass(frozen=True)
class Truncate:
    """Cuts every feature to its row length."""

    lengths: Mapping[str, int]

    def __call__(self, example: Example) -> Example:
        return {key: value[: self.lengths[key]] for key, value in example.items()}


def split_windows(example: Example, seq_len: int) -> list[Example]:
    """An LM example cut into consecutive windows of `seq_len` tokens (nothing is lost)."""
    length = len(example["inputs"])
    return [
        {key: value[start : start + seq_len] for key, value in example.items()}
        for start in range(0, length, seq_len)
    ]


def apply_length_policy(
    examples: Sequence[Example], lengths: Mapping[str, int], policy: str
) -> list[Example]:
    """Drops ("filter"), cuts ("truncate") or splits ("split", LM only) too-long examples."""
    if policy == "filter":
        fits = FitsLengths(lengths)
        return [e for e in examples if fits(e)]
    if policy == "truncate":
        truncate = Truncate(lengths)
        return [truncate(e) for e in examples]
    if policy == "split":
        return [w for e in examples for w in split_windows(e, lengths["inputs"])]
    raise ValueError(f"length_policy={policy!r} is unknown; choose one of: {LENGTH_POLICIES}")


def _positions(lengths: Sequence[int], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(segment_ids, positions) [size] of segments with `lengths` laid end to end, 0 after."""
    segment_ids = np.zeros(size, np.int32)
    positions = np.zeros(size, np.int32)
    start = 0
    for segment, length in enumerate(lengths, start=1):
        segment_ids[start : start + length] = segment
        positions[start : start + length] = np.arange(length, dtype=np.int32)
        start += length
    return segment_ids, positions


def make_row(examples: Sequence[Example], lengths: Mapping[str, int]) -> Example:
    """One batch row holding `examples` end to end (they must fit), padded with zeros.

    Adds `segment_ids` (1, 2, ... per example, 0 = padding) and `positions` (restarting at 0 in
    each example) for the decoder side, and `source_segment_ids` / `source_positions` for seq2seq.
    """
    row = {}
    for key, size in lengths.items():
        values = np.zeros(size, np.float32 if key == "weights" else np.int32)
        parts = [e[key] for e in examples]
        used = sum(len(p) for p in parts)
        if used > size:
            raise ValueError(f"{key}: {used} tokens do not fit a row of {size}")
        if parts:
            values[:used] = np.concatenate(parts)
        row[key] = values
    for key, prefix in (("inputs", ""), ("source", "source_")):
        if key in lengths:
            segment_ids, positions = _positions([len(e[key]) for e in examples], lengths[key])
            row[prefix + "segment_ids"] = segment_ids
            row[prefix + "positions"] = positions
    return row


def pack_first_fit(examples: Sequence[Example], lengths: Mapping[str, int]) -> list[list[int]]:
    """Groups example indices into rows: first-fit decreasing (longest first, each into the first
    row with room on every side). Deterministic; every example must fit a row on its own."""
    keys = ["inputs", *(["source"] if "source" in lengths else [])]
    sizes = [tuple(len(e[key]) for key in keys) for e in examples]
    limits = tuple(lengths[key] for key in keys)
    order = sorted(range(len(examples)), key=lambda i: sizes[i], reverse=True)
    # No example is smaller than this on any side: rows with less room left are closed, which
    # keeps the search short (windows of exactly seq_len close their row at once).
    smallest = [min((size[k] for size in sizes), default=0) for k in range(len(keys))]
    rows: list[list[int]] = []
    open_rows: list[tuple[list[int], list[int]]] = []  # (row, tokens used per side)
    for i in order:
        size = sizes[i]
        position = next(
            (
                p
                for p, (_, used) in enumerate(open_rows)
                if all(u + s <= lim for u, s, lim in zip(used, size, limits, strict=True))
            ),
            None,
        )
        if position is None:
            position = len(open_rows)
            rows.append([])
            open_rows.append((rows[-1], [0] * len(keys)))
        row, used = open_rows[position]
        row.append(i)
        for k, s in enumerate(size):
            used[k] += s
        if any(u + m > lim for u, m, lim in zip(used, smallest, limits, strict=True)):
            del open_rows[position]
    return rows


def read_records(source: Sequence[Any], indices: Sequence[int]) -> list[Any]:
    """source[i] for each index, in one batched read when the source supports it (array_record
    reads a batch about ten times faster than one record at a time)."""
    indices = [int(i) for i in indices]
    getitems = getattr(source, "__getitems__", None)
    if getitems is not None:
        try:
            return list(getitems(indices))
        except TypeError:  # a broken batch read (tfds.testing.mock_data's): read one by one
            pass
    return [source[i] for i in indices]


@dataclasses.dataclass(frozen=True)
class MakeRows(grain.transforms.RandomMap):
    """A chunk of record indices -> the batch rows they make (read, encode, length policy, then
    pack or pad; rows shuffled). Runs in grain's parallel stage, so reading, tokenizing and
    packing use every read thread / worker."""

    source: Sequence[Any]
    encoder: RecordEncoder
    lengths: Mapping[str, int]
    length_policy: str
    packing: bool

    def random_map(self, indices: Sequence[int], rng: np.random.Generator) -> list[Example]:
        examples = [self.encoder(record) for record in read_records(self.source, indices)]
        examples = apply_length_policy(examples, self.lengths, self.length_policy)
        if self.packing:
            groups = pack_first_fit(examples, self.lengths)
        else:
            groups = [[i] for i in range(len(examples))]
        rows = [make_row([examples[i] for i in group], self.lengths) for group in groups]
        # First-fit decreasing orders rows by their longest example; mix them.
        return [rows[i] for i in rng.permutation(len(rows))]


class Unbatch(grain.experimental.FlatMapTransform):
    """A list of rows -> the rows, one by one."""

    max_fan_out = 1 << 20

    def flat_map(self, rows: list[Example]) -> list[Example]:
        return rows


def _check_shard(num_records: int, process_index: int, process_count: int) -> None:
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} must be in [0, {process_count})")
    if num_records < process_count:
        raise ValueError(
            f"{num_records} record(s) cannot be shared among process_count={process_count}"
        )


def make_train_dataset(
    source: Sequence[Any],
    encoder: RecordEncoder,
    *,
    lengths: Mapping[str, int],
    batch_size: int,
    seed: int,
    length_policy: str = "filter",
    packing: bool = True,
    shuffle: bool = True,
    process_index: int = 0,
    process_count: int = 1,
    num_workers: int = 0,
    prefetch: int = 2,
    read_threads: int = 2,
    chunk_size: int = 256,
) -> grain.IterDataset:
    """The infinite training pipeline of this process (see the module docstring).

    source: random-access records (a tfds data source); lengths: `feature_lengths(...)`;
    batch_size: rows per batch for this process; chunk_size: records read, tokenized and packed
    together (packing only combines examples of one chunk). Each batch: `inputs`, `targets`,
    `weights`, `positions`, `segment_ids` [batch_size, seq_len] (and `source`,
    `source_positions`, `source_segment_ids` [batch_size, source_seq_len] for seq2seq).
    """
    if length_policy not in LENGTH_POLICIES:
        raise ValueError(f"length_policy={length_policy!r}; choose one of: {LENGTH_POLICIES}")
    if length_policy == "split" and encoder.format != "text":
        raise ValueError("length_policy='split' only applies to language modelling on text")
    _check_shard(len(source), process_index, process_count)
    lengths = dict(lengths)
    indices = grain.MapDataset.range(len(source))[process_index::process_count].seed(seed)
    if shuffle:
        indices = indices.shuffle()
    chunks = indices.repeat(None, reseed_each_epoch=True).batch(chunk_size)
    rows = chunks.random_map(MakeRows(source, encoder, lengths, length_policy, packing))
    # grain's default read options (16 threads, 500 elements) cost more than they save: the
    # reader scans its whole buffer on every element.
    read = grain.ReadOptions(num_threads=read_threads, prefetch_buffer_size=2 * read_threads)
    it = grain.experimental.FlatMapIterDataset(rows.to_iter_dataset(read), Unbatch())
    it = it.batch(batch_size, drop_remainder=True)
    if num_workers > 0:
        it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers))
    elif prefetch > 0:
        it = grain.experimental.ThreadPrefetchIterDataset(it, prefetch_buffer_size=prefetch)
    return it


def make_train_iterator(source: Sequence[Any], encoder: RecordEncoder, **kwargs: Any) -> Any:
    """`iter(make_train_dataset(...))`: a grain DatasetIterator with get_state()/set_state()."""
    return iter(make_train_dataset(source, encoder, **kwargs))


def _all_records(source: Sequence[Any]) -> Iterator[Any]:
    """Every record of `source`, in order, read 1,024 at a time."""
    for start in range(0, len(source), 1024):
        yield from read_records(source, range(start, min(start + 1024, len(source))))


def eval_examples(
    source: Sequence[Any], encoder: RecordEncoder, *, split_length: int | None = None
) -> list[Example]:
    """Every example of an eval split, in order; LM text is cut into windows of `split_length`
    tokens when given (nothing is dropped)."""
    examples = [encoder(record) for record in _all_records(source)]
    if split_length is not None:
        examples = [w for example in examples for w in split_windows(example, split_length)]
    return examples


def contiguous_windows(source: Sequence[Any], encoder: RecordEncoder, length: int) -> list[Example]:
    """An LM split read as one text (its records' texts joined, in order), encoded once as
    [bos] + text + [eos] and cut into every non-overlapping window of exactly `length` tokens;
    the last, shorter remainder is dropped, so every window has the same context size
    (nonoverlapping evaluation, Press et al. 2022, sec. 4 and appendix)."""
    if encoder.format != "text":
        raise ValueError("contiguous windows need language modelling on text (format 'text')")
    key = dict(encoder.fields).get("text", "text")
    text = "".join(encoder.texts(record)["text"] for record in _all_records(source))
    example = encoder({key: text})
    count = len(example["inputs"]) // length
    if count == 0:
        raise ValueError(
            f"the eval text has {len(example['inputs'])} tokens, fewer than one window of {length}"
        )
    return split_windows({k: v[: count * length] for k, v in example.items()}, length)


def longest(examples: Sequence[Example]) -> dict[str, int]:
    """The longest length of each feature over `examples` (eval rows need no truncation)."""
    keys = examples[0].keys() if examples else ("inputs", "targets", "weights")
    return {key: max((len(e[key]) for e in examples), default=1) for key in keys}


def shard_rows(
    num_examples: int, batch_size: int, process_index: int, process_count: int
) -> tuple[range, int]:
    """(example indices of this process, number of batches every process yields)."""
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} must be in [0, {process_count})")
    per_process = math.ceil(num_examples / process_count)
    num_batches = math.ceil(per_process / batch_size)
    return range(process_index, num_examples, process_count), num_batches


def make_eval_batches(
    examples: Sequence[Example],
    *,
    lengths: Mapping[str, int],
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
) -> Iterator[Example]:
    """Padded eval batches of this process's shard; never drops an example.

    Examples longer than `lengths` are truncated (pass `longest(examples)` to avoid that). Every
    process yields the same number of batches; `example_weights` [batch_size] is 1 for real rows and
    0 for rows that only pad the last batch(es).
    """
    indices, num_batches = shard_rows(len(examples), batch_size, process_index, process_count)
    lengths = {key: lengths[key] for key in examples[0]}
    truncate = Truncate(lengths)
    template = make_row([], lengths)
    for b in range(num_batches):
        batch_indices = indices[b * batch_size : (b + 1) * batch_size]
        rows = [make_row([truncate(examples[i])], lengths) for i in batch_indices]
        weights = np.zeros(batch_size, np.float32)
        weights[: len(rows)] = 1.0
        rows += [template] * (batch_size - len(rows))
        batch = {key: np.stack([row[key] for row in rows]) for key in template}
        batch["example_weights"] = weights
        yield batch


def checkpoint_save_args(iterator: Any) -> Any:
    """Orbax save args for the iterator state: use inside `ocp.args.Composite(data=...)`."""
    return grain.checkpoint.CheckpointSave(iterator)


def checkpoint_restore_args(iterator: Any) -> Any:
    """Orbax restore args: restores the state into `iterator` (made by the same pipeline)."""
    return grain.checkpoint.CheckpointRestore(iterator)
