"""grain pipelines: example formats, packing, determinism, exact resume, sharding, eval batches."""

import numpy as np
import orbax.checkpoint as ocp
import pytest

from tfm.data import pipeline
from tfm.data.tokenizers import BOS_ID, EOS_ID, ByteTokenizer, CharTokenizer

BYTES = ByteTokenizer()


def _pairs(count, seed=0):
    rng = np.random.default_rng(seed)
    words = ["ab", "cde", "f", "ghij", "kl"]
    out = []
    for i in range(count):
        source = f"{i}:" + "".join(rng.choice(words, size=int(rng.integers(1, 4))))
        out.append({"source": source.encode(), "target": source[::-1].encode()})
    return out


def _segments(row, key, segment_key):
    """{segment id: tokens} of one packed row."""
    ids = row[segment_key]
    return {int(s): row[key][ids == s] for s in np.unique(ids) if s > 0}


def test_lm_example_format():
    example = pipeline.RecordEncoder("text", BYTES)({"text": "hi"})
    ids = BYTES.encode("hi")
    assert example["inputs"].tolist() == [BOS_ID, *ids]
    assert example["targets"].tolist() == [*ids, EOS_ID]
    assert example["weights"].tolist() == [1.0, 1.0, 1.0]


def test_seq2seq_example_format():
    example = pipeline.RecordEncoder("source_target", BYTES)({"source": b"ab", "target": "xyz"})
    assert example["source"].tolist() == [*BYTES.encode("ab"), EOS_ID]
    assert example["inputs"].tolist() == [BOS_ID, *BYTES.encode("xyz")]
    assert example["targets"].tolist() == [*BYTES.encode("xyz"), EOS_ID]
    assert example["weights"].tolist() == [1.0] * 4


def test_prompt_lm_weights_only_the_answer_and_eos():
    tok = CharTokenizer(list("0123456789+="))
    encoder = pipeline.RecordEncoder("prompt_answer", tok, separator_ids=tuple(tok.encode("=")))
    example = encoder({"source": "12+9", "target": "21"})
    full = [BOS_ID, *tok.encode("12+9="), *tok.encode("21"), EOS_ID]
    assert example["inputs"].tolist() == full[:-1]
    assert example["targets"].tolist() == full[1:]
    answer_targets = example["targets"][example["weights"] == 1]
    assert answer_targets.tolist() == [*tok.encode("21"), EOS_ID]
    assert example["weights"].sum() == 3
    assert encoder.encode_prompt("12+9") == full[:6]


def test_packing_keeps_segments_apart():
    encoder = pipeline.RecordEncoder("source_target", BYTES)
    examples = [encoder(record) for record in _pairs(40)]
    lengths = pipeline.feature_lengths(24, 20)
    groups = pipeline.pack_first_fit(examples, lengths)
    assert sorted(i for group in groups for i in group) == list(range(40))
    assert len(groups) < 40  # some rows do hold several examples
    for group in groups:
        row = pipeline.make_row([examples[i] for i in group], lengths)
        assert {key: len(value) for key, value in row.items()} == {
            **lengths,
            "segment_ids": 24,
            "positions": 24,
            "source_segment_ids": 20,
            "source_positions": 20,
        }
        for side, segment_key, position_key in (
            ("inputs", "segment_ids", "positions"),
            ("source", "source_segment_ids", "source_positions"),
        ):
            segments = _segments(row, side, segment_key)
            assert sorted(segments) == list(range(1, len(group) + 1))
            for segment, i in enumerate(group, start=1):
                # Segment k holds example k of the row, on the source and the target side alike.
                np.testing.assert_array_equal(segments[segment], examples[i][side])
                mask = row[segment_key] == segment
                np.testing.assert_array_equal(row[position_key][mask], np.arange(mask.sum()))
            padding = row[segment_key] == 0
            assert not row[side][padding].any() and not row[position_key][padding].any()
            # Segments are contiguous and padding only at the end.
            ids = row[segment_key][~padding]
            assert (np.diff(ids) >= 0).all() and padding[len(ids) :].all()
        for key in ("targets", "weights"):
            segments = _segments(row, key, "segment_ids")
            for segment, i in enumerate(group, start=1):
                np.testing.assert_array_equal(segments[segment], examples[i][key])


def test_length_policies():
    example = pipeline.RecordEncoder("text", BYTES)({"text": "abcdefghij"})  # 11 tokens
    lengths = pipeline.feature_lengths(4)
    assert pipeline.apply_length_policy([example], lengths, "filter") == []
    (cut,) = pipeline.apply_length_policy([example], lengths, "truncate")
    assert cut["inputs"].tolist() == example["inputs"][:4].tolist()
    windows = pipeline.apply_length_policy([example], lengths, "split")
    assert [len(w["inputs"]) for w in windows] == [4, 4, 3]
    for key in ("inputs", "targets", "weights"):
        np.testing.assert_array_equal(np.concatenate([w[key] for w in windows]), example[key])


def _train(records, **kwargs):
    options = dict(
        lengths=pipeline.feature_lengths(24, 20),
        batch_size=4,
        seed=7,
        chunk_size=16,
        read_threads=0,
        prefetch=0,
    )
    options.update(kwargs)
    encoder = pipeline.RecordEncoder("source_target", BYTES)
    return pipeline.make_train_iterator(records, encoder, **options)


def _take(iterator, count):
    return [next(iterator) for _ in range(count)]


def _assert_same_batches(first, second):
    assert len(first) == len(second)
    for a, b in zip(first, second, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])


def test_batches_have_the_contract_shapes_and_dtypes():
    batch = next(_train(_pairs(30)))
    shapes = {key: (value.shape, value.dtype.name) for key, value in batch.items()}
    assert shapes == {
        "inputs": ((4, 24), "int32"),
        "targets": ((4, 24), "int32"),
        "weights": ((4, 24), "float32"),
        "positions": ((4, 24), "int32"),
        "segment_ids": ((4, 24), "int32"),
        "source": ((4, 20), "int32"),
        "source_positions": ((4, 20), "int32"),
        "source_segment_ids": ((4, 20), "int32"),
    }
    # Loss weights exactly where there are target tokens.
    np.testing.assert_array_equal(batch["weights"] > 0, batch["segment_ids"] > 0)
    np.testing.assert_array_equal(batch["targets"] > 0, batch["segment_ids"] > 0)


def test_same_seed_same_batches_other_seed_other_batches():
    records = _pairs(50)
    _assert_same_batches(_take(_train(records), 6), _take(_train(records, read_threads=2), 6))
    other = _take(_train(records, seed=8), 6)
    assert any(
        not np.array_equal(a["inputs"], b["inputs"])
        for a, b in zip(_take(_train(records), 6), other, strict=True)
    )


@pytest.mark.parametrize("packing", [True, False])
def test_iterator_state_round_trip_gives_identical_next_batches(packing):
    records = _pairs(37)
    iterator = _train(records, packing=packing, prefetch=2)
    _take(iterator, 5)
    state = iterator.get_state()
    expected = _take(iterator, 12)  # crosses epoch boundaries
    restored = _train(records, packing=packing, prefetch=2)
    restored.set_state(state)
    _assert_same_batches(_take(restored, 12), expected)


def test_orbax_checkpoint_round_trip(tmp_path):
    records = _pairs(30)
    iterator = _train(records)
    _take(iterator, 3)
    manager = ocp.CheckpointManager(tmp_path / "ckpt", item_names=("data",))
    manager.save(3, args=ocp.args.Composite(data=pipeline.checkpoint_save_args(iterator)))
    manager.wait_until_finished()
    expected = _take(iterator, 4)
    restored = _train(records)
    manager.restore(3, args=ocp.args.Composite(data=pipeline.checkpoint_restore_args(restored)))
    _assert_same_batches(_take(restored, 4), expected)
    manager.close()


def test_process_shards_partition_the_data():
    records = _pairs(36)
    seen = []
    for process_index in range(3):
        # Unpacked rows, batch 1, chunks aligned with the 12-record shard: one epoch = 12 rows.
        iterator = _train(
            records,
            packing=False,
            batch_size=1,
            chunk_size=6,
            length_policy="truncate",
            process_index=process_index,
            process_count=3,
        )
        rows = [BYTES.decode(b["source"][0]).split(":")[0] for b in _take(iterator, 12)]
        assert len(set(rows)) == 12  # a whole epoch of distinct records
        seen.append(set(rows))
    assert set.union(*seen) == {str(i) for i in range(36)}
    assert sum(len(s) for s in seen) == 36  # no overlap


def test_filter_drops_only_too_long_examples():
    records = [{"text": "x" * n} for n in (2, 30, 3, 40, 4)]
    iterator = pipeline.make_train_iterator(
        records,
        pipeline.RecordEncoder("text", BYTES),
        lengths=pipeline.feature_lengths(8),
        batch_size=1,
        seed=0,
        packing=False,
        shuffle=False,
        chunk_size=5,
        read_threads=0,
        prefetch=0,
        length_policy="filter",
    )
    lengths = sorted(int(b["segment_ids"].sum()) for b in _take(iterator, 3))
    assert lengths == [3, 4, 5]


def test_eval_batches_never_drop_and_pad_equally_on_every_process():
    encoder = pipeline.RecordEncoder("source_target", BYTES)
    records = _pairs(11)
    examples = pipeline.eval_examples(records, encoder)
    lengths = pipeline.longest(examples)
    counts, found = [], []
    for process_index in range(3):
        batches = list(
            pipeline.make_eval_batches(
                examples,
                lengths=lengths,
                batch_size=2,
                process_index=process_index,
                process_count=3,
            )
        )
        counts.append(len(batches))
        for batch in batches:
            for row in range(2):
                if batch["example_weights"][row]:
                    found.append(BYTES.decode(batch["source"][row]))
                else:  # padding rows are empty
                    assert not batch["source"][row].any() and not batch["weights"][row].any()
    assert counts == [2, 2, 2]  # 4, 4 and 3 examples on the three processes
    assert sorted(found) == sorted(r["source"].decode() for r in records)


def test_eval_batches_truncate_but_keep_every_example():
    examples = pipeline.eval_examples(
        [{"text": "abcdef"}, {"text": "a"}], pipeline.RecordEncoder("text", BYTES)
    )
    (batch,) = pipeline.make_eval_batches(
        examples, lengths=pipeline.feature_lengths(4), batch_size=3
    )
    assert batch["example_weights"].tolist() == [1.0, 1.0, 0.0]
    assert batch["segment_ids"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
