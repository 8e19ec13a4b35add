"""Tests for tfm/decode/search.py with hand-built toy models (pure functions, tiny vocabularies).

Token ids: pad 0, bos 1, eos 2; the rest are ordinary tokens.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.checks import ConfigError
from tfm.decode import beam as beam_module
from tfm.decode.search import (
    BeamOutput,
    DecodeOutput,
    beam_search,
    filter_logits,
    greedy,
    length_penalty,
    sample,
    segment_ends,
)

PAD, BOS, EOS = 0, 1, 2
V = 8


def log(p):
    with np.errstate(divide="ignore"):
        return np.log(np.asarray(p, np.float64))


def log_softmax(x):
    x = np.asarray(x, np.float64)
    finite_max = np.max(np.where(np.isfinite(x), x, -np.inf), axis=-1, keepdims=True)
    shifted = x - finite_max
    return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def bigram_model(log_table):
    """logits = log_table[previous token]; cache = {"last": [B], "steps": [B]}."""
    table = jnp.asarray(log_table, jnp.float32)

    def tokens_to_logits(tokens, cache):
        last = tokens[:, -1]
        return table[last][:, None, :], {"last": last, "steps": cache["steps"] + 1}

    return tokens_to_logits


def bigram_cache(batch):
    return {"last": jnp.full((batch,), BOS, jnp.int32), "steps": jnp.zeros((batch,), jnp.int32)}


def chain_table():
    """A bigram table with one clear successor per token: 7->3->4->5->EOS, 6->6.

    EOS gets probability 0.001 wherever it is not the successor, so it is never the runner-up
    (that makes beam_size=1 identical to greedy).
    """
    successor = {0: EOS, 1: 3, 2: EOS, 3: 4, 4: 5, 5: EOS, 6: 6, 7: 3}
    rng = np.random.default_rng(0)
    probs = rng.uniform(0.05, 0.15, size=(V, V))
    for row, nxt in successor.items():
        probs[row, EOS] = 0.001
        probs[row, nxt] = 1.0
        probs[row] /= probs[row].sum()
    return probs


CHAIN = chain_table()
CHAIN_MODEL = bigram_model(log(CHAIN))
# Rows start as if after token 7, 4 and 6: they generate 3 4 5 EOS, 5 EOS, and 6 6 6 ... .
CHAIN_STARTS = np.array([7, 4, 6])
CHAIN_INITIAL = jnp.asarray(log(CHAIN[CHAIN_STARTS]), jnp.float32)


def path_log_prob(probs, start, tokens):
    """Sum of log probs[prev, token] along tokens, starting after `start`."""
    total, prev = 0.0, start
    for token in tokens:
        total += math.log(probs[prev, token])
        prev = token
    return total


# ---------------------------------------------------------------------------------------------
# filter_logits


# Probabilities 0.5, 0.3, 0.15, 0.05 scattered over the vocabulary (row 0) and reversed (row 1).
NUCLEUS_PROBS = np.array([[0.15, 0.5, 0.05, 0.3], [0.3, 0.05, 0.5, 0.15]])


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.3, [[1], [2]]),
        (0.5, [[1], [2]]),  # the top token alone reaches 0.5 exactly
        (0.8, [[1, 3], [2, 0]]),  # 0.5 + 0.3 reaches 0.8 exactly: 2 tokens
        (0.81, [[1, 3, 0], [2, 0, 3]]),
        (0.95, [[1, 3, 0], [2, 0, 3]]),
        (0.951, [[0, 1, 2, 3], [0, 1, 2, 3]]),
        (1.0, [[0, 1, 2, 3], [0, 1, 2, 3]]),
    ],
)
def test_filter_logits_top_p_keeps_smallest_set_reaching_p(top_p, kept):
    logits = jnp.asarray(log(NUCLEUS_PROBS) + 3.0, jnp.float32)  # logits, not log-probs
    out = np.asarray(filter_logits(logits, top_k=0, top_p=top_p))
    for row in range(2):
        expected = np.full(4, -np.inf)
        expected[kept[row]] = np.asarray(logits)[row, kept[row]]
        np.testing.assert_array_equal(out[row], expected)


def test_filter_logits_ties_are_broken_by_token_id():
    flat = jnp.zeros((1, 4))
    kept = lambda x: np.isfinite(np.asarray(x))[0].tolist()
    assert kept(filter_logits(flat, top_k=0, top_p=0.5)) == [True, True, False, False]
    assert kept(filter_logits(flat, top_k=3, top_p=1.0)) == [True, True, True, False]
    assert kept(filter_logits(flat, top_k=0, top_p=0.51)) == [True, True, True, False]
    three_way = jnp.array([[1.0, 2.0, 2.0, 2.0]])
    assert kept(filter_logits(three_way, top_k=2, top_p=1.0)) == [False, True, True, False]


def test_filter_logits_top_p_tolerates_float_rounding():
    # The top two tokens hold 0.8 - 5e-7: within TOP_P_TOLERANCE of 0.8, so they reach it.
    logits = jnp.asarray(log([[0.5, 0.3 - 5e-7, 0.2 + 5e-7]]), jnp.float32)
    kept = np.isfinite(np.asarray(filter_logits(logits, top_p=0.8)))[0].tolist()
    assert kept == [True, True, False]
    kept = np.isfinite(np.asarray(filter_logits(logits, top_p=0.8001)))[0].tolist()
    assert kept == [True, True, True]


def test_filter_logits_top_k_then_top_p_on_renormalised_probs():
    logits = jnp.asarray(log([[0.4, 0.3, 0.2, 0.1]]), jnp.float32)
    kept = lambda x: np.isfinite(np.asarray(x))[0].tolist()
    # Alone, top_p=0.75 needs 0.4 + 0.3 + 0.2; after top_k=3 the probs are 4/9, 3/9, 2/9 and
    # 7/9 >= 0.75 already.
    assert kept(filter_logits(logits, top_k=0, top_p=0.75)) == [True, True, True, False]
    assert kept(filter_logits(logits, top_k=3, top_p=0.75)) == [True, True, False, False]
    assert kept(filter_logits(logits, top_k=1, top_p=0.99)) == [True, False, False, False]
    np.testing.assert_array_equal(filter_logits(logits, top_k=0, top_p=1.0), logits)
    np.testing.assert_array_equal(filter_logits(logits, top_k=9, top_p=1.0), logits)


# ---------------------------------------------------------------------------------------------
# Greedy


def test_greedy_rows_stop_independently_at_eos():
    out = jax.device_get(
        greedy(CHAIN_MODEL, CHAIN_INITIAL, bigram_cache(3), max_new_tokens=6, eos_id=EOS)
    )
    assert isinstance(out, DecodeOutput)
    expected = [[3, 4, 5, EOS, PAD, PAD], [5, EOS, PAD, PAD, PAD, PAD], [6, 6, 6, 6, 6, 6]]
    np.testing.assert_array_equal(out.tokens, expected)
    np.testing.assert_array_equal(out.lengths, [4, 2, 6])
    assert out.tokens.dtype == jnp.int32 and out.lengths.dtype == jnp.int32
    scores = [
        path_log_prob(CHAIN, s, [t for t in row if t != PAD])
        for s, row in zip(CHAIN_STARTS, expected, strict=True)
    ]
    np.testing.assert_allclose(out.scores, scores, rtol=1e-5)


@pytest.mark.parametrize(
    "limits, expected, lengths",
    [
        ([2, 6, 3], [[3, 4, 0, 0, 0, 0], [5, 2, 0, 0, 0, 0], [6, 6, 6, 0, 0, 0]], [2, 2, 3]),
        ([0, 1, 9], [[0, 0, 0, 0, 0, 0], [5, 0, 0, 0, 0, 0], [6, 6, 6, 6, 6, 6]], [0, 1, 6]),
    ],
)
def test_greedy_respects_max_new_per_row(limits, expected, lengths):
    out = jax.device_get(
        greedy(
            CHAIN_MODEL,
            CHAIN_INITIAL,
            bigram_cache(3),
            max_new_tokens=6,
            eos_id=EOS,
            max_new_per_row=jnp.array(limits),
        )
    )
    np.testing.assert_array_equal(out.tokens, expected)
    np.testing.assert_array_equal(out.lengths, lengths)
    scores = [
        path_log_prob(CHAIN, s, row[:n])
        for s, row, n in zip(CHAIN_STARTS, expected, lengths, strict=True)
    ]
    np.testing.assert_allclose(out.scores, scores, rtol=1e-5, atol=1e-6)


def test_greedy_loop_ends_when_every_row_is_done():
    calls = []

    def counted(tokens, cache):
        jax.debug.callback(lambda: calls.append(1))
        return CHAIN_MODEL(tokens, cache)

    out = jax.device_get(
        greedy(counted, CHAIN_INITIAL[:2], bigram_cache(2), max_new_tokens=8, eos_id=EOS)
    )
    jax.effects_barrier()
    np.testing.assert_array_equal(out.lengths, [4, 2])
    # First token from initial_logits, then one call per further token of the longest row.
    assert len(calls) == 3


# ---------------------------------------------------------------------------------------------
# Sampling


def random_logits(seed, shape):
    """Normal logits; pad is never generated, and EOS is the most likely token after token 3."""
    logits = np.random.default_rng(seed).normal(size=shape)
    logits[..., PAD] = -np.inf
    if logits.ndim == 2 and logits.shape[0] == V:
        logits[3, EOS] = logits[3].max() + 0.5
    return logits


RANDOM_TABLE = random_logits(0, (V, V))  # a bigram model
RANDOM_MODEL = bigram_model(RANDOM_TABLE)
RANDOM_INITIAL = jnp.asarray(random_logits(1, (4, V)), jnp.float32)  # greedy lengths 6, 5, 4, 4
SAMPLES, SAMPLE_STEPS = 2000, 3
SAMPLE_INITIAL = jnp.asarray(np.tile(RANDOM_TABLE[BOS], (SAMPLES, 1)), jnp.float32)


def draw(seed, **kwargs):
    """SAMPLES rows from RANDOM_MODEL, all starting after BOS."""
    return jax.device_get(
        sample(
            RANDOM_MODEL,
            SAMPLE_INITIAL,
            bigram_cache(SAMPLES),
            jax.random.key(seed),
            max_new_tokens=SAMPLE_STEPS,
            eos_id=EOS,
            **kwargs,
        )
    )


def numpy_filtered_probs(logits, temperature=1.0, top_k=0, top_p=1.0):
    """Sampling distribution after temperature, top-k and top-p; logits: [vocab]."""
    scaled = np.asarray(logits, np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    probs = np.exp(scaled[order] - scaled.max())
    if top_k:
        probs[top_k:] = 0.0
    probs /= probs.sum()
    probs[np.cumsum(probs) - probs >= top_p] = 0.0
    result = np.zeros_like(probs)
    result[order] = probs / probs.sum()
    return result


def chi_square(tokens, probs_per_row):
    """Pearson statistic of sampled tokens [n] against per-row distributions [n, vocab]."""
    counts = np.bincount(np.asarray(tokens), minlength=probs_per_row.shape[-1])
    expected = probs_per_row.sum(axis=0)
    support = expected > 0
    assert np.all(counts[~support] == 0), f"sampled a token of probability 0: {counts}"
    return float(np.sum((counts[support] - expected[support]) ** 2 / expected[support]))


def check_rows(out, temperature=1.0):
    """Rows stop at EOS with pad after; scores sum temperature-adjusted (unfiltered) log-probs."""
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    position = np.arange(SAMPLE_STEPS)
    generated = position < lengths[:, None]
    assert np.all(tokens[~generated] == PAD) and np.all(tokens[generated] != PAD)
    ended = lengths < SAMPLE_STEPS
    assert ended.any() and not ended.all()
    np.testing.assert_array_equal(tokens[ended, lengths[ended] - 1], EOS)
    assert not np.any((tokens == EOS) & (position < lengths[:, None] - 1))
    previous = np.concatenate([np.full((SAMPLES, 1), BOS), tokens[:, :-1]], axis=1)
    step_log_probs = log_softmax(RANDOM_TABLE / temperature)[previous, tokens]
    expected = np.where(generated, step_log_probs, 0).sum(1)
    np.testing.assert_allclose(out.scores, expected, rtol=1e-5)


def check_frequencies(out, probs_table):
    """Both the first token and (given the first) the second token follow probs_table[prev]."""
    tokens = np.asarray(out.tokens)
    first = tokens[:, 0]
    # <= 7 degrees of freedom: 30 is far in the tail (p ~ 1e-4).
    assert chi_square(first, probs_table[np.full(SAMPLES, BOS)]) < 30.0
    went_on = first != EOS
    assert chi_square(tokens[went_on, 1], probs_table[first[went_on]]) < 30.0


def test_sampled_frequencies_match_the_model():
    check_frequencies(draw(0), np.stack([numpy_filtered_probs(row) for row in RANDOM_TABLE]))


def test_sampled_frequencies_with_temperature_top_k_top_p():
    options = dict(temperature=2.0, top_k=4, top_p=0.8)
    probs = np.stack([numpy_filtered_probs(row, **options) for row in RANDOM_TABLE])
    kept = (probs > 0).sum(axis=1)
    assert kept.max() == 4 and kept.min() < 4  # both filters bite somewhere
    out = draw(0, **options)
    check_frequencies(out, probs)
    check_rows(out, temperature=2.0)


def test_sampling_is_seeded_and_scores_are_path_log_probs():
    first, again, other = draw(0), draw(0), draw(1)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    np.testing.assert_array_equal(first.scores, again.scores)
    assert not np.array_equal(first.tokens, other.tokens)
    check_rows(first)


def test_sampling_top_k_1_equals_greedy():
    kwargs = dict(max_new_tokens=6, eos_id=EOS)
    expected = jax.device_get(greedy(RANDOM_MODEL, RANDOM_INITIAL, bigram_cache(4), **kwargs))
    got = jax.device_get(
        sample(RANDOM_MODEL, RANDOM_INITIAL, bigram_cache(4), jax.random.key(3), top_k=1, **kwargs)
    )
    np.testing.assert_array_equal(got.tokens, expected.tokens)
    np.testing.assert_array_equal(got.lengths, expected.lengths)
    np.testing.assert_allclose(got.scores, expected.scores, rtol=1e-6)
    assert len(set(np.asarray(expected.lengths).tolist())) > 1  # rows stopped at different steps


# ---------------------------------------------------------------------------------------------
# Beam search

A, B, C, D, E = 3, 4, 5, 6, 7


def greedy_trap_table():
    """Greedy takes A (0.6) whose best continuation is 0.35; B (0.4) continues with 0.9."""
    probs = np.zeros((V, V))
    probs[:, EOS] = 1.0  # after C, D, E (and pad/bos/eos): EOS surely
    probs[BOS] = 0.0
    probs[BOS, [A, B]] = [0.6, 0.4]
    probs[A] = 0.0
    probs[A, [C, D, E, EOS]] = [0.35, 0.25, 0.22, 0.18]
    probs[B] = 0.0
    probs[B, [C, D, EOS]] = [0.9, 0.05, 0.05]
    return probs


TRAP = greedy_trap_table()
TRAP_MODEL = bigram_model(log(TRAP))


def test_length_penalty_formula():
    lengths = jnp.array([0, 1, 3, 10])
    np.testing.assert_allclose(
        length_penalty(lengths, 0.6), ((5 + np.array([0, 1, 3, 10])) / 6) ** 0.6, rtol=1e-6
    )
    np.testing.assert_array_equal(length_penalty(lengths, 0.0), np.ones(4))


def test_beam_search_escapes_the_greedy_trap():
    initial = jnp.asarray(log(TRAP[[BOS]]), jnp.float32)
    greedy_out = jax.device_get(
        greedy(TRAP_MODEL, initial, bigram_cache(1), max_new_tokens=5, eos_id=EOS)
    )
    np.testing.assert_array_equal(greedy_out.tokens, [[A, C, EOS, PAD, PAD]])
    np.testing.assert_allclose(greedy_out.scores, [math.log(0.6 * 0.35)], rtol=1e-6)

    out = jax.device_get(
        beam_search(
            TRAP_MODEL,
            initial,
            bigram_cache(1),
            beam_size=2,
            max_new_tokens=5,
            eos_id=EOS,
            alpha=0.6,
        )
    )
    assert isinstance(out, BeamOutput)
    np.testing.assert_array_equal(out.tokens, [[[B, C, EOS, PAD, PAD], [A, C, EOS, PAD, PAD]]])
    np.testing.assert_array_equal(out.lengths, [[3, 3]])
    raw = np.array([math.log(0.4) + math.log(0.9) + math.log(1.0), math.log(0.6 * 0.35)])
    np.testing.assert_allclose(out.log_probs[0], raw, rtol=1e-5)
    np.testing.assert_allclose(out.scores[0], raw / ((5 + 3) / 6) ** 0.6, rtol=1e-5)


def test_beam_size_1_equals_greedy():
    kwargs = dict(max_new_tokens=6, eos_id=EOS)
    expected = jax.device_get(greedy(CHAIN_MODEL, CHAIN_INITIAL, bigram_cache(3), **kwargs))
    out = jax.device_get(
        beam_search(CHAIN_MODEL, CHAIN_INITIAL, bigram_cache(3), beam_size=1, **kwargs)
    )
    np.testing.assert_array_equal(out.tokens[:, 0], expected.tokens)
    np.testing.assert_array_equal(out.lengths[:, 0], expected.lengths)
    np.testing.assert_allclose(out.log_probs[:, 0], expected.scores, rtol=1e-6)
    np.testing.assert_allclose(
        out.scores[:, 0], expected.scores / length_penalty(expected.lengths, 0.6), rtol=1e-6
    )


def test_beam_search_stops_early_using_the_best_possible_penalty():
    # First step: EOS 0.6, A 0.4; after A: A 0.5, EOS 0.5. With one beam, the alive "A" could
    # only beat log(0.6) = -0.511 if its penalty bound were large: log(0.4) / lp(10) = -0.529
    # loses (stop at once), log(0.4) / lp(20) = -0.389 might win (one more step).
    probs = np.zeros((V, V))
    probs[:, EOS] = 1.0
    probs[A] = 0.0
    probs[A, [A, EOS]] = [0.5, 0.5]
    calls = []

    def counted(tokens, cache):
        jax.debug.callback(lambda: calls.append(1))
        return bigram_model(log(probs))(tokens, cache)

    initial = jnp.asarray(log([[0, 0, 0.6, 0.4, 0, 0, 0, 0]] * 2), jnp.float32)
    for limits, expected_calls in [([10, 10], 0), ([20, 20], 1), ([10, 20], 1)]:
        calls.clear()
        out = jax.device_get(
            beam_search(
                counted,
                initial,
                bigram_cache(2),
                beam_size=1,
                max_new_tokens=20,
                eos_id=EOS,
                alpha=0.6,
                max_new_per_row=jnp.array(limits),
            )
        )
        jax.effects_barrier()
        assert len(calls) == expected_calls, limits
        np.testing.assert_array_equal(out.tokens[:, 0, :2], [[EOS, PAD], [EOS, PAD]])
        np.testing.assert_allclose(out.log_probs[:, 0], [math.log(0.6)] * 2, rtol=1e-6)


def history_model(table):
    """Next-token logits depend on the whole history, through the cache only.

    logits = table[previous token, current token] - 0.7 * (times each token was fed so far).
    cache = {"last": [B], "seen": [B, V]}: any mistake in the beam reordering changes scores.
    """
    table = jnp.asarray(table, jnp.float32)
    vocab = table.shape[-1]

    def tokens_to_logits(tokens, cache):
        token = tokens[:, -1]
        seen = cache["seen"] + jax.nn.one_hot(token, vocab)
        logits = table[cache["last"], token] - 0.7 * seen
        return logits[:, None, :], {"last": token, "seen": seen}

    return tokens_to_logits


def reference_beam_search(next_log_probs, beam, limit, eos, alpha):
    """tensor2tensor beam search for one row in plain Python, without early stopping.

    next_log_probs(prefix tuple) -> [vocab] log-probs. Returns [(score, log_prob, seq)] and
    whether two alive beams ever shared a parent after the first step (the cache was reordered).
    """
    penalty = lambda n: ((5 + n) / 6) ** alpha
    alive, finished, branched = [((), 0.0)], [], False
    for step in range(limit):
        candidates = [
            (lp + float(x), seq + (t,))
            for seq, lp in alive
            for t, x in enumerate(next_log_probs(seq))
            if np.isfinite(x)
        ]
        candidates = sorted(candidates, key=lambda c: -c[0])[: 2 * beam]
        finished += [(lp / penalty(step + 1), lp, seq) for lp, seq in candidates if seq[-1] == eos]
        finished = sorted(finished, key=lambda f: -f[0])[:beam]
        alive = [(seq, lp) for lp, seq in candidates if seq[-1] != eos][:beam]
        branched |= step > 0 and len({seq[:-1] for seq, _ in alive}) < len(alive)
    if finished:
        return finished, branched
    return [(lp / penalty(limit), lp, seq) for seq, lp in alive], branched


@pytest.mark.parametrize("alpha, eos_possible, blocks", [
    (0.6, True, False), (1.5, False, False), (0.6, True, True),
])
def test_beam_search_matches_reference(alpha, eos_possible, blocks, monkeypatch):
    if blocks:  # candidates through block maxima (beam._top_k), as with a real vocabulary
        monkeypatch.setattr(beam_module, "TOP_K_BLOCK", 2)
        monkeypatch.setattr(beam_module, "TOP_K_BLOCKS_FROM", 1)
    vocab, batch, beam, max_new = 6, 3, 3, 6
    rng = np.random.default_rng(int(alpha * 10))
    # Flat logits, so beams often have several children and the cache really gets reordered.
    table = rng.normal(size=(vocab, vocab, vocab)) * 0.8
    initial = rng.normal(size=(batch, vocab))
    table[..., PAD] = initial[:, PAD] = -np.inf  # also checks that -inf logits are handled
    table[..., EOS] -= 1.0  # longer hypotheses
    if not eos_possible:
        table[..., EOS] = initial[:, EOS] = -np.inf
    first_last = np.array([BOS, 3, 4])
    limits = np.array([6, 3, 5])
    cache = {"last": jnp.asarray(first_last, jnp.int32), "seen": jnp.zeros((batch, vocab))}

    out = jax.device_get(
        beam_search(
            history_model(table),
            jnp.asarray(initial, jnp.float32),
            cache,
            beam_size=beam,
            max_new_tokens=max_new,
            eos_id=EOS,
            alpha=alpha,
            max_new_per_row=jnp.asarray(limits),
        )
    )

    any_branched = False
    for row in range(batch):

        def next_log_probs(prefix, row=row):
            if not prefix:
                return log_softmax(initial[row])
            previous = prefix[-2] if len(prefix) > 1 else first_last[row]
            seen = np.bincount(prefix, minlength=vocab)
            return log_softmax(table[previous, prefix[-1]] - 0.7 * seen)

        expected, branched = reference_beam_search(next_log_probs, beam, limits[row], EOS, alpha)
        any_branched |= branched
        for slot, (score, log_prob, seq) in enumerate(expected):
            tokens = np.asarray(out.tokens[row, slot])
            np.testing.assert_array_equal(tokens[: len(seq)], seq)
            assert np.all(tokens[len(seq) :] == PAD)
            assert out.lengths[row, slot] == len(seq)
            np.testing.assert_allclose(out.log_probs[row, slot], log_prob, rtol=1e-4)
            np.testing.assert_allclose(out.scores[row, slot], score, rtol=1e-4)
        for slot in range(len(expected), beam):  # empty slots
            assert out.scores[row, slot] == -np.inf and out.lengths[row, slot] == 0
            assert np.all(np.asarray(out.tokens[row, slot]) == PAD)
        assert np.all(out.scores[row, :-1] >= out.scores[row, 1:])  # best first
    assert any_branched
    if eos_possible:  # finished hypotheses of different lengths compete
        assert len(set(np.asarray(out.lengths).ravel().tolist()) - {0}) > 1


@pytest.mark.parametrize("n, k", [(4 * 3001, 8), (8192, 6), (9000, 70)])
def test_top_k_through_block_maxima_equals_lax_top_k_ties_and_minus_inf_included(n, k):
    """Beam search's candidate selection: same values and indices as lax.top_k, ties to the
    lower index, on rows of few distinct values (many ties), rows mostly -inf (beams not yet
    alive), and lengths that are not a multiple of the block."""
    rng = np.random.default_rng(n + k)
    scores = np.round(rng.normal(size=(5, n)) * 2).astype(np.float32)  # ~20 distinct values
    scores[1, : n - 20] = -np.inf
    scores[2] = 0.0
    scores[3, rng.integers(0, n, 50)] = 9.0  # the top k all tie
    top = jax.jit(beam_module._top_k, static_argnums=1)(jnp.asarray(scores), k)
    values, indices = jax.lax.top_k(jnp.asarray(scores), k)
    np.testing.assert_array_equal(top[0], values)
    np.testing.assert_array_equal(top[1], indices)


# ---------------------------------------------------------------------------------------------
# jit: one while_loop, compiled once


@pytest.mark.parametrize("algorithm", ["greedy", "sample", "beam_search"])
def test_traced_once_under_jit(algorithm):
    traces = []

    def model(tokens, cache):
        traces.append(1)  # runs at trace time only
        return RANDOM_MODEL(tokens, cache)

    kwargs = dict(max_new_tokens=6, eos_id=EOS)

    def decode(initial, cache, rng):
        if algorithm == "greedy":
            return greedy(model, initial, cache, **kwargs)
        if algorithm == "sample":  # a tiny temperature: greedy up to ties
            return sample(model, initial, cache, rng, temperature=1e-4, top_p=0.9, **kwargs)
        return beam_search(model, initial, cache, beam_size=2, **kwargs)

    decode_jit = jax.jit(decode)
    inputs = [RANDOM_INITIAL, RANDOM_INITIAL[::-1]]
    outs = [jax.device_get(decode_jit(x, bigram_cache(4), jax.random.key(i)))
            for i, x in enumerate(inputs)]
    assert len(traces) == 1  # one trace for two inputs, and one model call in the loop body
    assert not np.array_equal(outs[0].tokens, outs[1].tokens)
    jaxpr = str(jax.make_jaxpr(decode)(inputs[0], bigram_cache(4), jax.random.key(0)))
    assert jaxpr.count("while[") == 1
    if algorithm != "beam_search":
        for initial, out in zip(inputs, outs, strict=True):
            expected = jax.device_get(greedy(RANDOM_MODEL, initial, bigram_cache(4), **kwargs))
            np.testing.assert_array_equal(out.tokens, expected.tokens)
            np.testing.assert_array_equal(out.lengths, expected.lengths)


# ---------------------------------------------------------------------------------------------
# Growing the cache: segments of the loop


@pytest.mark.parametrize(
    "max_new, segments, ends",
    [
        (256, 4, (64, 128, 192, 256)),
        (1024, 4, (256, 512, 768, 1024)),
        (200, 4, (64, 128, 200)),  # 200 / 4 rounds up to 64; 192..200 is merged
        (100, 4, (100,)),  # a second segment would be shorter than 64 steps
        (64, 4, (64,)),
        (192, 1, (192,)),
        (1000, 3, (384, 768, 1000)),
    ],
)
def test_segment_ends(max_new, segments, ends):
    assert segment_ends(max_new, segments) == ends


def slot_history_model(table):
    """logits = table[sum of every token fed so far % V]: the whole history is read from the
    cache {"tokens": [B, slots], "length": [B]}, and a step with no free slot returns NaN."""
    table = jnp.asarray(table, jnp.float32)

    def tokens_to_logits(tokens, cache):
        slots, length = cache["tokens"].shape[1], cache["length"]
        write = lambda row, token, at: jax.lax.dynamic_update_slice(row, token[None], (at,))
        written = jax.vmap(write)(cache["tokens"], tokens[:, -1], length)
        history = jnp.sum(jnp.where(jnp.arange(slots) <= length[:, None], written, 0), axis=1)
        logits = jnp.where((length < slots)[:, None], table[history % V], jnp.nan)
        return logits[:, None], {"tokens": written, "length": length + 1}

    return tokens_to_logits


def grow_history(cache, extra_slots):
    return {**cache, "tokens": jnp.pad(cache["tokens"], ((0, 0), (0, extra_slots)))}


def history_cache(batch, slots):
    return {"tokens": jnp.zeros((batch, slots), jnp.int32),
            "length": jnp.zeros((batch,), jnp.int32)}


HISTORY_TABLE = random_logits(3, (V, V))
HISTORY_TABLE[:, EOS] = -5.0  # rare: rows run long enough to cross segments
HISTORY_MODEL = slot_history_model(HISTORY_TABLE)


@pytest.mark.parametrize("algorithm", ["greedy", "sample", "beam_search"])
def test_growing_the_cache_in_segments_equals_one_full_cache(algorithm):
    """Three loops growing an empty cache by 64 slots each give the tokens and scores of one
    loop over a full-size cache; a cache one segment too small would give NaN logits."""
    max_new = 192

    def decode(cache, **grow):
        kwargs = dict(max_new_tokens=max_new, eos_id=EOS, **grow)
        if algorithm == "greedy":
            return greedy(HISTORY_MODEL, RANDOM_INITIAL, cache, **kwargs)
        if algorithm == "sample":
            return sample(HISTORY_MODEL, RANDOM_INITIAL, cache, KEY, top_k=3, **kwargs)
        return beam_search(HISTORY_MODEL, RANDOM_INITIAL, cache, beam_size=2, **kwargs)

    grown = dict(grow_cache=grow_history, cache_segments=3)
    jaxpr = str(jax.make_jaxpr(lambda cache: decode(cache, **grown))(history_cache(4, 0)))
    assert jaxpr.count("while[") == 3
    full = jax.device_get(decode(history_cache(4, max_new)))
    segmented = jax.device_get(decode(history_cache(4, 0), **grown))
    assert np.asarray(full.lengths).max() > 128  # some row reaches the third segment
    assert np.isfinite(np.asarray(full.scores)[np.asarray(full.lengths) > 0]).all()
    np.testing.assert_array_equal(segmented.tokens, full.tokens)
    np.testing.assert_array_equal(segmented.lengths, full.lengths)
    np.testing.assert_allclose(segmented.scores, full.scores, rtol=1e-6)
    one_short = lambda cache, extra_slots: grow_history(cache, extra_slots - 1)
    short = jax.device_get(decode(history_cache(4, 0), grow_cache=one_short, cache_segments=3))
    assert not np.array_equal(short.tokens, full.tokens)  # a cache without room is caught


def test_beam_search_with_sources_split_over_devices_gathers_only_each_devices_own_rows():
    """Eight sources split over eight devices: a beam's parent lies among its own source's beams,
    so the compiled search reorders each device's own cache rows. A gather by global row index
    made XLA all-gather the whole cache at every step (every layer's keys and values of a
    sharded translation). The result is the one-device result."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    initial = jnp.asarray(random_logits(5, (8, V)), jnp.float32)
    cache = history_cache(8, 24)

    def search(initial, cache):
        return beam_search(HISTORY_MODEL, initial, cache, beam_size=3, max_new_tokens=20,
                           eos_id=EOS)

    placed = jax.device_put((initial, cache), rows)
    compiled = jax.jit(search).lower(*placed).compile()
    # the leading size of every all-gathered array (XLA CPU gathers the [8, ...] scores for top_k)
    gathered = re.findall(r"= \w+\[(\d+)[,\]][^=]* all-gather\(", compiled.as_text())
    assert gathered and str(8 * 3) not in gathered  # no [batch * beam, ...] cache rows
    sharded, single = jax.device_get(compiled(*placed)), jax.device_get(search(initial, cache))
    assert len({tuple(row) for row in np.asarray(single.tokens)[:, 0]}) > 1
    for field in ("tokens", "lengths", "scores", "log_probs"):
        np.testing.assert_array_equal(getattr(sharded, field), getattr(single, field))


# ---------------------------------------------------------------------------------------------
# Errors


INITIAL = jnp.zeros((2, V))
CACHE = bigram_cache(2)
KEY = jax.random.key(0)


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda: beam_search(
                CHAIN_MODEL, INITIAL, CACHE, beam_size=0, max_new_tokens=3, eos_id=EOS
            ),
            "beam_size",
        ),
        (
            lambda: greedy(CHAIN_MODEL, INITIAL, CACHE, max_new_tokens=0, eos_id=EOS),
            "max_new_tokens",
        ),
        (
            lambda: beam_search(
                CHAIN_MODEL, INITIAL, CACHE, beam_size=2, max_new_tokens=0, eos_id=EOS
            ),
            "max_new_tokens",
        ),
        (
            lambda: sample(
                CHAIN_MODEL, INITIAL, CACHE, KEY, max_new_tokens=3, eos_id=EOS, temperature=0.0
            ),
            "temperature",
        ),
        (
            lambda: sample(
                CHAIN_MODEL, INITIAL, CACHE, KEY, max_new_tokens=3, eos_id=EOS, temperature=-1.0
            ),
            "temperature",
        ),
        (
            lambda: sample(
                CHAIN_MODEL, INITIAL, CACHE, KEY, max_new_tokens=3, eos_id=EOS, top_p=0.0
            ),
            "top_p",
        ),
        (
            lambda: sample(
                CHAIN_MODEL, INITIAL, CACHE, KEY, max_new_tokens=3, eos_id=EOS, top_p=1.5
            ),
            "top_p",
        ),
        (
            lambda: sample(
                CHAIN_MODEL, INITIAL, CACHE, KEY, max_new_tokens=3, eos_id=EOS, top_k=-1
            ),
            "top_k",
        ),
        (lambda: filter_logits(INITIAL, top_k=0, top_p=1.2), "top_p"),
        (lambda: filter_logits(INITIAL[0], top_k=2, top_p=1.0), "logits"),
        (
            lambda: greedy(CHAIN_MODEL, INITIAL[0], CACHE, max_new_tokens=3, eos_id=EOS),
            "initial_logits",
        ),
        (
            lambda: beam_search(
                CHAIN_MODEL, INITIAL[:, None], CACHE, beam_size=2, max_new_tokens=3, eos_id=EOS
            ),
            "initial_logits",
        ),
        (lambda: greedy(CHAIN_MODEL, INITIAL, CACHE, max_new_tokens=3, eos_id=V), "eos_id"),
        (
            lambda: greedy(
                CHAIN_MODEL,
                INITIAL,
                CACHE,
                max_new_tokens=3,
                eos_id=EOS,
                max_new_per_row=jnp.array([1, 2, 3]),
            ),
            "max_new_per_row",
        ),
        (
            lambda: beam_search(
                CHAIN_MODEL,
                INITIAL,
                CACHE,
                beam_size=2,
                max_new_tokens=3,
                eos_id=EOS,
                alpha=float("nan"),
            ),
            "alpha",
        ),
    ],
)
def test_bad_arguments_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_bad_hyperparameters_are_config_errors():
    with pytest.raises(ConfigError, match=r"beam_size=0 must be an integer >= 1"):
        beam_search(CHAIN_MODEL, INITIAL, CACHE, beam_size=0, max_new_tokens=3, eos_id=EOS)
    with pytest.raises(ConfigError, match=r"cache_segments=0 must be an integer >= 1"):
        greedy(CHAIN_MODEL, INITIAL, CACHE, max_new_tokens=3, eos_id=EOS,
               grow_cache=grow_history, cache_segments=0)


def test_segments_without_grow_cache_are_rejected():
    with pytest.raises(ValueError, match=r"cache_segments=2 needs grow_cache"):
        greedy(CHAIN_MODEL, INITIAL, CACHE, max_new_tokens=3, eos_id=EOS, cache_segments=2)


# ---------------------------------------------------------------------------------------------
# eos_id=None: no token stops a row


# The chain model with token 7 impossible (log-probability -inf after every token).
NEVER = 7
NO_SEVEN = np.where(np.arange(V) == NEVER, -np.inf, log(CHAIN))
NO_SEVEN_MODEL = bigram_model(NO_SEVEN)
NO_SEVEN_INITIAL = jnp.asarray(NO_SEVEN[CHAIN_STARTS], jnp.float32)


@pytest.mark.parametrize("algorithm", ["greedy", "sample", "beam_search"])
def test_eos_id_none_equals_an_eos_id_that_never_occurs(algorithm):
    """With eos_id=None every row runs max_new_tokens tokens (EOS is an ordinary token: the
    chain's rows go on after it), and tokens, lengths and scores equal those of decoding with
    an eos id the model never emits."""

    def run(eos_id):
        args = (NO_SEVEN_MODEL, NO_SEVEN_INITIAL, bigram_cache(3))
        kwargs = dict(max_new_tokens=6, eos_id=eos_id)
        if algorithm == "greedy":
            return jax.device_get(greedy(*args, **kwargs))
        if algorithm == "sample":
            return jax.device_get(sample(*args, jax.random.key(5), **kwargs))
        return jax.device_get(beam_search(*args, beam_size=2, **kwargs))

    free = run(None)
    assert (np.asarray(free.lengths) == 6).all()
    assert NEVER not in np.asarray(free.tokens)
    if algorithm == "greedy":
        np.testing.assert_array_equal(
            free.tokens, [[3, 4, 5, EOS, EOS, EOS], [5, EOS, EOS, EOS, EOS, EOS], [6] * 6])
    stopped = run(NEVER)
    for name in ("tokens", "lengths", "scores"):
        np.testing.assert_array_equal(getattr(free, name), getattr(stopped, name), err_msg=name)


def test_eos_id_is_a_token_or_none():
    with pytest.raises(ConfigError, match=r"eos_id=-1 must be an integer >= 0 \(or None"):
        greedy(CHAIN_MODEL, INITIAL, CACHE, max_new_tokens=3, eos_id=-1)


def test_a_cache_of_another_batch_is_one_clear_error():
    """A cache built for 3 rows decoding 2: one error naming the leaf, both batch sizes and
    what to build, for every algorithm (not an error from inside the model's vmap)."""
    calls = (
        lambda cache: greedy(CHAIN_MODEL, INITIAL, cache, max_new_tokens=3, eos_id=EOS),
        lambda cache: sample(CHAIN_MODEL, INITIAL, cache, KEY, max_new_tokens=3, eos_id=EOS),
        lambda cache: beam_search(CHAIN_MODEL, INITIAL, cache, beam_size=2, max_new_tokens=3,
                                  eos_id=EOS),
    )
    for call in calls:
        with pytest.raises(ValueError, match=(
                r"^cache\['last'\] has shape \(3,\), but every cache leaf needs the batch of "
                r"initial_logits, 2, on axis 0: build the cache for 2 rows")):
            call(bigram_cache(3))
        call(bigram_cache(2))  # the right batch decodes
