"""The model's side of context parallelism (mesh.context > 1): a decoder's rows are reordered
once before the embedding (causal load balancing, tfm.kernels.context_parallel.load_balance)
and restored once after the last block; in between every layer is per token except
self-attention, which runs tfm.kernels.context_parallel on the mask by parts (SequenceMask) and
the position bias by blocks, both from each token's original index, segment and position."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfm.kernels import context_parallel
from tfm.kernels.call import AttentionStructure
from tfm.nn.config import ModelConfig

Array = jax.Array


def shards_for(tokens: Array, runs_whole: bool) -> int:
    """How many devices split these rows' sequence: the mesh's context axis for full passes
    whose length load balancing can cut into 2 x context chunks, else 1: calls that
    `runs_whole` (a KV cache; cross-attention, not split yet) or another length (e.g.
    initialisation on a one-token batch) run whole on every device, with the same values."""
    shards = context_parallel.mesh_context_size()
    if runs_whole or shards == 1 or tokens.shape[1] % (2 * shards):
        return 1
    return shards


def split_causal_rows(
    config: ModelConfig,
    tokens: Array,  # [batch, len]
    positions: Array,  # [batch, len], in the original order
    valid: Array | None,  # [batch, len] bool
    segment_ids: Array | None,  # [batch, len]
    positions_follow_index: bool,
    shards: int,
) -> tuple[Array, Array, context_parallel.SequenceMask, AttentionStructure]:
    """(tokens, positions, the self-attention mask by parts, the structure that carries the
    position bias by blocks), every row load balanced over `shards` devices."""
    if config.local_window is not None and not positions_follow_index:
        raise ValueError("model.local_window under context parallelism is a window of token "
                         "indices; explicit positions that do not advance by one per token "
                         "would change it (pass segment_ids, or no positions)")
    ids = segment_ids if segment_ids is not None else valid
    balance = lambda x: None if x is None else context_parallel.load_balance(x, shards)
    segments = balance(None if ids is None else jnp.asarray(ids).astype(jnp.int32))
    index = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    index = balance(index)
    mask = context_parallel.SequenceMask(index, index, segments, segments, causal=True,
                                         window=config.local_window, layout="balanced")
    # Only the context-parallel attention reads this structure, for its bias by blocks.
    structure = AttentionStructure(True, config.local_window, segments, segments)
    return balance(tokens), balance(positions), mask, structure


def restore_rows(x: Array, shards: int) -> Array:  # [batch, len, ...] -> the original order
    """The decoder's output back in the order of its input tokens."""
    return x if shards == 1 else context_parallel.restore_order(x, shards)
