"""Generation at model level (tfm/decode/generate.py): the cached decoders against naive
recomputation.

Models are tiny and randomly initialised with numpy (no compiled init), with an untied output
projection larger than the default init so greedy paths change with context (tied random
embeddings mostly repeat the input token), and a zero output column for pad: pad always scores 0
and is never the argmax. (A generated pad would be masked as a key by the full forward pass but
not by the cache.)
Token ids: pad 0, bos 1, eos 2.
"""

import functools

import jax
import numpy as np
import pytest
from decode_cases import (  # noqa: F401
    BOS,
    EOS,
    EXTRA_LEN,
    MAX_NEW,
    PAD,
    PROMPT_LENGTHS,
    PROMPTS,
    SEED,
    SOURCE,
    TINY,
    config_for,
    random_params,
)

from tfm.checks import ConfigError
from tfm.data.tokenizers import ByteTokenizer, content_ids
from tfm.decode import generate, search
from tfm.decode.generate import generate_text, lm_generate, translate
from tfm.kernels import cpu_compile
from tfm.nn.cache import grow, init_cache, reorder_beams
from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM, EncoderDecoder


@functools.cache
def lm_setup(scheme: str) -> tuple[ModelConfig, dict]:
    config = config_for(scheme, num_encoder_layers=0)
    return config, random_params(DecoderLM(config), PROMPTS)


@functools.cache
def seq2seq_setup(scheme: str) -> tuple[ModelConfig, dict]:
    config = config_for(scheme)
    return config, random_params(EncoderDecoder(config), SOURCE, SOURCE)


@functools.cache
def full_forward(config: ModelConfig, seq2seq: bool):
    """The model without a cache, jitted once per config: logits [batch, len, vocab]."""
    if seq2seq:
        model = EncoderDecoder(config)
        # The test sources are right-padded with PAD and hold no PAD inside: that is how
        # their validity is known here (the model never infers it from token values).
        return jax.jit(
            lambda p, source, inputs: model.apply(
                {"params": p}, source, inputs, source_valid=source != PAD
            )
        )
    model = DecoderLM(config)
    return jax.jit(lambda p, tokens: model.apply({"params": p}, tokens))


def naive_greedy(forward, prefix, prefix_lengths, limits, eos_id):
    """Greedy by full recomputation: every step reruns the model on each row's whole sequence
    and takes the argmax at its last position. Sequences live in a fixed right-padded buffer
    (one compilation); positions past a row's end cannot influence it (causal mask).

    forward: tokens [batch, len] -> logits; prefix: [batch, width]; limits: [batch] budgets.
    Returns per row the generated tokens and the top-2 tokens of every step.
    """
    batch = len(prefix)
    buffer = np.zeros((batch, prefix.shape[1] + max(limits)), np.int32)
    buffer[:, : prefix.shape[1]] = prefix
    ends = np.array(prefix_lengths)
    outputs = [[] for _ in range(batch)]
    top2 = [[] for _ in range(batch)]
    done = [limit <= 0 for limit in limits]
    while not all(done):
        logits = np.asarray(forward(buffer))
        for row in range(batch):
            if done[row]:
                continue
            row_logits = logits[row, ends[row] - 1]
            token = int(np.argmax(row_logits))
            top2[row].append(set(np.argsort(-row_logits, kind="stable")[:2].tolist()))
            outputs[row].append(token)
            buffer[row, ends[row]] = token
            ends[row] += 1
            done[row] = token == eos_id or len(outputs[row]) >= limits[row]
    return outputs, top2


def naive_lm_greedy(config, params, eos_id=EOS, max_new=MAX_NEW):
    forward = full_forward(config, False)
    return naive_greedy(
        lambda tokens: forward(params, tokens),
        PROMPTS,
        PROMPT_LENGTHS,
        [max_new] * len(PROMPTS),
        eos_id,
    )


def assert_rows(output, expected: list[list[int]]) -> None:
    """A DecodeOutput's tokens/lengths hold exactly `expected` per row, pad after."""
    tokens, lengths = np.asarray(output.tokens), np.asarray(output.lengths)
    for row, want in enumerate(expected):
        assert PAD not in want, "the test model emitted pad; its comparison would be unfair"
        assert lengths[row] == len(want), (row, lengths[row], want)
        np.testing.assert_array_equal(tokens[row, : len(want)], want, err_msg=f"row {row}")
        assert np.all(tokens[row, len(want) :] == PAD), tokens[row]


# ---------------------------------------------------------------------------------------------
# Greedy with the cache equals greedy by recomputation


@pytest.mark.parametrize("scheme", ["rope", "alibi", "learned", "t5_bias", "relative"])
def test_lm_greedy_with_cache_equals_recomputation(scheme):
    config, params = lm_setup(scheme)
    output = lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=MAX_NEW)
    expected, _ = naive_lm_greedy(config, params)
    assert len({tuple(row) for row in expected}) > 1, "rows should differ to make this a test"
    assert_rows(output, expected)


@pytest.mark.parametrize("avx512,library,fusion", [(False, "onednn", "__onednn_fusion"),
                                                    (True, "ynnpack_dots", "__ynn_fusion")])
def test_decoding_eight_rows_or_more_uses_library_dots_and_equals_recomputation(
    monkeypatch, avx512, library, fusion
):
    """Loops over >= cpu_compile.ONEDNN_MIN_ROWS rows (batch x beams) compile their dots to oneDNN
    (CPUs without AVX-512) or YNNPACK (with it); greedy over 8 rows still equals recomputation,
    and loops over fewer rows keep tfm's own kernels."""
    monkeypatch.setattr(cpu_compile, "_has_avx512", lambda: avx512)
    assert [cpu_compile.decode_kernels(rows) for rows in (1, 7, 8, 32)] == [
        "xla", "xla", library, library]
    if cpu_compile.kernel_options(library) in (None, cpu_compile.compiler_options()):
        pytest.skip(f"not an x86-64 CPU, or this jaxlib lacks the {library} options")
    config, params = lm_setup("rope")
    prompts = np.concatenate([PROMPTS, PROMPTS])  # 8 rows
    lengths = np.concatenate([PROMPT_LENGTHS, PROMPT_LENGTHS])
    output = lm_generate(params, config, prompts, lengths, max_new_tokens=MAX_NEW)
    expected, _ = naive_lm_greedy(config, params)
    assert_rows(output, expected + expected)

    def program(rows: int, decode: search.DecodeConfig) -> str:
        return generate._lm_generate_jit.lower(
            params, prompts[:rows], lengths[:rows], jax.random.PRNGKey(0), config, decode, EOS
        ).compile().as_text()

    greedy = search.DecodeConfig("greedy", max_new_tokens=MAX_NEW)
    assert fusion in program(8, greedy)
    assert fusion not in program(4, greedy)
    beam = search.DecodeConfig("beam", beam_size=4, max_new_tokens=MAX_NEW)
    assert fusion in program(2, beam)  # 2 prompts x 4 beams


@pytest.mark.parametrize("scheme", ["sinusoidal", "t5_bias"])
def test_translate_greedy_with_cache_equals_recomputation(scheme):
    config, params = seq2seq_setup(scheme)
    source_lengths = (SOURCE != PAD).sum(axis=1)
    output = translate(
        params, config, SOURCE, source_lengths, method="greedy", extra_len=EXTRA_LEN
    )
    forward = full_forward(config, True)
    expected, _ = naive_greedy(
        lambda inputs: forward(params, SOURCE, inputs),
        np.full((len(SOURCE), 1), BOS, np.int32),
        np.ones(len(SOURCE), np.int32),
        list(source_lengths + EXTRA_LEN),
        EOS,
    )
    assert len({tuple(row) for row in expected}) > 1
    assert_rows(output, expected)


def test_lm_greedy_over_a_growing_cache_equals_recomputation():
    """192 new tokens in 3 loop segments (the cache grown by 64 slots before each) against full
    recomputation; and against one loop over a full-size cache."""
    config, params = lm_setup("rope")
    output = lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=192,
                         cache_segments=3)
    expected, _ = naive_lm_greedy(config, params, max_new=192)
    assert max(len(row) for row in expected) > 128, "no row reaches the third segment"
    assert_rows(output, expected)
    one_loop = lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=192,
                           cache_segments=1)
    np.testing.assert_allclose(output.scores, one_loop.scores, rtol=1e-5)


def test_translate_beam_over_a_growing_cache_equals_one_loop():
    config, params = seq2seq_setup("t5_bias")
    source_lengths = (SOURCE != PAD).sum(axis=1)
    outputs = [
        translate(params, config, SOURCE, source_lengths, method="beam", beam_size=2,
                  extra_len=190, cache_segments=segments)
        for segments in (1, 3)
    ]
    assert np.asarray(outputs[0].lengths).max() > 128, "no hypothesis reaches the third segment"
    np.testing.assert_array_equal(outputs[1].tokens, outputs[0].tokens)
    np.testing.assert_array_equal(outputs[1].lengths, outputs[0].lengths)
    np.testing.assert_allclose(outputs[1].scores, outputs[0].scores, rtol=1e-5)


def test_beam_search_reordering_only_self_attention_equals_gathering_every_leaf():
    """translate's beam search leaves the cross-attention cache in place (every beam of a source
    holds the same entries); it must decode exactly like the generic gather of every leaf."""
    config, params = seq2seq_setup("t5_bias")
    model = EncoderDecoder(config)
    source_valid = SOURCE != PAD
    encoded = model.apply({"params": params}, SOURCE, source_valid=source_valid,
                          method=EncoderDecoder.encode)
    bos = np.full((len(SOURCE), 1), BOS, np.int32)
    logits, cache = model.apply(
        {"params": params}, bos, encoded=encoded, source_valid=source_valid,
        cache=init_cache(config, len(SOURCE), 1, source_len=SOURCE.shape[1]),
        method=EncoderDecoder.decode,
    )

    def tokens_to_logits(tokens, cache):
        return model.apply({"params": params}, tokens, encoded=None, cache=cache,
                           method=EncoderDecoder.decode)

    outputs = [
        search.beam_search(tokens_to_logits, logits[:, 0], cache, beam_size=3,
                             max_new_tokens=9, eos_id=EOS, grow_cache=grow, cache_segments=1,
                             reorder_cache=reorder)
        for reorder in (None, reorder_beams)
    ]
    assert len({tuple(row) for row in np.asarray(outputs[0].tokens)[:, 0]}) > 1
    for field in ("tokens", "lengths", "scores", "log_probs"):
        np.testing.assert_array_equal(getattr(outputs[1], field), getattr(outputs[0], field))


# ---------------------------------------------------------------------------------------------
# Beam 1, top-k 1 and seeds


@functools.cache
def eos_never_runner_up() -> int:
    """An ordinary token that is never among the top 2 on the greedy paths of lm_setup("rope"),
    so beam_size=1 must follow greedy exactly (see tfm.decode.search.beam_search)."""
    config, params = lm_setup("rope")
    _, top2 = naive_lm_greedy(config, params, eos_id=-1)
    seen = set().union(*(step for row in top2 for step in row))
    unused = [t for t in range(3, config.vocab_size) if t not in seen]
    assert unused, "every token was a runner-up somewhere; the test needs one that was not"
    return unused[0]


def test_beam_size_1_equals_greedy():
    config, params = lm_setup("rope")
    eos_id = eos_never_runner_up()
    kwargs = dict(max_new_tokens=MAX_NEW, eos_id=eos_id)
    greedy = lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, method="greedy", **kwargs)
    beam = lm_generate(
        params, config, PROMPTS, PROMPT_LENGTHS, method="beam", beam_size=1, **kwargs
    )
    expected, _ = naive_lm_greedy(config, params, eos_id=eos_id)
    assert_rows(greedy, expected)
    np.testing.assert_array_equal(beam.tokens[:, 0], greedy.tokens)
    np.testing.assert_array_equal(beam.lengths[:, 0], greedy.lengths)
    np.testing.assert_allclose(beam.log_probs[:, 0], greedy.scores, rtol=1e-5)


def test_top_k_1_sampling_equals_greedy_and_seeds_repeat():
    config, params = lm_setup("rope")
    eos_id = eos_never_runner_up()
    kwargs = dict(max_new_tokens=MAX_NEW, eos_id=eos_id)
    greedy = lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, method="greedy", **kwargs)
    top1 = lm_generate(
        params, config, PROMPTS, PROMPT_LENGTHS, method="sample", top_k=1,
        rng=jax.random.PRNGKey(3), **kwargs,
    )
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)
    np.testing.assert_allclose(top1.scores, greedy.scores, rtol=1e-5)

    def draw(seed):
        return lm_generate(
            params, config, PROMPTS, PROMPT_LENGTHS, method="sample", temperature=2.0,
            rng=jax.random.PRNGKey(seed), **kwargs,
        ).tokens

    first, again, other = draw(0), draw(0), draw(1)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other), "another seed should give other samples"


# ---------------------------------------------------------------------------------------------
# Stopping and lengths


def test_rows_stop_independently_at_eos():
    config, params = lm_setup("rope")
    # Greedy does not depend on eos_id until it stops, so a run whose EOS never appears shows
    # each row's full path; making one of its tokens EOS must cut every row at its own first
    # occurrence and leave the tokens before it unchanged.
    long_eos = eos_never_runner_up()
    full = lm_generate(
        params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=MAX_NEW, eos_id=long_eos
    )
    paths = np.asarray(full.tokens)
    np.testing.assert_array_equal(full.lengths, MAX_NEW)
    eos_id = int(paths[0, 1])
    stopped = lm_generate(
        params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=MAX_NEW, eos_id=eos_id
    )
    expected = []
    for path in paths.tolist():
        cut = path.index(eos_id) + 1 if eos_id in path else MAX_NEW
        expected.append(path[:cut])
    assert len({len(row) for row in expected}) > 1, "rows should stop at different steps"
    assert_rows(stopped, expected)


def test_translate_output_is_at_most_source_length_plus_extra_len():
    config, params = seq2seq_setup("sinusoidal")
    source_lengths = (SOURCE != PAD).sum(axis=1)
    extra_len = EXTRA_LEN  # as in the test above, so greedy reuses its compilation
    for method in ("greedy", "beam"):
        output = translate(
            params, config, SOURCE, source_lengths, method=method, extra_len=extra_len
        )
        tokens, lengths = np.asarray(output.tokens), np.asarray(output.lengths)
        if method == "beam":
            tokens, lengths = tokens[:, 0], lengths[:, 0]
        assert tokens.shape[1] == SOURCE.shape[1] + extra_len
        for row, length in enumerate(lengths):
            content = tokens[row, :length].tolist()
            assert np.all(tokens[row, length:] == PAD)
            if EOS in content:  # stopped early: EOS is its last token
                assert content.index(EOS) == length - 1
            else:  # ran to its budget
                assert length == source_lengths[row] + extra_len, (method, row, length)
            assert length <= source_lengths[row] + extra_len


# ---------------------------------------------------------------------------------------------
# Bad input


def test_prompt_longer_than_cache_is_rejected():
    config, params = lm_setup("rope")
    cache = init_cache(config, batch_size=len(PROMPTS), max_len=4)
    with pytest.raises(ValueError, match=r"longer than the cache \(max_len=4\)"):
        DecoderLM(config).apply({"params": params}, PROMPTS, cache=cache)


def test_cache_from_another_config_is_rejected():
    config, params = lm_setup("rope")
    cache = init_cache(config.replace(num_decoder_layers=3), len(PROMPTS), max_len=8)
    with pytest.raises(ValueError, match="cache was built for another model config"):
        DecoderLM(config).apply({"params": params}, PROMPTS, cache=cache)
    config, params = seq2seq_setup("sinusoidal")
    no_cross = init_cache(config, batch_size=len(PROMPTS), max_len=8)
    with pytest.raises(ValueError, match="cross-attention slots"):
        EncoderDecoder(config).apply(
            {"params": params}, PROMPTS, encoded=None, cache=no_cross,
            method=EncoderDecoder.decode,
        )


def test_learned_positions_past_max_len_are_rejected():
    config, params = lm_setup("learned")
    too_many = config.max_len - PROMPTS.shape[1] + 1
    with pytest.raises(ValueError, match=f"past max_len={config.max_len}"):
        lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=too_many)
    with pytest.raises(ValueError, match=f"past max_len={config.max_len}"):
        # Rejected from the config and sizes alone, before the (LM) params are used.
        translate(params, config, SOURCE, extra_len=config.max_len)


def test_bad_requests_are_rejected():
    config, params = lm_setup("rope")
    with pytest.raises(ValueError, match="beam_size=0 must be an integer >= 1"):
        lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=2, method="beam",
                    beam_size=0)
    with pytest.raises(ValueError, match="beam_size=0 must be an integer >= 1"):
        translate(params, config, SOURCE, beam_size=0)
    with pytest.raises(ValueError, match="method='topk' is unknown"):
        lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=2, method="topk")
    with pytest.raises(ValueError, match="prompt_lengths must be in"):
        lm_generate(params, config, PROMPTS, np.array([3, 6, 2, 1]), max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompt_lengths \[batch\]; got \(4, 5\) and \(3,\)"):
        lm_generate(params, config, PROMPTS, np.array([3, 5, 2]), max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens=0 must be an integer >= 1"):
        lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=0)


# ---------------------------------------------------------------------------------------------
# Text in, text out


@pytest.mark.parametrize("kind", ["lm", "seq2seq"])
def test_generate_text_with_byte_tokenizer(kind):
    tokenizer = ByteTokenizer()
    config = config_for("rope", vocab_size=tokenizer.vocab_size, max_len=64)
    texts = ["héllo", "a"]
    if kind == "lm":
        config = config.replace(num_encoder_layers=0)
        params = random_params(DecoderLM(config), PROMPTS)
        options = dict(max_new_tokens=4)
    else:
        params = random_params(EncoderDecoder(config), SOURCE, SOURCE)
        options = dict(extra_len=2)
    first = generate_text(params, config, texts, tokenizer, mode=kind, method="greedy", **options)
    again = generate_text(params, config, texts, tokenizer, mode=kind, method="greedy", **options)
    assert first == again
    assert len(first) == len(texts)
    assert all(isinstance(text, str) and isinstance(score, float) for text, score in first)

    # The strings are the decoded greedy tokens of the same request made with ids.
    if kind == "lm":
        ids = [[BOS, *tokenizer.encode(t)] for t in texts]
        prompts = np.zeros((2, max(map(len, ids))), np.int32)
        for row, row_ids in enumerate(ids):
            prompts[row, : len(row_ids)] = row_ids
        output = lm_generate(params, config, prompts, [len(i) for i in ids], **options)
    else:
        ids = [[*tokenizer.encode(t), EOS] for t in texts]
        source = np.zeros((2, max(map(len, ids))), np.int32)
        for row, row_ids in enumerate(ids):
            source[row, : len(row_ids)] = row_ids
        output = translate(
            params, config, source, [len(i) for i in ids], method="greedy", **options
        )
    for (text, score), tokens, want_score in zip(first, output.tokens, output.scores, strict=True):
        assert text == tokenizer.decode(content_ids(np.asarray(tokens)))
        assert score == pytest.approx(float(want_score))
    assert tokenizer.decode(tokenizer.encode(texts[0])) == texts[0]


# ---------------------------------------------------------------------------------------------
# eos_id=None and caches that do not fit


def test_eos_id_none_runs_every_row_to_max_new_tokens():
    """eos_id=None: every row generates max_new_tokens tokens, the same tokens and scores as
    with an eos id the greedy paths never produce (checked against recomputation); eos_id=-1
    is one line before anything is traced."""
    config, params = lm_setup("rope")
    free = lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=MAX_NEW,
                       eos_id=None)
    np.testing.assert_array_equal(free.lengths, [MAX_NEW] * len(PROMPTS))
    tokens = np.asarray(free.tokens)
    unused = next(token for token in range(3, config.vocab_size) if token not in tokens)
    stopped = lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=MAX_NEW,
                          eos_id=unused)
    np.testing.assert_array_equal(stopped.tokens, tokens)
    np.testing.assert_array_equal(free.scores, stopped.scores)
    expected, _ = naive_lm_greedy(config, params, eos_id=None)
    assert_rows(free, expected)
    beam = lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=MAX_NEW,
                       eos_id=None, method="beam", beam_size=2)
    np.testing.assert_array_equal(beam.lengths, [[MAX_NEW] * 2] * len(PROMPTS))
    with pytest.raises(ConfigError, match=r"^eos_id=-1 must be an integer >= 0 \(or None"):
        lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=2, eos_id=-1)
    with pytest.raises(ConfigError, match=r"^eos_id=24 must be < vocab size 24"):
        lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=2, eos_id=24)


def test_translate_with_eos_id_none_uses_each_rows_budget():
    config, params = seq2seq_setup("sinusoidal")
    source_lengths = (SOURCE != PAD).sum(axis=1)
    output = translate(params, config, SOURCE, source_lengths, method="greedy",
                       extra_len=EXTRA_LEN, eos_id=None)
    np.testing.assert_array_equal(output.lengths, source_lengths + EXTRA_LEN)


def test_a_cache_too_short_for_max_new_tokens_is_one_clear_error():
    """A prefilled cache with room for 5 + 2 tokens asked for 6 more without growing: one
    error saying how many slots it needs (under jit the overflowing steps would give NaN
    logits, so tokens silently 0)."""
    config, params = lm_setup("rope")
    model = DecoderLM(config)
    logits, cache = model.apply({"params": params}, PROMPTS,
                                cache=init_cache(config, len(PROMPTS), 7))
    step = lambda tokens, cache: model.apply({"params": params}, tokens, cache=cache)
    with pytest.raises(ValueError, match=(
            r"^the cache has max_len=7 slots, but its fullest row holds 5 and "
            r"max_new_tokens=6 needs 5 more \(10 in all\); build it with max_len >= 10")):
        search.greedy(step, logits[:, -1], cache, max_new_tokens=MAX_NEW, eos_id=None)
    search.greedy(step, logits[:, -1], cache, max_new_tokens=3, eos_id=None)  # fits
