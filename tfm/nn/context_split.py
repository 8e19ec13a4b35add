"""The model's side of context parallelism (mesh.context > 1): a decoder's rows are reordered
once before the embedding (causal load balancing, tfm.kernels.context_parallel.load_balance)
and restored once after the last block; an encoder's rows are split into contiguous chunks
(bidirectional attention costs the same per query, so there is nothing to balance, and its
output stays in the original order). In between every layer is per token except attention,
which runs tfm.kernels.context_parallel on the mask by parts (SequenceMask) and the position
bias by blocks, both from each token's original index, segment and position. Cross-attention
takes each device's decoder queries against the whole source, gathered over the axis."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm.kernels import context_parallel
from tfm.kernels.call import AttentionStructure
from tfm.nn.config import ModelConfig
from tfm.nn.context import LayerContext

Array = jax.Array


def shards_for(tokens: Array, runs_whole: bool, balanced: bool = True) -> int:
    """How many devices split these rows' sequence: the mesh's context axis for full passes
    whose length splits into 2 x context chunks (`balanced`, causal load balancing) or context
    chunks (contiguous), else 1: calls that `runs_whole` (a KV cache) or have another length
    (e.g. initialisation on a one-token batch) run whole on every device, with the same values.
    tokens: [batch, len, ...]."""
    shards = context_parallel.mesh_context_size()
    if runs_whole or shards == 1 or tokens.shape[1] % (2 * shards if balanced else shards):
        return 1
    return shards


def split_rows(
    config: ModelConfig,
    tokens: Array,  # [batch, len]
    positions: Array,  # [batch, len], in the original order
    valid: Array | None,  # [batch, len] bool
    segment_ids: Array | None,  # [batch, len]
    positions_follow_index: bool,
    shards: int,
    causal: bool,
) -> tuple[Array, Array, context_parallel.SequenceMask, AttentionStructure]:
    """(tokens, positions, the self-attention mask by parts, the structure that carries the
    position bias by blocks) of rows split over `shards` devices: load balanced when `causal`,
    contiguous chunks (the original order) when not."""
    if config.local_window is not None and not positions_follow_index:
        raise ValueError("model.local_window under context parallelism is a window of token "
                         "indices; explicit positions that do not advance by one per token "
                         "would change it (pass segment_ids, or no positions)")
    ids = segment_ids if segment_ids is not None else valid
    reorder = (lambda x: context_parallel.load_balance(x, shards)) if causal else (lambda x: x)
    balance = lambda x: None if x is None else reorder(x)  # noqa: E731
    segments = balance(None if ids is None else jnp.asarray(ids).astype(jnp.int32))
    index = balance(jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                     tokens.shape))
    mask = context_parallel.SequenceMask(index, index, segments, segments, causal=causal,
                                         window=config.local_window,
                                         layout="balanced" if causal else "original")
    # Only the context-parallel attention reads this structure, for its bias by blocks.
    structure = AttentionStructure(causal, config.local_window, segments, segments)
    return balance(tokens), balance(positions), mask, structure


def cross_mask(
    tokens: Array,  # [batch, len], the decoder's, in the original order
    segment_ids: Array | None,  # [batch, len]
    source_valid: Array,  # [batch, src_len] bool
    source_segment_ids: Array | None,  # [batch, src_len]
    shards: int,
) -> context_parallel.SequenceMask:
    """Cross-attention's mask by parts for load-balanced decoder queries against the source in
    its original order: valid source keys, of the query's segment when both sides are packed.
    An invalid key's segment is -1, which no query has. The mask has no causal part or window,
    so the queries' order is no kernel's concern: the layout is the keys' ("original")."""
    packed = segment_ids is not None and source_segment_ids is not None
    as_ids = lambda ids, like: (jnp.asarray(ids).astype(jnp.int32) if packed  # noqa: E731
                                else jnp.zeros(like.shape[:2], jnp.int32))
    index = lambda like: jnp.broadcast_to(  # noqa: E731
        jnp.arange(like.shape[1], dtype=jnp.int32), like.shape[:2])
    keys = jnp.where(jnp.asarray(source_valid, bool), as_ids(source_segment_ids, source_valid),
                     -1)
    balance = lambda x: context_parallel.load_balance(x, shards)  # noqa: E731
    return context_parallel.SequenceMask(balance(index(tokens)), index(source_valid),
                                         balance(as_ids(segment_ids, tokens)), keys,
                                         layout="original")


def with_sequence(
    x: Array,  # [batch, len, d_model], rows split over the context axis
    ctx: LayerContext,
    sequence: context_parallel.SequenceMask,
) -> tuple[Array, LayerContext]:
    """x pinned to its split over the context axis, and `ctx` whose self-attention runs
    context parallel on `sequence`."""
    x = nn.with_logical_constraint(x, ("batch", "length", "embed"))
    return x, ctx.replace(self_attention=ctx.self_attention.replace(sequence=sequence))


def restore_rows(x: Array, shards: int) -> Array:  # [batch, len, ...] -> the original order
    """The decoder's output back in the order of its input tokens."""
    return x if shards == 1 else context_parallel.restore_order(x, shards)
