"""Table lookups in the form a fused attention kernel can evaluate per [block_q, block_k] tile
(tfm.kernels.flex_attention): a Mosaic (TPU) kernel cannot gather from a table row, nor scatter
into a lane in the gradient, so a lookup is one select per table entry. The position schemes'
block bias functions (tfm.nn.positions, e.g. T5's buckets) call these; the dense reference
(`jnp.take`) gives the same values."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


def pick_column(row: jax.Array, index: int) -> jax.Array:
    """row[:, index] kept [rows, 1], by a masked sum instead of a slice, so its gradient is a
    broadcast (a TPU kernel cannot scatter into a lane)."""
    columns = jax.lax.broadcasted_iota(jnp.int32, row.shape, row.ndim - 1)
    return jnp.sum(jnp.where(columns == index, row, 0.0), axis=-1, keepdims=True)


def row_lookup(row: jax.Array, indices: jax.Array) -> jax.Array:
    """row[0, indices] without a gather: row [1, size] float, indices int32 of any shape with
    values in [0, size) -> float32 of indices' shape, by one select per entry."""
    out = jnp.zeros(indices.shape, jnp.float32)
    for index in range(row.shape[-1]):
        out = out + jnp.where(indices == index, pick_column(row, index), 0.0)
    return out


def dense_from_blocks(
    function: Callable[[Any, jax.Array, jax.Array], jax.Array],
    params: Any,  # leaves [num_heads, P]
    query_positions: jax.Array,  # [batch, q_len] int
    key_positions: jax.Array,  # [batch, kv_len] int
) -> jax.Array:  # [batch, num_heads, q_len, kv_len]
    """A block bias function (tfm.nn.positions.BlockBiasFn) evaluated on whole rows: the
    reference's form of the bias."""
    query_positions = jnp.asarray(query_positions, jnp.int32)
    key_positions = jnp.asarray(key_positions, jnp.int32)

    def one(head_params: Any, query_row: jax.Array, key_row: jax.Array) -> jax.Array:
        head_params = jax.tree.map(lambda leaf: leaf[None], head_params)
        return function(head_params, query_row[:, None], key_row[None, :])

    per_head = jax.vmap(one, in_axes=(0, None, None))  # [num_heads, q_len, kv_len]
    return jax.vmap(per_head, in_axes=(None, 0, 0))(params, query_positions, key_positions)
