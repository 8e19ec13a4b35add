"""Beam search inside jit with the GNMT length penalty (Wu et al. 2016, sec. 7), alive/finished
bookkeeping as in tensor2tensor, against the `tokens_to_logits` callback (tfm/decode/search.py
has the contract).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from tfm.decode.loop import (
    BeamOutput,
    Cache,
    DecodeConfig,
    GrowCache,
    ReorderCache,
    TokensToLogits,
    _check_common,
    _is_eos,
    _loop_segments,
    _row_limits,
    _segments,
    check_cache_rows,
)
from tfm.kernels import cpu_compile
from tfm.nn.cache import take_beams


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


def _gather_rows(cache: Cache, parents: jax.Array) -> Cache:  # parents: [batch, beam] int
    """The generic beam reorder: one gather per leaf, within each source's beams."""
    return jax.tree.map(lambda x: take_beams(x, parents), cache)


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


def _parent_beams(stopped: jax.Array, live_parent: jax.Array) -> jax.Array:
    """The beam whose cache row each beam takes, among its own source's beams, so beam j holds
    the history of alive beam j; rows that stopped keep theirs.

    stopped: [batch] bool; live_parent: [batch, beam]. Returns [batch, beam] int.
    """
    beams = live_parent.shape[1]
    return jnp.where(stopped[:, None], jnp.arange(beams)[None, :], live_parent)


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
        cache=reorder(state.cache, _parent_beams(stopped, live_parent)),
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
    cache's rows to their beams' parents after each step, given each beam's parent among its
    source's beams ([batch, beam_size] int; default: `take_beams` on every leaf).
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
