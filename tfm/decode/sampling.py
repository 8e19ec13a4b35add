"""Greedy decoding and sampling (temperature, top-k, top-p) inside jit: one token per row per
step, against the `tokens_to_logits` callback (tfm/decode/search.py has the contract).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tfm.decode.loop import (
    TOP_P_TOLERANCE,
    Cache,
    DecodeConfig,
    DecodeOutput,
    GrowCache,
    TokensToLogits,
    _check_common,
    _is_eos,
    _loop_segments,
    _row_limits,
    _segments,
    check_cache_rows,
)
from tfm.kernels import cpu_compile


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
