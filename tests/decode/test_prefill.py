"""Chunked prefill (tfm/decode/prefill.py): the prompt run through the model a chunk at a time,
each chunk against the cache written so far, gives the logits and the generation of the whole
prompt in one call, for every position scheme, chunks that do and do not divide the prompt,
right-padded prompts of different lengths; through the flex kernel (interpret mode) with the
rows' query offset for chunks of a block or more; and lowered for TPU it holds no
[chunk, cache_len] array."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decode_cases import PROMPT_LENGTHS, PROMPTS, config_for, random_params

from tfm.checks import ConfigError
from tfm.decode import prefill
from tfm.decode.generate import lm_generate
from tfm.decode.search import DecodeConfig
from tfm.nn.cache import init_cache
from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM
from tfm.training.config import EvalConfig, GenerateConfig

SCHEMES = ("rope", "alibi", "t5_bias", "learned")


@functools.partial(jax.jit, static_argnames=("config", "chunk"))
def prefill_logits(params, prompts, lengths, config, chunk):
    """Each row's logits [batch, vocab] at its last prompt token, and the filled cache."""
    model = DecoderLM(config)
    cache = init_cache(config, prompts.shape[0],
                       prefill.padded_length(prompts.shape[1], chunk))

    def apply_at(tokens, cache, logits_at, positions):
        return model.apply({"params": params}, tokens, cache=cache, positions=positions,
                           logits_at=logits_at)

    return prefill.prefill(apply_at, prompts, lengths - 1, cache, chunk)


@functools.cache
def lm(scheme: str, **changes) -> tuple[ModelConfig, dict]:
    config = config_for(scheme, num_encoder_layers=0, **changes)
    return config, random_params(DecoderLM(config), PROMPTS)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_chunked_prefill_then_decoding_equals_the_whole_prompt(scheme):
    """Chunks of 2 and 3 (neither divides the 5-token prompts; rows of 1 to 5 real tokens):
    the last prompt logits within 1e-5 of one call's, and the same greedy tokens after."""
    config, params = lm(scheme)
    prompts, lengths = jnp.asarray(PROMPTS), jnp.asarray(PROMPT_LENGTHS)
    whole, _ = prefill_logits(params, prompts, lengths, config, 0)
    generated = lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=6,
                            eos_id=None)
    for chunk in (1, 2, 3, 5):
        logits, cache = prefill_logits(params, prompts, lengths, config, chunk)
        assert cache.max_len == prefill.padded_length(5, chunk)
        np.testing.assert_allclose(logits, whole, atol=1e-5, err_msg=f"chunk {chunk}")
        chunked = lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=6,
                              eos_id=None, prefill_chunk=chunk)
        np.testing.assert_array_equal(chunked.tokens, generated.tokens)
        np.testing.assert_allclose(chunked.scores, generated.scores, atol=1e-5)


def test_a_chunk_that_divides_the_prompt_fills_the_cache_exactly():
    assert prefill.padded_length(300, 150) == 300
    assert prefill.padded_length(300, 128) == 384
    assert prefill.padded_length(300, 0) == prefill.padded_length(300, 400) == 300


@functools.cache
def long_prompts() -> tuple[np.ndarray, np.ndarray]:
    """Two right-padded rows of 300 and 231 real tokens."""
    rng = np.random.default_rng(7)
    prompts = rng.integers(3, 24, (2, 300)).astype(np.int32)
    lengths = np.array([300, 231], np.int32)
    prompts[1, 231:] = 0
    return prompts, lengths


@pytest.mark.parametrize("scheme, layout", [("t5_bias", "auto"), ("alibi", "auto"),
                                            ("rope", "auto"), ("t5_bias", "tpu")])
def test_chunks_of_a_block_read_the_cache_through_flex(scheme, layout, monkeypatch):
    """Chunks of 128 (3 of them, the last padded) and 150 (2) run the flex kernel with each
    row's query offset (counted: every layer of every chunk), and give the logits of the whole
    prompt's flex pass and its greedy tokens; from the reference cache layout (this platform's)
    and TPU's (tfm/kernels/tpu_cache.py, handed to the kernel in the model's order; the whole
    prompt reads its keys and values back from the cache it fills, the chunks do not)."""
    from tfm.kernels import flex_attention

    config, params = lm(scheme, attention_backend="flex", max_len=512, cache_layout=layout)
    prompts, lengths = long_prompts()
    whole, _ = prefill_logits(params, jnp.asarray(prompts), jnp.asarray(lengths), config, 0)
    generated = lm_generate(params, config, prompts, lengths, max_new_tokens=3, eos_id=None)
    offsets = []
    local = flex_attention.attend_local

    def counting(*args, **kwargs):
        offsets.append(len(args[3]) == 5)  # rows carry the query offset
        return local(*args, **kwargs)

    monkeypatch.setattr(flex_attention, "attend_local", counting)
    for chunk in (128, 150):
        offsets.clear()
        logits, cache = prefill_logits(params, jnp.asarray(prompts), jnp.asarray(lengths),
                                       config, chunk)
        assert offsets and all(offsets)
        assert cache.layout.name == ("reference" if layout == "auto" else layout)
        np.testing.assert_allclose(logits, whole, atol=1e-5, err_msg=f"chunk {chunk}")
        chunked = lm_generate(params, config, prompts, lengths, max_new_tokens=3, eos_id=None,
                              prefill_chunk=chunk)
        np.testing.assert_array_equal(chunked.tokens, generated.tokens)


@pytest.mark.parametrize("method", ["greedy", "beam"])
def test_decoding_from_tpus_cache_layout_equals_the_reference_layout(method):
    """Flex with TPU's cache layout (keys and values [batch, kv_heads, head_dim, slots]: each
    decoding step's reference einsums read it as stored, the cache grows in segments, beams
    reorder its rows) gives the tokens and scores of the reference layout, GQA heads included."""
    prompts, lengths = long_prompts()
    outputs = []
    for layout in ("reference", "tpu"):
        config, params = lm("t5_bias", attention_backend="flex", max_len=512, num_kv_heads=1,
                            cache_layout=layout)
        outputs.append(lm_generate(params, config, prompts[:, :40], np.minimum(lengths, 40),
                                   method=method, max_new_tokens=70, eos_id=None,
                                   cache_segments=2, beam_size=2))
    np.testing.assert_array_equal(outputs[1].tokens, outputs[0].tokens)
    np.testing.assert_allclose(outputs[1].scores, outputs[0].scores, atol=1e-5)


def test_tpus_cache_layout_is_pinned_in_the_lowered_step():
    """XLA picks the physical order of the values inside a program; TPU's layout asks for its
    own (`CacheLayout.pin_order`: a layout constraint on every cache array written), without
    which XLA stored it [slots, heads, head_dim] again, padded (docs/performance.md)."""
    changes = dict(d_model=64, num_heads=4, num_kv_heads=4, dtype="bfloat16", max_len=1024)
    lowered = {layout: _lowered_chunk(lm("t5_bias", attention_backend="flex", **changes,
                                         cache_layout=layout)[0], 1, 1024)
               for layout in ("reference", "tpu")}
    pins = [line for line in lowered["tpu"].splitlines() if "LayoutConstraint" in line]
    layers = lm("t5_bias")[0].num_decoder_layers
    # Each layer's keys and values [batch 2, kv_heads 4, head_dim 16, slots 1024] as written
    # by the step, and the new token's before the write, all stored row-major (minor-to-major
    # 3, 2, 1, 0).
    assert all("result_layouts = [dense<[3, 2, 1, 0]>" in line for line in pins)
    shapes = sorted(re.search(r"\((tensor<[0-9x]*xbf16>)\)", line).group(1) for line in pins)
    assert shapes == sorted(["tensor<2x4x16x1024xbf16>", "tensor<2x4x16x1xbf16>"] * 2 * layers)
    assert "LayoutConstraint" not in lowered["reference"]


def _lowered_chunk(config: ModelConfig, chunk: int, slots: int) -> str:
    """One prefill chunk of [2, chunk] tokens into a cache of `slots` slots at a traced offset
    (the cache's lengths), lowered for TPU, as text."""
    model = DecoderLM(config)
    tokens = jax.ShapeDtypeStruct((2, chunk), jnp.int32)
    params = jax.eval_shape(
        lambda: {"params": model.init(jax.random.key(0), jnp.ones((2, chunk), int))["params"]})
    cache = jax.eval_shape(lambda: init_cache(config, 2, slots))
    step = lambda params, tokens, cache: model.apply(params, tokens, cache=cache)
    return jax.jit(step).trace(params, tokens, cache).lower(
        lowering_platforms=("tpu",)).as_text()


@pytest.mark.parametrize("scheme, backend", [("t5_bias", "flex"), ("rope", "splash")])
def test_a_chunk_against_the_cache_holds_no_chunk_by_cache_array_on_tpu(scheme, backend):
    """Lowered for TPU: a 256-token chunk against a 1,024-slot cache calls the Pallas kernel
    (T5 on flex; RoPE on splash, which hands flex the chunk) and holds no [.., 256, 1024]
    array (bias, mask or scores); on the reference it does (so the check can fail)."""
    chunk, slots = 256, 1024
    changes = dict(d_model=64, num_heads=4, num_kv_heads=4, dtype="bfloat16", max_len=slots)
    config, _ = lm(scheme, attention_backend=backend, **changes)
    lowered = _lowered_chunk(config, chunk, slots)
    scores = re.compile(rf"x{chunk}x{slots}x")
    assert "tpu_custom_call" in lowered and not scores.search(lowered)
    reference, _ = lm(scheme, attention_backend="reference", **changes)
    assert scores.search(_lowered_chunk(reference, chunk, slots))


def test_prefill_chunk_is_checked_early_by_name():
    with pytest.raises(ConfigError, match="prefill_chunk=-1 must be an integer >= 0"):
        DecodeConfig(prefill_chunk=-1)
    with pytest.raises(ConfigError, match="eval.prefill_chunk=1.5"):
        EvalConfig(prefill_chunk=1.5)
    with pytest.raises(ConfigError, match="generate.prefill_chunk=-2"):
        GenerateConfig.from_section({"prefill_chunk": -2})
    assert GenerateConfig.from_section({"prefill_chunk": 512}).decode.prefill_chunk == 512
    assert EvalConfig(prefill_chunk=64).decode_config("exact_match").prefill_chunk == 64


def test_a_cache_of_the_wrong_size_is_one_clear_error():
    config, params = lm("rope")
    with pytest.raises(ValueError, match="writes 6 slots, but the cache has 5"):
        prefill.prefill(lambda *a: None, jnp.asarray(PROMPTS), jnp.asarray(PROMPT_LENGTHS),
                        init_cache(config, 4, 5), 2)
