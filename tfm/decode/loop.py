"""What every decoding algorithm of tfm.decode.search shares: the callback and cache types, the
outputs, the one validated `DecodeConfig`, the checks made before tracing, and the decode loop's
segments (a while loop per segment, the cache grown before each; see tfm/decode/search.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tfm.checks import ConfigError, check_choice, check_int, check_number

Cache = Any  # any pytree whose leaves have batch on axis 0
TokensToLogits = Callable[[jax.Array, Cache], tuple[jax.Array, Cache]]
GrowCache = Callable[[Cache, int], Cache]  # (cache, n) -> the cache with n more empty slots
# (cache, parents [batch, beam] int) -> row b * beam + j holds row b * beam + parents[b, j]: each
# beam takes its parent among its own source's beams (tfm.nn.cache.take_beams per leaf;
# tfm.nn.cache.reorder_beams also leaves cross-attention entries where they are).
ReorderCache = Callable[[Cache, jax.Array], Cache]

# A segment of the decode loop runs at least this many steps: below it the cache saved per step
# (at most this many slots) does not repay a segment's compile time (benchmarks/README.md has
# the decode runs with and without segments).
MIN_SEGMENT_STEPS = 64

# Top-p counts a set whose mass is within this of p as reaching p, so float32 rounding of
# 0.5 + 0.3 does not decide whether p=0.8 keeps two tokens or three.
TOP_P_TOLERANCE = 1e-6


@flax.struct.dataclass
class DecodeOutput:
    """Greedy or sampled continuations.

    tokens: [batch, max_new_tokens] int32, EOS included, pad_id after it.
    lengths: [batch] int32, generated tokens per row (EOS included).
    scores: [batch] float32, sum of the log-probabilities of the generated tokens (under the
      temperature-adjusted, unfiltered distribution when sampling).
    """

    tokens: jax.Array
    lengths: jax.Array
    scores: jax.Array


@flax.struct.dataclass
class BeamOutput:
    """Beam-search hypotheses, best first per row.

    tokens: [batch, beam, max_new_tokens] int32, EOS included, pad_id after it.
    lengths: [batch, beam] int32 (EOS included; 0 for an empty slot).
    scores: [batch, beam] float32, log_probs / length_penalty(lengths), sorted descending
      (-inf for an empty slot).
    log_probs: [batch, beam] float32, raw sums of token log-probabilities.
    """

    tokens: jax.Array
    lengths: jax.Array
    scores: jax.Array
    log_probs: jax.Array


# ---------------------------------------------------------------------------------------------
# Validation (before tracing, so errors read cleanly)


METHODS = ("greedy", "sample", "beam")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """How to decode, checked once here: one hashable value that travels from the command line
    (the config's `generate` / `eval` sections) as a single static argument down to `decode`.

    max_new_tokens: None only for an encoder-decoder, where each row gets its source length +
    extra_len tokens (Vaswani et al. 2017 sec. 6.1); temperature, top_k, top_p: sampling;
    beam_size, alpha: beam search (GNMT length penalty). cache_segments: how many while loops
    decoding runs, growing the KV cache before each (`segment_ends`; 1 = one loop over a cache
    of the final size, the fastest to compile). prefill_chunk: how many prompt tokens each
    prefill call runs (tfm.decode.prefill; 0 = the whole prompt in one call), so activations
    scale with the chunk, not the prompt; a chunk of a block (128) or more reads the cache
    through the fused kernels on TPU.
    """

    method: str = "greedy"
    max_new_tokens: int | None = 64
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    beam_size: int = 4
    alpha: float = 0.6
    extra_len: int = 50
    cache_segments: int = 4
    prefill_chunk: int = 0

    def __post_init__(self) -> None:
        check_choice("method", self.method, METHODS)
        if self.max_new_tokens is not None:
            check_int("max_new_tokens", self.max_new_tokens, 1)
        check_number("temperature", self.temperature, "a number > 0", lambda v: v > 0)
        check_int("top_k", self.top_k, 0, " (0 = off)")
        check_number(
            "top_p", self.top_p, "a number in (0, 1] (1 turns top-p off)", lambda v: 0 < v <= 1
        )
        check_int("beam_size", self.beam_size, 1)
        check_number(
            "alpha", self.alpha, "a finite number (0 = no length penalty)", np.isfinite
        )
        check_int("extra_len", self.extra_len, 0)
        check_int("cache_segments", self.cache_segments, 1, " (1 = one loop over a full cache)")
        check_int("prefill_chunk", self.prefill_chunk, 0, " (0 = the whole prompt in one call)")


def segment_ends(max_new_tokens: int, cache_segments: int) -> tuple[int, ...]:
    """The steps at which the decode loop's segments end (increasing, the last max_new_tokens):
    `cache_segments` equal parts of max_new_tokens rounded up to a multiple of
    MIN_SEGMENT_STEPS, a last part shorter than that merged into the one before it."""
    check_int("cache_segments", cache_segments, 1)
    size = max(MIN_SEGMENT_STEPS, -(-max_new_tokens // cache_segments))
    size = -(-size // MIN_SEGMENT_STEPS) * MIN_SEGMENT_STEPS
    ends = [end for end in range(size, max_new_tokens, size)
            if max_new_tokens - end >= MIN_SEGMENT_STEPS]
    return (*ends, max_new_tokens)


def _loop_segments(
    body: Callable[[Any], Any], state: Any, ends: tuple[int, ...], grow_cache: GrowCache | None
) -> Any:
    """Runs `body` until every row is done or state.step reaches ends[-1], one while loop per
    segment; with grow_cache, the cache first grows by the segment's steps. `state` is a
    NamedTuple with step, done and cache."""
    start = 0
    for end in ends:
        if grow_cache is not None:
            state = state._replace(cache=grow_cache(state.cache, end - start))
        state = jax.lax.while_loop(
            lambda state, end=end: (state.step < end) & ~jnp.all(state.done), body, state
        )
        start = end
    return state


def _segments(
    max_new_tokens: int, grow_cache: GrowCache | None, cache_segments: int
) -> tuple[int, ...]:
    """segment_ends, checked: several segments need a grow_cache."""
    if grow_cache is None:
        if cache_segments != 1:
            raise ValueError(
                f"cache_segments={cache_segments} needs grow_cache (e.g. tfm.nn.cache.grow) and a "
                "cache prefilled with room for the prompt only; without it the cache has its "
                "final size and the loop runs once (cache_segments=1)"
            )
        return (max_new_tokens,)
    return segment_ends(max_new_tokens, cache_segments)


def check_eos_id(eos_id: int | None, vocab_size: int) -> None:
    """eos_id: a token id < vocab_size, or None (rows never stop at a token)."""
    if eos_id is None:
        return
    check_int("eos_id", eos_id, 0, " (or None: no end-of-sequence token)")
    if eos_id >= vocab_size:
        raise ConfigError(f"eos_id={eos_id} must be < vocab size {vocab_size} (or None: no "
                          "end-of-sequence token)")


def _is_eos(token: jax.Array, eos_id: int | None) -> jax.Array:
    """[...] bool: which tokens end their row (none when eos_id is None)."""
    if eos_id is None:
        return jnp.zeros(token.shape, bool)
    return token == eos_id


def check_cache_rows(cache: Cache, batch: int, max_new_tokens: int,
                     grow_cache: GrowCache | None) -> None:
    """Raises a readable error when `cache` does not fit the decoding: a leaf without `batch`
    rows on axis 0 (a cache built for another batch size) or, for a cache that says its
    `lengths` ([batch]) and `max_len` (tfm.nn.cache.DecoderCache) outside jit, too few slots
    for max_new_tokens - 1 more tokens when it does not grow (which under jit gives NaN
    logits, so silently wrong tokens)."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
        if np.ndim(leaf) == 0 or np.shape(leaf)[0] != batch:
            raise ValueError(
                f"cache{jax.tree_util.keystr(path)} has shape {tuple(np.shape(leaf))}, but "
                f"every cache leaf needs the batch of initial_logits, {batch}, on axis 0: build "
                f"the cache for {batch} rows (tfm.nn.cache.init_cache(config, batch_size={batch}"
                ", max_len=...))"
            )
    lengths, max_len = getattr(cache, "lengths", None), getattr(cache, "max_len", None)
    if grow_cache is not None or max_len is None or isinstance(lengths, jax.core.Tracer):
        return
    needed = int(np.max(np.asarray(lengths))) + max_new_tokens - 1
    if needed > max_len:
        raise ValueError(
            f"the cache has max_len={max_len} slots, but its fullest row holds "
            f"{int(np.max(np.asarray(lengths)))} and max_new_tokens={max_new_tokens} needs "
            f"{max_new_tokens - 1} more ({needed} in all); build it with max_len >= {needed}, "
            "or pass grow_cache=tfm.nn.cache.grow"
        )


def _check_common(
    initial_logits: jax.Array,
    max_new_tokens: int,
    eos_id: int | None,
    pad_id: int,
    max_new_per_row: jax.Array | None,
) -> None:
    if np.ndim(initial_logits) != 2:
        raise ValueError(
            f"initial_logits must be [batch, vocab] (rank 2); got shape {np.shape(initial_logits)}"
        )
    batch, vocab = np.shape(initial_logits)
    check_eos_id(eos_id, vocab)
    check_int("pad_id", pad_id, 0)
    if max_new_per_row is not None and np.shape(max_new_per_row) != (batch,):
        raise ValueError(
            f"max_new_per_row must be [batch] = ({batch},); got shape {np.shape(max_new_per_row)}"
        )


def _row_limits(max_new_per_row: jax.Array | None, batch: int, max_new_tokens: int) -> jax.Array:
    """Per-row token budgets, [batch] int32 clipped to [0, max_new_tokens]."""
    if max_new_per_row is None:
        return jnp.full((batch,), max_new_tokens, jnp.int32)
    return jnp.clip(jnp.asarray(max_new_per_row, jnp.int32), 0, max_new_tokens)
