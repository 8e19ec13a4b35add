"""The adapter's pure parts: rows from (context, continuation) pairs as the harness's `hf` model
builds them, batches by length with explicit lengths, and the jitted scoring step."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval import utils as harness_utils

from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM

MIN_WIDTH = 8


@dataclasses.dataclass(frozen=True)
class ScoringRow:
    """One row to score: `inputs` fed to the model, `targets` the next token at each input
    position (both [length]), the last `num_scored` targets being the continuation."""

    inputs: tuple[int, ...]
    targets: tuple[int, ...]
    num_scored: int


def scoring_row(
    context_ids: Sequence[int], continuation_ids: Sequence[int], max_length: int
) -> ScoringRow:
    """The row scoring `continuation_ids` after `context_ids`: the last max_length + 1 tokens of
    both, the final continuation token not fed to the model (it is only a target)."""
    if not continuation_ids:
        raise ValueError("a continuation needs at least one token")
    if len(continuation_ids) > max_length:
        raise ValueError(
            f"a continuation of {len(continuation_ids)} tokens does not fit max_length="
            f"{max_length}"
        )
    if not context_ids:
        raise ValueError("a context needs at least one token (the prefix token when empty)")
    whole = [*context_ids, *continuation_ids][-(max_length + 1):]
    return ScoringRow(tuple(whole[:-1]), tuple(whole[1:]), len(continuation_ids))


def rolling_windows(
    token_ids: Sequence[int], prefix_id: int, max_length: int
) -> list[tuple[list[int], list[int]]]:
    """(context, continuation) pairs that score every token of a document once, each with as
    much context as fits max_length: the harness's windows (get_rolling_token_windows,
    context_len=1) made disjoint (make_disjoint_window), as its `hf` model scores them."""
    return [
        harness_utils.make_disjoint_window(window)
        for window in harness_utils.get_rolling_token_windows(
            token_list=list(token_ids), prefix_token=prefix_id, max_seq_len=max_length,
            context_len=1,
        )
    ]


def length_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Indices of `lengths` in batches of at most batch_size, longest rows first (the first
    batch shows at once whether the longest rows fit in memory; similar lengths share a batch)."""
    order = sorted(range(len(lengths)), key=lambda index: (-lengths[index], index))
    return [order[start:start + batch_size] for start in range(0, len(order), batch_size)]


def bucket_width(longest: int, max_width: int) -> int:
    """The batch width for rows of up to `longest` tokens: the next power of two (at least
    MIN_WIDTH), at most max_width, so that few shapes compile."""
    width = max(MIN_WIDTH, 1 << max(0, longest - 1).bit_length())
    return max(longest, min(width, max_width))


def pad_rows(
    rows: Sequence[Sequence[int]], width: int, batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded tokens [batch_size, width] int32 and lengths [batch_size] int32 of `rows`;
    missing rows repeat the last one (one compiled shape), and are dropped by the caller. The
    filler after a row's length is 0 and is never attended to or scored."""
    tokens = np.zeros((batch_size, width), np.int32)
    lengths = np.zeros((batch_size,), np.int32)
    for index in range(batch_size):
        row = rows[min(index, len(rows) - 1)]
        tokens[index, :len(row)] = row
        lengths[index] = len(row)
    return tokens, lengths


def scored_positions(lengths: jax.Array, num_scored: jax.Array, width: int) -> jax.Array:
    """[batch, width] bool: the last num_scored [batch] of the lengths [batch] valid positions."""
    position = jnp.arange(width)[None, :]
    return (position < lengths[:, None]) & (position >= (lengths - num_scored)[:, None])


def score_from_logits(
    logits: jax.Array,  # [batch, width, vocab]
    targets: jax.Array,  # [batch, width] int
    scored: jax.Array,  # [batch, width] bool
) -> tuple[jax.Array, jax.Array]:
    """Sum of log p(target) over the scored positions [batch] float32, and whether each scored
    target is the argmax there [batch] bool (the continuation is the greedy one)."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    target_log_probs = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    total = jnp.sum(jnp.where(scored, target_log_probs, 0.0), axis=-1)
    greedy = jnp.all(~scored | (jnp.argmax(logits, axis=-1) == targets), axis=-1)
    return total, greedy


def cut_at_stop(text: str, until: Iterable[str]) -> str:
    """`text` up to the first occurrence of any stop string (empty strings ignored)."""
    cut = len(text)
    for stop in until:
        if stop:
            found = text.find(stop)
            if found != -1:
                cut = min(cut, found)
    return text[:cut]


@functools.partial(jax.jit, static_argnames=("config",))
def score_rows(
    params: Any,
    tokens: jax.Array,  # [batch, width] int32, right-padded
    targets: jax.Array,  # [batch, width] int32
    lengths: jax.Array,  # [batch] int32: valid tokens per row
    num_scored: jax.Array,  # [batch] int32: scored targets, the last of each row's valid ones
    config: ModelConfig,
) -> tuple[jax.Array, jax.Array]:
    """(log-likelihood [batch] float32, is_greedy [batch] bool) of each row's scored targets
    under the decoder-only LM `config` with `params`."""
    width = tokens.shape[1]
    valid = jnp.arange(width)[None, :] < lengths[:, None]
    logits = DecoderLM(config).apply({"params": params}, tokens, valid=valid)
    return score_from_logits(logits, targets, scored_positions(lengths, num_scored, width))
