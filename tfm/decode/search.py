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

This module is the entry point (`decode` runs a DecodeConfig) and names every public piece; they
live by job in tfm/decode/loop.py (DecodeConfig, outputs, checks, segments), sampling.py (greedy,
sampling, filter_logits) and beam.py (beam search).
"""

from __future__ import annotations

import jax

from tfm.decode.beam import (  # noqa: F401  (public names of tfm.decode.search)
    TOP_K_BLOCK,
    TOP_K_BLOCKS_FROM,
    beam_search,
    length_penalty,
)
from tfm.decode.loop import (  # noqa: F401  (public names of tfm.decode.search)
    METHODS,
    MIN_SEGMENT_STEPS,
    TOP_P_TOLERANCE,
    BeamOutput,
    Cache,
    DecodeConfig,
    DecodeOutput,
    GrowCache,
    ReorderCache,
    TokensToLogits,
    check_cache_rows,
    check_eos_id,
    segment_ends,
)
from tfm.decode.sampling import filter_logits, greedy, sample  # noqa: F401


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
