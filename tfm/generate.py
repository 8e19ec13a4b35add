"""User-facing generation: prefill a KV cache, then greedy / sampling / beam search, all in one jit.

`lm_generate` continues prompts with a decoder-only LM; `translate` encodes the source once and
decodes with the encoder-decoder (cross-attention keys/values projected once into the cache);
`generate_text` does either from strings when a tokenizer is at hand.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tfm import decoding
from tfm.cache import init_cache
from tfm.config import ModelConfig
from tfm.models import DecoderLM, EncoderDecoder

METHODS = ("greedy", "sample", "beam")
BOS_ID, EOS_ID = 1, 2


def fill_id(config: ModelConfig) -> int:
    """The id written after EOS and into padded rows: pad_id, or 0 for a model without one
    (rows carry their lengths, so the filler is never read as a token)."""
    return 0 if config.pad_id is None else config.pad_id


def _check_request(config: ModelConfig, method: str, total_len: int, beam_size: int) -> None:
    if method not in METHODS:
        raise ValueError(f"method={method!r} is unknown; choose one of: {', '.join(METHODS)}")
    if method == "beam" and beam_size < 1:
        raise ValueError(f"beam_size={beam_size} must be >= 1")
    if config.position_scheme == "learned" and total_len > config.max_len:
        raise ValueError(
            f"decoding to length {total_len} needs positions past max_len={config.max_len} of the "
            "learned position table; shorten the prompt or max_new_tokens"
        )


def _run(
    method: str,
    tokens_to_logits: decoding.TokensToLogits,
    initial_logits: jax.Array,  # [batch, vocab]
    cache: Any,
    rng: jax.Array,
    options: dict,
) -> Any:
    common = dict(
        max_new_tokens=options["max_new_tokens"],
        eos_id=options["eos_id"],
        pad_id=options["pad_id"],
        max_new_per_row=options.get("max_new_per_row"),
    )
    if method == "greedy":
        return decoding.greedy(tokens_to_logits, initial_logits, cache, **common)
    if method == "sample":
        return decoding.sample(
            tokens_to_logits,
            initial_logits,
            cache,
            rng,
            temperature=options["temperature"],
            top_k=options["top_k"],
            top_p=options["top_p"],
            **common,
        )
    return decoding.beam_search(
        tokens_to_logits,
        initial_logits,
        cache,
        beam_size=options["beam_size"],
        alpha=options["alpha"],
        **common,
    )


@functools.partial(jax.jit, static_argnames=("config", "method", "options_items"))
def _lm_generate_jit(params, prompts, prompt_lengths, rng, config, method, options_items):
    options = dict(options_items)
    model = DecoderLM(config)
    batch, prompt_len = prompts.shape
    cache = init_cache(config, batch, prompt_len + options["max_new_tokens"])
    logits, cache = model.apply({"params": params}, prompts, cache=cache)
    # Rows continue from their own prompt end; slots past it are overwritten as they decode.
    cache = cache.replace(lengths=prompt_lengths.astype(jnp.int32))
    last = jnp.take_along_axis(logits, (prompt_lengths - 1)[:, None, None], axis=1)[:, 0]

    def tokens_to_logits(tokens, cache):
        return model.apply({"params": params}, tokens, cache=cache)

    return _run(method, tokens_to_logits, last, cache, rng, options)


def lm_generate(
    params: Any,
    config: ModelConfig,
    prompts: np.ndarray,  # [batch, prompt_len] int, right-padded
    prompt_lengths: np.ndarray,  # [batch] int, >= 1
    *,
    max_new_tokens: int,
    method: str = "greedy",
    eos_id: int = EOS_ID,
    rng: jax.Array | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    beam_size: int = 4,
    alpha: float = 0.6,
) -> Any:
    """Continues each prompt; returns decoding.DecodeOutput (greedy, sample) or BeamOutput."""
    prompts = np.asarray(prompts)
    prompt_lengths = np.asarray(prompt_lengths)
    if prompts.ndim != 2 or prompt_lengths.shape != prompts.shape[:1]:
        raise ValueError(
            f"prompts must be [batch, len] and prompt_lengths [batch]; got {prompts.shape} and "
            f"{prompt_lengths.shape}"
        )
    if prompt_lengths.min() < 1 or prompt_lengths.max() > prompts.shape[1]:
        raise ValueError(f"prompt_lengths must be in [1, {prompts.shape[1]}]; got {prompt_lengths}")
    _check_request(config, method, int(prompt_lengths.max()) + max_new_tokens, beam_size)
    options = dict(
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        pad_id=fill_id(config),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        beam_size=beam_size,
        alpha=alpha,
    )
    rng = jax.random.PRNGKey(0) if rng is None else rng
    return _lm_generate_jit(
        params,
        jnp.asarray(prompts),
        jnp.asarray(prompt_lengths),
        rng,
        config,
        method,
        tuple(sorted(options.items())),
    )


@functools.partial(jax.jit, static_argnames=("config", "method", "options_items"))
def _translate_jit(params, source, source_lengths, rng, config, method, options_items):
    options = dict(options_items)
    model = EncoderDecoder(config)
    batch, source_len = source.shape
    source_valid = jnp.arange(source_len)[None, :] < source_lengths[:, None]
    encoded = model.apply(
        {"params": params}, source, source_valid=source_valid, method=EncoderDecoder.encode
    )
    cache = init_cache(config, batch, options["max_new_tokens"] + 1, source_len=source_len)
    bos = jnp.full((batch, 1), options["bos_id"], jnp.int32)
    logits, cache = model.apply(
        {"params": params},
        bos,
        encoded=encoded,
        source_valid=source_valid,
        cache=cache,
        method=EncoderDecoder.decode,
    )

    def tokens_to_logits(tokens, cache):
        return model.apply(
            {"params": params}, tokens, encoded=None, cache=cache, method=EncoderDecoder.decode
        )

    source_lengths = source_valid.sum(axis=1).astype(jnp.int32)
    options["max_new_per_row"] = jnp.minimum(
        source_lengths + options.pop("extra_len"), options["max_new_tokens"]
    )
    return _run(method, tokens_to_logits, logits[:, 0], cache, rng, options)


def translate(
    params: Any,
    config: ModelConfig,
    source: np.ndarray,  # [batch, src_len] int, right-padded
    source_lengths: np.ndarray | None = None,  # [batch] real tokens per row; None = all
    *,
    method: str = "beam",
    beam_size: int = 4,
    alpha: float = 0.6,
    extra_len: int = 50,
    max_new_tokens: int | None = None,
    bos_id: int = BOS_ID,
    eos_id: int = EOS_ID,
    rng: jax.Array | None = None,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Any:
    """Translates with the paper's settings by default: beam 4, alpha 0.6, at most input
    length + 50 output tokens per row (Vaswani et al. 2017 sec. 6.1)."""
    source = np.asarray(source)
    if source.ndim != 2:
        raise ValueError(f"source must be [batch, len]; got shape {source.shape}")
    if source_lengths is None:
        source_lengths = np.full(source.shape[:1], source.shape[1])
    source_lengths = np.asarray(source_lengths)
    if source_lengths.shape != source.shape[:1]:
        raise ValueError(
            f"source_lengths must be [batch]={source.shape[:1]}; got {source_lengths.shape}"
        )
    if max_new_tokens is None:
        max_new_tokens = source.shape[1] + extra_len
    _check_request(config, method, max_new_tokens + 1, beam_size)
    options = dict(
        max_new_tokens=max_new_tokens,
        eos_id=eos_id,
        pad_id=fill_id(config),
        bos_id=bos_id,
        extra_len=extra_len,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        beam_size=beam_size,
        alpha=alpha,
    )
    rng = jax.random.PRNGKey(0) if rng is None else rng
    return _translate_jit(
        params,
        jnp.asarray(source),
        jnp.asarray(source_lengths, jnp.int32),
        rng,
        config,
        method,
        tuple(sorted(options.items())),
    )


def pad_batch(sequences: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-pads token lists into [batch, max_len] int32 plus their lengths [batch]."""
    lengths = np.array([len(s) for s in sequences], np.int32)
    batch = np.full((len(sequences), max(1, lengths.max())), pad_id, np.int32)
    for row, sequence in enumerate(sequences):
        batch[row, : len(sequence)] = sequence
    return batch, lengths


def best_sequences(output: Any) -> tuple[np.ndarray, np.ndarray]:
    """Tokens [batch, len] and scores [batch] of the best hypothesis, for any decoding output."""
    tokens, scores = np.asarray(output.tokens), np.asarray(output.scores)
    if tokens.ndim == 3:  # beam search: best beam first
        tokens, scores = tokens[:, 0], scores[:, 0]
    return tokens, scores


def strip_special(tokens: np.ndarray, eos_id: int = EOS_ID, pad_id: int = 0) -> list[int]:
    """Token ids up to (not including) the first EOS, pads dropped."""
    out = []
    for token in tokens.tolist():
        if token == eos_id:
            break
        if token != pad_id:
            out.append(token)
    return out


def generate_text(
    params: Any,
    config: ModelConfig,
    texts: list[str],
    tokenizer: Any,
    *,
    kind: str,
    source_tokenizer: Any = None,
    **options: Any,
) -> list[tuple[str, float]]:
    """Text in, (text, score) out. kind='lm' continues each text; kind='seq2seq' translates it."""
    pad_id = fill_id(config)
    if kind == "lm":
        prompts, lengths = pad_batch([[BOS_ID, *tokenizer.encode(t)] for t in texts], pad_id)
        output = lm_generate(params, config, prompts, lengths, **options)
    elif kind == "seq2seq":
        encode = (source_tokenizer or tokenizer).encode
        source, source_lengths = pad_batch([[*encode(t), EOS_ID] for t in texts], pad_id)
        output = translate(params, config, source, source_lengths, **options)
    else:
        raise ValueError(f"kind={kind!r} is unknown; choose one of: lm, seq2seq")
    tokens, scores = best_sequences(output)
    eos_id = options.get("eos_id", EOS_ID)
    return [
        (tokenizer.decode(strip_special(row, eos_id, pad_id)), float(s))
        for row, s in zip(tokens, scores, strict=True)
    ]
