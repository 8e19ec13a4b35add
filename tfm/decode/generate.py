"""User-facing generation: prefill a KV cache, then greedy / sampling / beam search, all in one jit.

`lm_generate` continues prompts with a decoder-only LM; `translate` encodes the source once and
decodes with the encoder-decoder (cross-attention keys/values projected once into the cache);
`generate_text` does either from strings when a tokenizer is at hand.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tfm.checks import check_choice
from tfm.data.tokenizers import BOS_ID, EOS_ID, content_ids
from tfm.decode import prefill, search
from tfm.decode.search import DecodeConfig
from tfm.kernels import cpu_compile
from tfm.nn.cache import grow, init_cache, reorder_beams
from tfm.nn.config import ModelConfig
from tfm.nn.families import MODES, get_family
from tfm.nn.models import DecoderLM, EncoderDecoder, output_kernel


def fill_id(config: ModelConfig) -> int:
    """The id written after EOS and into padded rows: pad_id, or 0 for a model without one
    (rows carry their lengths, so the filler is never read as a token)."""
    return 0 if config.pad_id is None else config.pad_id


def _decode_config(decode: DecodeConfig | None, options: dict[str, Any], **defaults: Any):
    """`decode` (or a DecodeConfig of `defaults`) with `options` (DecodeConfig fields) replaced;
    validated once, by DecodeConfig."""
    return dataclasses.replace(decode or DecodeConfig(**defaults), **options)


def _check_length(config: ModelConfig, total_len: int, needs: str) -> None:
    """Before compiling: a position scheme bounded by max_len (learned positions) cannot go
    past it. `needs` says what the total_len positions are made of, e.g. "prompt (5) +
    max_new_tokens (12)"."""
    if config.scheme.bounded_by_max_len and total_len > config.max_len:
        raise ValueError(
            f"decoding to length {total_len} needs positions past max_len={config.max_len} of the "
            f"position table of position_scheme={config.position_scheme!r}: {needs} = "
            f"{total_len} > model.max_len={config.max_len}; shorten the prompt or lower "
            "max_new_tokens"
        )


def _lm_kernels(arguments: dict[str, Any]) -> str:
    decode = arguments["decode"]
    beams = decode.beam_size if decode.method == "beam" else 1
    return cpu_compile.decode_kernels(arguments["prompts"].shape[0] * beams)


@functools.partial(
    cpu_compile.jit, static_argnames=("config", "decode", "eos_id"), cpu_kernels=_lm_kernels
)
def _lm_generate_jit(params, prompts, prompt_lengths, rng, config, decode, eos_id):
    model = DecoderLM(config)
    batch, prompt_len = prompts.shape
    # Room for the prompt (in whole chunks); the loop grows it (decode.cache_segments).
    cache = init_cache(config, batch, prefill.padded_length(prompt_len, decode.prefill_chunk))
    kernel = output_kernel(params, config)  # one copy of a tied output, not one per step

    def apply_at(tokens, cache, logits_at, positions):  # only each prompt's last logits:
        return model.apply({"params": params}, tokens, cache=cache, positions=positions,
                           output_kernel=kernel, logits_at=logits_at)  # no [.., vocab] array

    last, cache = prefill.prefill(apply_at, prompts, prompt_lengths - 1, cache,
                                  decode.prefill_chunk)
    # Rows continue from their own prompt end; slots past it are overwritten as they decode.
    cache = cache.replace(lengths=prompt_lengths.astype(jnp.int32))

    def tokens_to_logits(tokens, cache):
        return model.apply({"params": params}, tokens, cache=cache, output_kernel=kernel)

    return search.decode(
        tokens_to_logits, last, cache, rng, decode, max_new_tokens=decode.max_new_tokens,
        eos_id=eos_id, pad_id=fill_id(config), grow_cache=grow, reorder_cache=reorder_beams,
    )


def lm_generate(
    params: Any,
    config: ModelConfig,
    prompts: np.ndarray,  # [batch, prompt_len] int, right-padded
    prompt_lengths: np.ndarray,  # [batch] int, >= 1
    decode: DecodeConfig | None = None,
    *,
    eos_id: int | None = EOS_ID,
    rng: jax.Array | None = None,
    **options: Any,
) -> Any:
    """Continues each prompt as `decode` says (default: greedy, 64 new tokens); `options`
    (method=, max_new_tokens=, beam_size=, ... : DecodeConfig fields) replace its fields.
    A row stops at eos_id (None: every row runs max_new_tokens tokens). Returns
    search.DecodeOutput (greedy, sample) or BeamOutput (beam)."""
    decode = _decode_config(decode, options)
    prompts = np.asarray(prompts)
    prompt_lengths = np.asarray(prompt_lengths)
    if prompts.ndim != 2 or prompt_lengths.shape != prompts.shape[:1]:
        raise ValueError(
            f"prompts must be [batch, len] and prompt_lengths [batch]; got {prompts.shape} and "
            f"{prompt_lengths.shape}"
        )
    if prompt_lengths.min() < 1 or prompt_lengths.max() > prompts.shape[1]:
        raise ValueError(f"prompt_lengths must be in [1, {prompts.shape[1]}]; got {prompt_lengths}")
    if decode.max_new_tokens is None:
        raise ValueError("max_new_tokens=None must be an integer >= 1 for a decoder-only LM")
    longest = int(prompt_lengths.max())
    _check_length(config, longest + decode.max_new_tokens,
                  f"prompt ({longest}) + max_new_tokens ({decode.max_new_tokens})")
    search.check_eos_id(eos_id, config.vocab_size)
    rng = jax.random.PRNGKey(0) if rng is None else rng
    return _lm_generate_jit(
        params, jnp.asarray(prompts), jnp.asarray(prompt_lengths), rng, config, decode, eos_id
    )


@functools.partial(
    cpu_compile.jit, static_argnames=("config", "decode", "bos_id", "eos_id")
)
def _translate_jit(params, source, source_lengths, rng, config, decode, bos_id, eos_id):
    model = EncoderDecoder(config)
    batch, source_len = source.shape
    source_valid = jnp.arange(source_len)[None, :] < source_lengths[:, None]
    encoded = model.apply(
        {"params": params}, source, source_valid=source_valid, method=EncoderDecoder.encode
    )
    cache = init_cache(config, batch, 1, source_len=source_len)  # BOS; the loop grows it
    bos = jnp.full((batch, 1), bos_id, jnp.int32)
    kernel = output_kernel(params, config)  # one copy of a tied output, not one per step
    logits, cache = model.apply(
        {"params": params},
        bos,
        encoded=encoded,
        source_valid=source_valid,
        cache=cache,
        output_kernel=kernel,
        method=EncoderDecoder.decode,
    )

    def tokens_to_logits(tokens, cache):
        return model.apply(
            {"params": params}, tokens, encoded=None, cache=cache, output_kernel=kernel,
            method=EncoderDecoder.decode,
        )

    source_lengths = source_valid.sum(axis=1).astype(jnp.int32)
    max_new_per_row = jnp.minimum(source_lengths + decode.extra_len, decode.max_new_tokens)
    return search.decode(
        tokens_to_logits, logits[:, 0], cache, rng, decode,
        max_new_tokens=decode.max_new_tokens, eos_id=eos_id, pad_id=fill_id(config),
        max_new_per_row=max_new_per_row, grow_cache=grow, reorder_cache=reorder_beams,
    )


def translate(
    params: Any,
    config: ModelConfig,
    source: np.ndarray,  # [batch, src_len] int, right-padded
    source_lengths: np.ndarray | None = None,  # [batch] real tokens per row; None = all
    decode: DecodeConfig | None = None,
    *,
    bos_id: int = BOS_ID,
    eos_id: int | None = EOS_ID,
    rng: jax.Array | None = None,
    **options: Any,
) -> Any:
    """Translates as `decode` says, by default with the paper's settings: beam 4, alpha 0.6, at
    most input length + 50 output tokens per row (Vaswani et al. 2017 sec. 6.1). `options`
    (DecodeConfig fields) replace fields of `decode`; max_new_tokens=None = src_len + extra_len.
    A row stops at eos_id (None: only at its length budget)."""
    decode = _decode_config(decode, options, method="beam", max_new_tokens=None)
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
    if decode.max_new_tokens is None:
        decode = dataclasses.replace(decode, max_new_tokens=source.shape[1] + decode.extra_len)
    _check_length(config, decode.max_new_tokens + 1,
                  f"BOS (1) + max_new_tokens ({decode.max_new_tokens})")
    search.check_eos_id(eos_id, config.vocab_size)
    rng = jax.random.PRNGKey(0) if rng is None else rng
    return _translate_jit(
        params,
        jnp.asarray(source),
        jnp.asarray(source_lengths, jnp.int32),
        rng,
        config,
        decode,
        bos_id,
        eos_id,
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


def generate_text(
    params: Any,
    config: ModelConfig,
    texts: list[str],
    tokenizer: Any,
    *,
    mode: str,
    source_tokenizer: Any = None,
    **options: Any,
) -> list[tuple[str, float]]:
    """Text in, (text, score) out. mode='lm' continues each text; mode='seq2seq' translates it.
    `options`: DecodeConfig fields, or decode=, eos_id=, rng= (see lm_generate, translate)."""
    pad_id = fill_id(config)
    check_choice("mode", mode, MODES)
    generator, to_ids = GENERATORS[get_family(mode).generator]
    options = {**special_ids(tokenizer, mode), **options}  # the tokenizer's own, unless given
    inputs, lengths = pad_batch(to_ids(texts, source_tokenizer or tokenizer), pad_id)
    tokens, scores = best_sequences(generator(params, config, inputs, lengths, **options))
    eos_id = options["eos_id"]
    return [
        (tokenizer.decode(content_ids(row, eos_id, pad_id)), float(s))
        for row, s in zip(tokens, scores, strict=True)
    ]


def special_ids(tokenizer: Any, mode: str) -> dict[str, int]:
    """The generator's eos_id (and bos_id, for a family that reads a source: the decoder's first
    input) of a tokenizer, which may be a pretrained model's own rather than tfm's 1 and 2."""
    ids = {"eos_id": tokenizer.eos_id}
    return {**ids, "bos_id": tokenizer.bos_id} if get_family(mode).reads_source else ids


def _prompt_ids(texts: list[str], tokenizer: Any) -> list[list[int]]:
    return [[tokenizer.bos_id, *tokenizer.encode(text)] for text in texts]


def _source_ids(texts: list[str], tokenizer: Any) -> list[list[int]]:
    return [[*tokenizer.encode(text), tokenizer.eos_id] for text in texts]


# The generators a family names (tfm.nn.families.Family.generator): the function, called as
# (params, config, inputs [batch, len], lengths [batch], decode options), and how texts become
# its input ids: a decoder-only model continues [bos] + prompt; an encoder-decoder translates
# source + [eos].
GENERATORS: dict[str, tuple[Any, Any]] = {
    "continue": (lm_generate, _prompt_ids),
    "translate": (translate, _source_ids),
}
