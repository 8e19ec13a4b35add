"""Decoding inside jit, model-agnostic: greedy, sampling (temperature, top-k, top-p), beam search.

Every algorithm is written against a callback, as in Flax's wmt/lm1b examples:

    tokens_to_logits(tokens: [batch, length] int32, cache)
        -> (logits: [batch, length, vocab] float32, cache)

`cache` is any pytree whose leaves all have batch on axis 0 (`tfm.nn.cache.DecoderCache` is one), so
beam search can expand it to batch * beam rows and reorder beams with one gather per leaf.

The algorithms start from `initial_logits: [batch, vocab]` (the logits after the prompt or BOS was
fed to a prefilled cache) and feed one token per step. The first token is picked from
initial_logits before the loop; each loop step runs the model on the last token and picks the next
one, so the model runs once for every token after the first and never after the last one (a cache
with room for prompt + max_new_tokens - 1 positions is enough), with no per-step branch. Each row
stops on its own at EOS (pad after; eos_id=None: no token stops a row) or at its
`max_new_per_row` limit; the loop ends when every
row is done or `max_new_tokens` tokens were generated. Rows that are done still go through the
model (their outputs are discarded), because the batch moves in lockstep.

Growing the cache (`grow_cache`, e.g. `tfm.nn.cache.grow`; what `tfm.decode.generate` does): the
caller
prefills a cache with room for the prompt only, and the loop runs as `cache_segments` while loops
(`segment_ends`), growing the cache by each one's steps before it starts, so early steps attend
over a shorter cache instead of every step over the final length. Each segment is one more copy
of the step in the compiled program (compile time grows with it; the 6-layer benchmark model:
about 1 s per segment at batch 8 on a 2-core CPU) and one copy of the cache at its start. Tokens
and scores are those of one loop over a full-size cache (the masked slots add exact zeros).

Each algorithm is jitted with `tokens_to_logits` and the sizes as static arguments: pass the same
callback object again to reuse the compiled loop, or call it inside your own `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from tfm.checks import ConfigError, check_choice, check_int, check_number
from tfm.kernels import cpu_compile

Cache = Any  # any pytree whose leaves have batch on axis 0
TokensToLogits = Callable[[jax.Array, Cache], tuple[jax.Array, Cache]]
GrowCache = Callable[[Cache, int], Cache]  # (cache, n) -> the cache with n more empty slots
# (cache, index [batch * beam] int) -> row r holds row index[r]; index stays within each source's
# beams (e.g. tfm.nn.cache.reorder_beams, which leaves cross-attention entries where they are).
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
    of the final size, the fastest to compile).
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


# ---------------------------------------------------------------------------------------------
# Filtering


def filter_logits(logits: jax.Array, *, top_k: int = 0, top_p: float = 1.0) -> jax.Array:
    """Keeps the top-k, then the top-p (nucleus, Holtzman et al. 2020) tokens; the rest get -inf.

    logits: [batch, vocab]. top_k=0 and top_p=1 turn each filter off. Top-p keeps the smallest set
    of most probable tokens whose probability (renormalised after top-k) reaches top_p, up to
    TOP_P_TOLERANCE. Ties are broken by token id (lower id first), so exactly top_k tokens survive
    top-k and the kept set is deterministic. Returns [batch, vocab], kept logits unchanged.
    """
    DecodeConfig("sample", top_k=top_k, top_p=top_p)
    if np.ndim(logits) != 2:
        raise ValueError(f"logits must be [batch, vocab] (rank 2); got shape {np.shape(logits)}")
    return _filter_logits(logits, top_k=int(top_k), top_p=float(top_p))


@functools.partial(cpu_compile.jit, static_argnames=("top_k", "top_p"))
def _filter_logits(logits: jax.Array, *, top_k: int, top_p: float) -> jax.Array:
    if top_k == 0 and top_p >= 1.0:
        return logits
    vocab = logits.shape[-1]
    # Stable sort on the negated logits: descending, equal logits keep token-id order.
    order = jnp.argsort(-logits, axis=-1, stable=True)  # [batch, vocab]
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    rank = jnp.arange(vocab)
    keep_sorted = jnp.ones(logits.shape, bool)
    if 0 < top_k < vocab:
        keep_sorted = rank < top_k
        sorted_logits = jnp.where(keep_sorted, sorted_logits, -jnp.inf)
    if top_p < 1.0:
        probs = jax.nn.softmax(sorted_logits.astype(jnp.float32), axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # mass of the strictly better tokens
        # A token is needed while the better ones have not reached top_p; the best always stays.
        keep_sorted = keep_sorted & ((mass_before < top_p - TOP_P_TOLERANCE) | (rank == 0))
    inverse = jnp.argsort(order, axis=-1)
    keep = jnp.take_along_axis(jnp.broadcast_to(keep_sorted, logits.shape), inverse, axis=-1)
    return jnp.where(keep, logits, -jnp.inf)


# ---------------------------------------------------------------------------------------------
# Greedy and sampling: one token per row per step


class _SequentialState(NamedTuple):
    step: jax.Array  # [] int32, tokens generated so far (same for every row)
    tokens: jax.Array  # [batch, max_new_tokens]
    last: jax.Array  # [batch], the token to feed next
    lengths: jax.Array  # [batch]
    scores: jax.Array  # [batch]
    done: jax.Array  # [batch] bool
    cache: Cache


@functools.partial(
    cpu_compile.jit,
    static_argnames=(
        "tokens_to_logits", "max_new_tokens", "eos_id", "pad_id", "sampling", "ends",
        "grow_cache",
    ),
)
def _decode_sequential(
    tokens_to_logits: TokensToLogits,
    initial_logits: jax.Array,
    cache: Cache,
    rng: jax.Array | None,
    max_new_per_row: jax.Array | None,
    *,
    max_new_tokens: int,
    eos_id: int | None,
    pad_id: int,
    sampling: tuple[float, int, float] | None,
    ends: tuple[int, ...],
    grow_cache: GrowCache | None,
) -> DecodeOutput:
    """The loop shared by greedy (sampling=None) and sampling ((temperature, top_k, top_p))."""
    batch = initial_logits.shape[0]
    limits = _row_limits(max_new_per_row, batch, max_new_tokens)

    def choose(logits: jax.Array, step: jax.Array) -> tuple[jax.Array, jax.Array]:
        """logits: [batch, vocab] -> (token [batch], its log-probability [batch])."""
        if sampling is None:
            token = jnp.argmax(logits, axis=-1)  # ties: lowest token id
        else:
            temperature, top_k, top_p = sampling
            logits = logits / temperature
            filtered = _filter_logits(logits, top_k=top_k, top_p=top_p)
            token = jax.random.categorical(jax.random.fold_in(rng, step), filtered, axis=-1)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
        return token, jnp.take_along_axis(log_probs, token[:, None], axis=-1)[:, 0]

    def advance(state: _SequentialState, logits: jax.Array) -> _SequentialState:
        """Picks each active row's next token from logits: [batch, vocab] float32."""
        token, log_prob = choose(logits, state.step)
        active = ~state.done
        token = jnp.where(active, token, pad_id).astype(jnp.int32)
        lengths = state.lengths + active.astype(jnp.int32)
        return state._replace(
            step=state.step + 1,
            tokens=state.tokens.at[:, state.step].set(token),
            last=token,
            lengths=lengths,
            scores=state.scores + jnp.where(active, log_prob, 0.0),
            done=state.done | (active & _is_eos(token, eos_id)) | (lengths >= limits),
        )

    def body(state: _SequentialState) -> _SequentialState:
        logits, cache = tokens_to_logits(state.last[:, None], state.cache)
        return advance(state._replace(cache=cache), logits[:, -1].astype(jnp.float32))

    state = _SequentialState(
        step=jnp.zeros((), jnp.int32),
        tokens=jnp.full((batch, max_new_tokens), pad_id, jnp.int32),
        last=jnp.full((batch,), pad_id, jnp.int32),
        lengths=jnp.zeros((batch,), jnp.int32),
        scores=jnp.zeros((batch,), jnp.float32),
        done=limits <= 0,
        cache=cache,
    )
    # The first token comes from initial_logits; each loop step runs the model on the last
    # token, then picks the next one. So the model runs once per token after the first and
    # never after the last, with no per-step branch.
    state = advance(state, initial_logits.astype(jnp.float32))
    state = _loop_segments(body, state, ends, grow_cache)
    return DecodeOutput(tokens=state.tokens, lengths=state.lengths, scores=state.scores)


def greedy(
    tokens_to_logits: TokensToLogits,
    initial_logits: jax.Array,
    cache: Cache,
    *,
    max_new_tokens: int,
    eos_id: int | None,
    pad_id: int = 0,
    max_new_per_row: jax.Array | None = None,
    grow_cache: GrowCache | None = None,
    cache_segments: int = 1,
) -> DecodeOutput:
    """Greedy decoding: the most probable token at every step (ties: lowest id).

    initial_logits: [batch, vocab]; cache: pytree with batch-leading leaves;
    max_new_per_row: [batch] int budgets (clipped to max_new_tokens), None = max_new_tokens.
    grow_cache: with it, `cache` has room for the prompt only and grows as the loop runs in
    `cache_segments` segments (see the module docstring); without it, `cache` has room for
    prompt + max_new_tokens - 1 tokens.
    """
    _check_common(initial_logits, max_new_tokens, eos_id, pad_id, max_new_per_row)
    DecodeConfig("greedy", max_new_tokens, cache_segments=cache_segments)
    check_cache_rows(cache, len(initial_logits), max_new_tokens, grow_cache)
    return _decode_sequential(
        tokens_to_logits, initial_logits, cache, None, max_new_per_row,
        max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id, sampling=None,
        ends=_segments(max_new_tokens, grow_cache, cache_segments), grow_cache=grow_cache,
    )


def sample(
    tokens_to_logits: TokensToLogits,
    initial_logits: jax.Array,
    cache: Cache,
    rng: jax.Array,
    *,
    max_new_tokens: int,
    eos_id: int | None,
    pad_id: int = 0,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    max_new_per_row: jax.Array | None = None,
    grow_cache: GrowCache | None = None,
    cache_segments: int = 1,
) -> DecodeOutput:
    """Ancestral sampling from softmax(logits / temperature), filtered by `filter_logits`.

    initial_logits: [batch, vocab]; rng: a PRNG key (step t uses fold_in(rng, t), so the same key
    gives the same samples); top_k=0 / top_p=1 are off; top_k=1 is greedy. Scores are
    log-probabilities under the temperature-adjusted distribution before top-k/top-p filtering.
    temperature, top_k and top_p are compile-time constants (a new value compiles again).
    grow_cache, cache_segments: as in `greedy`.
    """
    _check_common(initial_logits, max_new_tokens, eos_id, pad_id, max_new_per_row)
    DecodeConfig("sample", max_new_tokens, temperature, top_k, top_p,
                 cache_segments=cache_segments)
    check_cache_rows(cache, len(initial_logits), max_new_tokens, grow_cache)
    return _decode_sequential(
        tokens_to_logits, initial_logits, cache, rng, max_new_per_row,
        max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
        sampling=(float(temperature), int(top_k), float(top_p)),
        ends=_segments(max_new_tokens, grow_cache, cache_segments), grow_cache=grow_cache,
    )


# ---------------------------------------------------------------------------------------------
# Beam search


def length_penalty(lengths: jax.Array, alpha: float) -> jax.Array:
    """GNMT length penalty ((5 + length) / 6) ** alpha (Wu et al. 2016, sec. 7); same shape."""
    return ((5.0 + jnp.asarray(lengths, jnp.float32)) / 6.0) ** alpha


# The log-probability and score of an empty hypothesis slot (float32, like the scores).
_NEG_INF = np.float32(-np.inf)


class _BeamState(NamedTuple):
    step: jax.Array  # [] int32, tokens generated so far by rows still running
    live_seqs: jax.Array  # [batch, beam, max_new_tokens], never contain EOS
    live_log_probs: jax.Array  # [batch, beam], sorted descending, -inf = no hypothesis
    finished_seqs: jax.Array  # [batch, beam, max_new_tokens]
    finished_scores: jax.Array  # [batch, beam], length-penalised, sorted descending
    finished_log_probs: jax.Array  # [batch, beam]
    finished_lengths: jax.Array  # [batch, beam]
    row_steps: jax.Array  # [batch], tokens the row generated before it stopped
    done: jax.Array  # [batch] bool
    cache: Cache  # leaves [batch * beam, ...]


def _rows(mask: jax.Array, like: jax.Array) -> jax.Array:
    """Broadcasts a [batch] mask against an array with batch on axis 0."""
    return mask.reshape(mask.shape + (1,) * (like.ndim - 1))


_BEAM_STATIC = (
    "tokens_to_logits", "beam_size", "max_new_tokens", "eos_id", "pad_id", "alpha", "ends",
    "grow_cache", "reorder_cache",
)


# Beam search picks its 2 * beam candidates among beam * vocab scores per row through the maxima of
# blocks of this many scores when a row has at least TOP_K_BLOCKS_FROM of them: the same values and
# indices as one lax.top_k, and faster on CPU (XLA CPU's TopK visits every score with a
# comparator; a block maximum is a vectorised reduction).
TOP_K_BLOCK = 128
TOP_K_BLOCKS_FROM = 8192


def _top_k(scores: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k(scores, k) for scores [rows, n]: values and indices [rows, k], ties to the lower
    index. Long rows go through block maxima: the k best scores lie in the k blocks with the
    largest maxima (ties to the lower block), because any score outside them is beaten by the
    maximum of each of those k blocks; one top_k over those blocks, in index order, finishes."""
    rows, n = scores.shape
    if n < TOP_K_BLOCKS_FROM or k * TOP_K_BLOCK >= n:
        return jax.lax.top_k(scores, k)
    pad = -n % TOP_K_BLOCK  # padding scores -inf, at the highest indices: never picked first
    padded = jnp.pad(scores, ((0, 0), (0, pad)), constant_values=-jnp.inf) if pad else scores
    blocks = padded.reshape(rows, -1, TOP_K_BLOCK)  # [rows, n_blocks, block]
    _, best_blocks = jax.lax.top_k(blocks.max(axis=-1), k)  # [rows, k]
    best_blocks = jnp.sort(best_blocks, axis=-1)  # index order keeps lax.top_k's tie order
    candidates = jnp.take_along_axis(blocks, best_blocks[:, :, None], axis=1)
    values, position = jax.lax.top_k(candidates.reshape(rows, -1), k)
    block = jnp.take_along_axis(best_blocks, position // TOP_K_BLOCK, axis=1)
    return values, block * TOP_K_BLOCK + position % TOP_K_BLOCK


def _gather_rows(cache: Cache, index: jax.Array) -> Cache:
    """The generic beam reorder: one gather per leaf."""
    return jax.tree.map(lambda x: x[index], cache)


@dataclasses.dataclass(frozen=True)
class _BeamSettings:
    """The compile-time settings a beam step needs, passed as one value to the step functions.

    reorder_cache: None = `_gather_rows`.
    """

    beams: int
    eos_id: int | None
    alpha: float
    reorder_cache: ReorderCache | None


class _Candidates(NamedTuple):
    """The best 2 * beam continuations of one step, per row, best first."""

    log_probs: jax.Array  # [batch, 2 * beam]
    parent: jax.Array  # [batch, 2 * beam], the alive beam each one extends
    seqs: jax.Array  # [batch, 2 * beam, max_new_tokens], the parent's tokens plus the new one
    is_eos: jax.Array  # [batch, 2 * beam] bool, the new token is EOS


def _initial_beam_state(
    cache: Cache, limits: jax.Array, beams: int, max_new_tokens: int, pad_id: int
) -> _BeamState:
    """The state before the first token: no hypotheses, the cache repeated for each beam, and
    only beam 0 alive, so the first step does not pick the same token `beams` times.

    limits: [batch] int32 token budgets; a row with none left starts done.
    """
    batch = limits.shape[0]
    first_live = jnp.where(jnp.arange(beams) == 0, 0.0, _NEG_INF).astype(jnp.float32)
    return _BeamState(
        step=jnp.zeros((), jnp.int32),
        live_seqs=jnp.full((batch, beams, max_new_tokens), pad_id, jnp.int32),
        live_log_probs=jnp.broadcast_to(first_live, (batch, beams)),
        finished_seqs=jnp.full((batch, beams, max_new_tokens), pad_id, jnp.int32),
        finished_scores=jnp.full((batch, beams), _NEG_INF),
        finished_log_probs=jnp.full((batch, beams), _NEG_INF),
        finished_lengths=jnp.zeros((batch, beams), jnp.int32),
        row_steps=jnp.zeros((batch,), jnp.int32),
        done=limits <= 0,
        cache=jax.tree.map(lambda x: jnp.repeat(x, beams, axis=0), cache),
    )


def _top_candidates(
    state: _BeamState, log_probs: jax.Array, eos_id: int | None
) -> _Candidates:
    """The best 2 * beam continuations of the alive beams, written at position state.step. Each
    parent adds at most one EOS, so at least `beam` of them stay for the alive set.

    log_probs: [batch, beam, vocab] next-token log-probabilities of each alive beam.
    """
    batch, beams, vocab = log_probs.shape
    num_candidates = min(2 * beams, beams * vocab)
    totals = (state.live_log_probs[:, :, None] + log_probs).reshape(batch, -1)
    top_log_probs, top_index = _top_k(totals, num_candidates)  # [batch, 2 * beam]
    parent, token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
    seqs = jnp.take_along_axis(state.live_seqs, parent[:, :, None], axis=1)
    seqs = jax.lax.dynamic_update_slice(seqs, token[:, :, None], (0, 0, state.step))
    return _Candidates(top_log_probs, parent, seqs, _is_eos(token, eos_id))


def _alive_beams(
    candidates: _Candidates, beams: int
) -> tuple[dict[str, jax.Array], jax.Array]:
    """The best `beams` candidates that did not end: the state's live_* fields and the parent
    beam of each ([batch, beam])."""
    live_log_probs, pick = jax.lax.top_k(
        jnp.where(candidates.is_eos, _NEG_INF, candidates.log_probs), beams
    )
    live_seqs = jnp.take_along_axis(candidates.seqs, pick[:, :, None], axis=1)
    live_parent = jnp.take_along_axis(candidates.parent, pick, axis=1)
    return dict(live_seqs=live_seqs, live_log_probs=live_log_probs), live_parent


def _take_along_beams(pick: jax.Array, old: jax.Array, new: jax.Array) -> jax.Array:
    """Beams `pick` ([batch, k]) of old and new joined along axis 1 (both [batch, n, ...])."""
    both = jnp.concatenate([old, new], axis=1)
    index = pick.reshape(pick.shape + (1,) * (both.ndim - 2))
    return jnp.take_along_axis(both, index, axis=1)


def _finished_beams(
    state: _BeamState, candidates: _Candidates, settings: _BeamSettings
) -> dict[str, jax.Array]:
    """The state's finished_* fields after merging the candidates that ended at this step into
    the best `beams` finished hypotheses so far (by length-penalised score)."""
    length = state.step + 1
    new_lengths = jnp.full(candidates.log_probs.shape, length, jnp.int32)
    new_log_probs = jnp.where(candidates.is_eos, candidates.log_probs, _NEG_INF)
    new_scores = new_log_probs / length_penalty(length, settings.alpha)
    all_scores = jnp.concatenate([state.finished_scores, new_scores], axis=1)
    finished_scores, pick = jax.lax.top_k(all_scores, settings.beams)
    merge = functools.partial(_take_along_beams, pick)
    return dict(
        finished_seqs=merge(state.finished_seqs, candidates.seqs),
        finished_scores=finished_scores,
        finished_log_probs=merge(state.finished_log_probs, new_log_probs),
        finished_lengths=merge(state.finished_lengths, new_lengths),
    )


def _unless_stopped(
    stopped: jax.Array, fields: dict[str, jax.Array], state: _BeamState
) -> dict[str, jax.Array]:
    """`fields` of the state, except that rows that had stopped keep their old values.

    stopped: [batch] bool; each field has batch on axis 0.
    """
    return {
        name: jnp.where(_rows(stopped, new), getattr(state, name), new)
        for name, new in fields.items()
    }


def _rows_done(
    was_done: jax.Array,
    live_log_probs: jax.Array,
    finished_scores: jax.Array,
    row_steps: jax.Array,
    limits: jax.Array,
    alpha: float,
) -> jax.Array:
    """Which rows are done ([batch] bool): done before, out of budget, or no alive beam can beat
    the worst finished one. Log-probs only fall, so the best an alive beam can reach is its
    current log-prob over the largest penalty of a length it could still end at (row_steps + 1 ..
    limit; the penalty is monotonic).

    was_done, row_steps, limits: [batch]; live_log_probs, finished_scores: [batch, beam], sorted
    descending.
    """
    best_penalty = jnp.maximum(
        length_penalty(row_steps + 1, alpha), length_penalty(limits, alpha)
    )
    best_alive = live_log_probs[:, 0] / best_penalty
    worst_finished = finished_scores[:, -1]  # -inf until `beam` hypotheses finished
    return was_done | (row_steps >= limits) | (worst_finished >= best_alive)


def _parent_rows(stopped: jax.Array, live_parent: jax.Array) -> jax.Array:
    """The cache row each row takes so row b * beam + j holds the history of alive beam j; rows
    that stopped keep theirs.

    stopped: [batch] bool; live_parent: [batch, beam]. Returns [batch * beam] int.
    """
    batch, beams = live_parent.shape
    source = jnp.where(stopped[:, None], jnp.arange(beams)[None, :], live_parent)
    return (jnp.arange(batch)[:, None] * beams + source).reshape(-1)


def _advance_beams(
    state: _BeamState, log_probs: jax.Array, limits: jax.Array, settings: _BeamSettings
) -> _BeamState:
    """One beam step: extends the alive beams by one token, keeps the best alive and finished
    hypotheses, and reorders the cache to match.

    log_probs: [batch, beam, vocab] next-token log-probabilities; limits: [batch] budgets.
    """
    candidates = _top_candidates(state, log_probs, settings.eos_id)
    live, live_parent = _alive_beams(candidates, settings.beams)
    finished = _finished_beams(state, candidates, settings)
    stopped = state.done  # rows that stopped keep their state
    kept = _unless_stopped(stopped, {**live, **finished}, state)
    row_steps = state.row_steps + (~stopped).astype(jnp.int32)
    done = _rows_done(
        state.done, kept["live_log_probs"], kept["finished_scores"], row_steps, limits,
        settings.alpha,
    )
    reorder = settings.reorder_cache or _gather_rows
    return state._replace(
        step=state.step + 1,
        **kept,
        row_steps=row_steps,
        done=done,
        cache=reorder(state.cache, _parent_rows(stopped, live_parent)),
    )


def _beam_loop_step(
    tokens_to_logits: TokensToLogits,
    limits: jax.Array,
    settings: _BeamSettings,
    state: _BeamState,
) -> _BeamState:
    """The while loop's body: runs the model on the alive beams' last tokens, then advances.

    limits: [batch] budgets.
    """
    batch, beams = state.live_log_probs.shape
    last = jax.lax.dynamic_index_in_dim(state.live_seqs, state.step - 1, axis=2, keepdims=False)
    logits, cache = tokens_to_logits(last.reshape(batch * beams, 1), state.cache)
    log_probs = jax.nn.log_softmax(logits[:, -1].astype(jnp.float32), axis=-1)
    return _advance_beams(
        state._replace(cache=cache), log_probs.reshape(batch, beams, -1), limits, settings
    )


def _beam_output(state: _BeamState, pad_id: int, alpha: float) -> BeamOutput:
    """The finished hypotheses of each row; a row with none returns its alive beams, scored at
    their length. Empty slots get pad tokens, length 0 and score -inf."""
    live_real = state.live_log_probs > _NEG_INF
    live_lengths = jnp.where(live_real, state.row_steps[:, None], 0)
    live_scores = state.live_log_probs / length_penalty(state.row_steps, alpha)[:, None]
    use_live = state.finished_scores[:, 0] == _NEG_INF
    pick = lambda live, finished: jnp.where(_rows(use_live, live), live, finished)
    scores = pick(live_scores, state.finished_scores)
    real = scores > _NEG_INF
    tokens = pick(state.live_seqs, state.finished_seqs)
    return BeamOutput(
        tokens=jnp.where(real[:, :, None], tokens, pad_id),
        lengths=jnp.where(real, pick(live_lengths, state.finished_lengths), 0),
        scores=scores,
        log_probs=pick(state.live_log_probs, state.finished_log_probs),
    )


@functools.partial(cpu_compile.jit, static_argnames=_BEAM_STATIC)
def _beam_search(
    tokens_to_logits: TokensToLogits,
    initial_logits: jax.Array,
    cache: Cache,
    max_new_per_row: jax.Array | None,
    *,
    beam_size: int,
    max_new_tokens: int,
    eos_id: int | None,
    pad_id: int,
    alpha: float,
    ends: tuple[int, ...],
    grow_cache: GrowCache | None,
    reorder_cache: ReorderCache | None,
) -> BeamOutput:
    """The beam-search loop; arguments as in `beam_search`, validated there."""
    batch, vocab = initial_logits.shape
    limits = _row_limits(max_new_per_row, batch, max_new_tokens)
    settings = _BeamSettings(beam_size, eos_id, alpha, reorder_cache)
    state = _initial_beam_state(cache, limits, beam_size, max_new_tokens, pad_id)
    # The first step expands the initial logits; each loop step runs the model on the alive
    # beams' last tokens, then advances (no per-step branch).
    initial_log_probs = jax.nn.log_softmax(initial_logits.astype(jnp.float32), axis=-1)
    state = _advance_beams(
        state, jnp.broadcast_to(initial_log_probs[:, None], (batch, beam_size, vocab)), limits,
        settings,
    )
    body = functools.partial(_beam_loop_step, tokens_to_logits, limits, settings)
    state = _loop_segments(body, state, ends, grow_cache)
    return _beam_output(state, pad_id, alpha)


def beam_search(
    tokens_to_logits: TokensToLogits,
    initial_logits: jax.Array,
    cache: Cache,
    *,
    beam_size: int,
    max_new_tokens: int,
    eos_id: int | None,
    pad_id: int = 0,
    alpha: float = 0.6,
    max_new_per_row: jax.Array | None = None,
    grow_cache: GrowCache | None = None,
    cache_segments: int = 1,
    reorder_cache: ReorderCache | None = None,
) -> BeamOutput:
    """Beam search with the GNMT length penalty, alive/finished bookkeeping as in tensor2tensor.

    initial_logits: [batch, vocab]; cache: pytree with batch-leading leaves, expanded here to
    [batch * beam_size, ...]; max_new_per_row: [batch] int budgets (e.g. source length + 50).
    Keeps `beam_size` alive and `beam_size` finished hypotheses per row; a row stops when no alive
    beam can beat its worst finished one (exact: the result equals running to the budget), or at
    its budget. Rows that finish nothing return their
    alive beams. The Transformer paper uses beam_size=4, alpha=0.6 (Vaswani et al. 2017, sec. 6.1).
    beam_size=1 equals greedy unless EOS is ever the runner-up token: that earlier exit is kept as
    a finished hypothesis and may win on score. grow_cache, cache_segments: as in `greedy`
    (the cache grows after its expansion to batch * beam_size rows). reorder_cache: moves the
    cache's rows to their beams' parents after each step (default: gathers every leaf).
    """
    _check_common(initial_logits, max_new_tokens, eos_id, pad_id, max_new_per_row)
    DecodeConfig("beam", max_new_tokens, beam_size=beam_size, alpha=alpha,
                 cache_segments=cache_segments)
    check_cache_rows(cache, len(initial_logits), max_new_tokens, grow_cache)
    return _beam_search(
        tokens_to_logits, initial_logits, cache, max_new_per_row, beam_size=beam_size,
        max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id, alpha=float(alpha),
        ends=_segments(max_new_tokens, grow_cache, cache_segments), grow_cache=grow_cache,
        reorder_cache=reorder_cache,
    )


def decode(
    tokens_to_logits: TokensToLogits,
    initial_logits: jax.Array,  # [batch, vocab]
    cache: Cache,
    rng: jax.Array,
    config: DecodeConfig,
    *,
    max_new_tokens: int,
    eos_id: int | None,
    pad_id: int = 0,
    max_new_per_row: jax.Array | None = None,  # [batch]
    grow_cache: GrowCache | None = None,
    reorder_cache: ReorderCache | None = None,
) -> DecodeOutput | BeamOutput:
    """Runs `config.method` with its options; `max_new_tokens` is the resolved budget (the
    config's, or source length + extra_len for an encoder-decoder). With grow_cache, `cache` has
    room for the prompt only and grows in config.cache_segments segments (see `greedy`);
    without it, config.cache_segments is not used (the cache already has its final size).
    reorder_cache: how beam search moves cache rows to their parents (see `beam_search`)."""
    common = dict(
        max_new_tokens=max_new_tokens, eos_id=eos_id, pad_id=pad_id,
        max_new_per_row=max_new_per_row, grow_cache=grow_cache,
        cache_segments=config.cache_segments if grow_cache is not None else 1,
    )
    if config.method == "greedy":
        return greedy(tokens_to_logits, initial_logits, cache, **common)
    if config.method == "sample":
        return sample(
            tokens_to_logits, initial_logits, cache, rng, temperature=config.temperature,
            top_k=config.top_k, top_p=config.top_p, **common,
        )
    return beam_search(
        tokens_to_logits, initial_logits, cache, beam_size=config.beam_size,
        alpha=config.alpha, reorder_cache=reorder_cache, **common,
    )
