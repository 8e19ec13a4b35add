"""Long-context probes of evaluation (tfm/training/long_context.py): perplexity by position
bucket against the eval loss and a numpy loop, passkey scores through an oracle decoder, and
the settings refused before anything compiles."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest

from configs import char_lm
from tfm.checks import ConfigError
from tfm.training import long_context
from tfm.training.evaluate import evaluate
from tfm.training.experiment import init_state, setup, state_shardings


def test_bucket_sums_equal_a_loop():
    rng = np.random.default_rng(0)
    batch, length, vocab, buckets = 3, 20, 7, 4
    logits = rng.normal(size=(batch, length, vocab)).astype(np.float32)
    targets = rng.integers(0, vocab, (batch, length))
    weights = (rng.random((batch, length)) > 0.2).astype(np.float32)
    positions = np.stack([np.arange(length), np.arange(length) % 8, np.arange(length)])
    nll, count = long_context.bucket_sums(logits, targets, weights, positions, buckets, length)
    want_nll, want_count = np.zeros(buckets), np.zeros(buckets)
    for b in range(batch):
        for t in range(length):
            row = logits[b, t].astype(np.float64)
            token_nll = np.log(np.exp(row).sum()) - row[targets[b, t]]
            bucket = positions[b, t] * buckets // length
            want_nll[bucket] += weights[b, t] * token_nll
            want_count[bucket] += weights[b, t]
    np.testing.assert_allclose(nll, want_nll, rtol=1e-5)
    np.testing.assert_allclose(count, want_count)


def _experiment(tmp_path, **eval_fields):
    config = char_lm.get_config("small")
    config.data.update(seq_len=64, batch_size=8, eval_batch_size=8)
    config.model.update(position_scheme="rope")
    config.eval.update(max_batches=1, generation_metric="none", **eval_fields)
    return setup(config, tmp_path / "run")


def _params(experiment):
    return init_state(experiment, state_shardings(experiment)[1]).params


def test_one_position_bucket_is_the_eval_perplexity_and_four_split_it(tmp_path):
    experiment = _experiment(tmp_path, position_buckets=1)
    params = _params(experiment)
    results = evaluate(experiment, params)
    [(name, value)] = [(k, v) for k, v in results.items() if "_ppl_pos" in k]
    assert name.endswith("_ppl_pos0-63")
    assert value == pytest.approx(results[name.split("_ppl_pos")[0] + "_perplexity"], rel=1e-5)
    experiment.eval = experiment.eval.__class__(
        **{**experiment.eval.__dict__, "position_buckets": 4})
    split = experiment.eval_splits[0]
    four = long_context.position_perplexity(experiment, params, split)
    assert sorted(k.split("_ppl_pos")[1] for k in four) == ["0-15", "16-31", "32-47", "48-63"]
    assert len(set(np.round(list(four.values()), 6))) == 4


def test_passkey_scores_through_an_oracle_that_reads_only_the_first_half(tmp_path):
    experiment = _experiment(tmp_path, passkey_lengths=(256, 320), passkey_alphabet="abcdefgh",
                             passkey_examples=2)

    def oracle(experiment, params, prompts, decode):
        assert decode.method == "greedy" and decode.max_new_tokens == 7
        answers = []
        for prompt in prompts:
            key = re.search(r"The pass key is (\w+)\.", prompt)
            in_first_half = key.start() < len(prompt) / 2
            answers.append(f" {key.group(1)}" if in_first_half else " zzzzz")
        return answers

    scores = long_context.passkey_scores(experiment, _params(experiment), oracle)
    for length in (256, 320):
        cells = {k: v for k, v in scores.items()
                 if k.startswith(f"passkey/passkey_len{length}_depth")}
        assert len(cells) == 5
        assert cells[f"passkey/passkey_len{length}_depth0"] == 100.0
        assert cells[f"passkey/passkey_len{length}_depth1"] == 0.0
        assert scores[f"passkey/passkey_len{length}"] == pytest.approx(np.mean(list(
            cells.values())))


@pytest.mark.parametrize("fields, model, message", [
    (dict(passkey_lengths=(200,)), {}, "characters outside the vocabulary"),
    (dict(passkey_lengths=(512,), passkey_alphabet="abcdefgh"),
     dict(position_scheme="learned", max_len=256), "past model.max_len=256"),
    (dict(passkey_lengths=(64,), passkey_alphabet="abcdefgh"), {},
     "eval.passkey_lengths: length=64 is too short"),
    (dict(passkey_depths=(1.5,)), {}, "eval.passkey_depths=1.5 must be numbers in [0, 1]"),
    (dict(passkey_task="needle"), {}, "eval.passkey_task='needle'"),
])
def test_settings_the_run_cannot_take_are_refused_at_setup(tmp_path, fields, model, message):
    config = char_lm.get_config("small")
    config.data.update(seq_len=64, batch_size=8, eval_batch_size=8)
    config.model.update(model)
    config.eval.update(fields)
    with pytest.raises(ConfigError, match=re.escape(message)):
        setup(config, tmp_path / "run")
    assert jax.device_count() >= 1


def test_evaluate_decodes_the_passkey_prompts_with_the_model(tmp_path):
    """Through tfm's own decoding (an untrained model: the score is 0 or 100, the names and
    cells are what the config asks for)."""
    experiment = _experiment(tmp_path, passkey_lengths=(192,), passkey_depths=(0.5,),
                             passkey_alphabet="abcdefgh", passkey_examples=1)
    results = evaluate(experiment, _params(experiment))
    assert results["passkey/passkey_len192_depth0.5"] in (0.0, 100.0)
    assert results["passkey/passkey_len192"] == results["passkey/passkey_len192_depth0.5"]
    assert results["passkey/passkey_len192_key_nll"] > 0
    assert 0 <= results["passkey/passkey_len192_key_chars"] <= 100


def test_answer_sums_equal_a_loop():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(2, 9, 5)).astype(np.float32)
    targets = rng.integers(0, 5, (2, 9))
    weights = (rng.random((2, 9)) > 0.5).astype(np.float32)
    nll, hits, count = long_context.answer_sums(logits, targets, weights)
    rows = logits.astype(np.float64)
    token_nll = np.log(np.exp(rows).sum(-1)) - np.take_along_axis(rows, targets[..., None], -1)[
        ..., 0]
    assert float(nll) == pytest.approx(float((token_nll * weights).sum()), rel=1e-5)
    assert float(hits) == float(((rows.argmax(-1) == targets) * weights).sum())
    assert float(count) == float(weights.sum())


def test_key_scores_equal_each_prompt_scored_alone(tmp_path):
    """Padded and batched (rows of different lengths) the keys' NLL and top-1 hits equal each
    example run alone, unpadded, with the answer's log-probabilities read off by hand."""
    from tfm.data import passkey

    experiment = _experiment(tmp_path, passkey_lengths=(192,), passkey_alphabet="abcdefgh")
    params = _params(experiment)
    examples = [passkey.make_example("passkey", length, depth, 0, alphabet="abcdefgh",
                                     encode=experiment.data.tokenizer.encode)
                for length, depth in ((170, 0.0), (192, 0.5), (150, 1.0))]
    nll, hits = long_context.key_scores(experiment, params, examples)
    data, total, right, count = experiment.data, 0.0, 0, 0
    for example in examples:
        prompt = data.encode_prompt(example.prompt)
        answer = data.tokenizer.encode(example.answer)
        ids = np.asarray([prompt + answer[:-1]], np.int32)
        batch = {"inputs": ids, "targets": ids, "positions": np.arange(ids.shape[1])[None],
                 "segment_ids": np.ones_like(ids), "weights": np.ones(ids.shape, np.float32),
                 "example_weights": np.ones(1, np.float32)}
        logits = np.asarray(experiment.family.logits(experiment.model, params, batch,
                                                     deterministic=True), np.float64)[0]
        for offset, token in enumerate(answer):
            row = logits[len(prompt) - 1 + offset]
            total += np.log(np.exp(row - row.max()).sum()) + row.max() - row[token]
            right += int(row.argmax() == token)
            count += 1
    assert nll == pytest.approx(total / count, rel=1e-4)
    assert hits == right / count


def test_without_decoding_only_the_teacher_forced_scores_are_logged(tmp_path):
    experiment = _experiment(tmp_path, passkey_lengths=(256,), passkey_alphabet="abcdefgh",
                             passkey_examples=1, passkey_decode=False)

    def never(*args):
        raise AssertionError("decoded although eval.passkey_decode=False")

    scores = long_context.passkey_scores(experiment, _params(experiment), never)
    assert sorted(scores) == ["passkey/passkey_len256_key_chars", "passkey/passkey_len256_key_nll"]
