"""The prompt's prefill: the whole prompt in one call, or `chunk` tokens at a time.

A chunk attends to the KV cache written so far and to itself, causally (tfm.nn.context:
query i of a chunk sits in slot write_index + i), so activations scale with the chunk, not
the prompt. On TPU a chunk of at least one block (128 queries) reads the cache through the
flex kernel with the row's query offset, the position bias from global positions
(tfm.kernels.per_device.chunk_of_cache): no [chunk, cache_len] score, bias or mask array.
The chunks run in one lax.scan (one compiled model call); the prompt is padded to whole
chunks, so the cache holds `padded_length` slots, the padding's keys past each row's end, where
decoding overwrites them before any query can see them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from tfm.nn.cache import DecoderCache

# (tokens [batch, len], cache, logits_at [batch] int, positions [batch, len] int or None) ->
# (logits [batch, 1, vocab], cache): the model's cached call, asked for one index's logits per
# row, at the given positions (None: the cache's).
ApplyAt = Callable[[jax.Array, DecoderCache, jax.Array, jax.Array | None],
                   tuple[jax.Array, DecoderCache]]


def padded_length(prompt_len: int, chunk: int) -> int:
    """The cache slots a prefill of `prompt_len` tokens writes: whole chunks (chunk 0: one)."""
    if chunk <= 0 or chunk >= prompt_len:
        return prompt_len
    return -(-prompt_len // chunk) * chunk


def prefill(
    apply_at: ApplyAt,
    prompts: jax.Array,  # [batch, prompt_len] int, right-padded
    last: jax.Array,  # [batch] int, each row's last prompt index (prompt length - 1)
    cache: DecoderCache,  # empty, padded_length(prompt_len, chunk) slots
    chunk: int = 0,  # tokens per call; 0 = the whole prompt in one call
) -> tuple[jax.Array, DecoderCache]:  # logits [batch, vocab] at `last`, the filled cache
    """Runs the prompts through the model into `cache`: in one call, or in chunks of `chunk`
    tokens, one lax.scan step each. Returns each row's logits at its last prompt token."""
    batch, prompt_len = prompts.shape
    slots = padded_length(prompt_len, chunk)
    if cache.max_len != slots:
        raise ValueError(f"the prefill of {prompt_len} tokens in chunks of {chunk} writes {slots} "
                         f"slots, but the cache has {cache.max_len}; build it with "
                         "init_cache(config, batch, padded_length(prompt_len, chunk))")
    if not 0 < chunk < prompt_len:  # one call that fills the cache: a full pass's kernels
        logits, cache = apply_at(prompts, cache, last, None)
        return logits[:, 0], cache
    count = slots // chunk
    pieces = jnp.pad(prompts, ((0, 0), (0, slots - prompt_len)))
    pieces = pieces.reshape(batch, count, chunk).swapaxes(0, 1)  # [count, batch, chunk]
    starts = jnp.arange(count, dtype=jnp.int32) * chunk
    # The padding past the prompt repeats its last position: a learned table has no row past
    # max_len (NaN there, which would reach the outputs through zero weights times NaN values).
    index = jnp.arange(chunk, dtype=jnp.int32)
    shape = jax.eval_shape(apply_at, pieces[0], cache, last, None)[0]  # [batch, 1, vocab]

    def step(carry, piece_and_start):
        cache, logits = carry
        piece, start = piece_and_start
        here = (last >= start) & (last < start + chunk)  # [batch]: this chunk holds the end
        at = jnp.broadcast_to(jnp.minimum(index + start, prompt_len - 1), piece.shape)
        new, cache = apply_at(piece, cache, jnp.clip(last - start, 0, chunk - 1), at)
        return (cache, jnp.where(here[:, None], new[:, 0], logits)), None

    init = (cache, jnp.zeros((batch, shape.shape[-1]), shape.dtype))
    (cache, logits), _ = jax.lax.scan(step, init, (pieces, starts))
    return logits, cache
