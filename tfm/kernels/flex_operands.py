"""The flex kernel's operands (tfm.kernels.flex_attention): local arrays made heads-major
with lengths padded to whole blocks, and the layout the kernel reads the query, key and value
in.

TPU stores an array's last axis in 128-lane tiles, so a heads-major [.., T, head_dim] array
with head_dim 64 (GPT-2's, the paper's) takes twice its size in HBM, and so do the copies the
backward pass keeps. Read with the sequence on the lanes ([.., head_dim, T], `sequence_minor`)
nothing is padded; the swap is made just before each kernel call, so XLA stores the heads-major
arrays that way and the swap costs no copy (as splash's QKVLayout.SEQ_MINOR). The output, its
gradient and the computed gradients stay [.., T, head_dim]."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from tfm.kernels import per_device


def sequence_minor(compiler: str, head_dim: int) -> bool:
    """Whether the kernel reads query, key and value as [.., head_dim, T]: under Mosaic (and
    interpret mode, which runs the Mosaic kernel) when head_dim does not fill whole 128-lane
    tiles; Triton reads [.., T, head_dim] (a GPU pads nothing)."""
    return compiler != "triton" and head_dim % per_device.LANES != 0


def as_read(seq_minor: bool, x: jax.Array) -> jax.Array:  # [b, heads, T, hd]
    """An operand as the kernel reads it: [b, heads, hd, T] when seq_minor, else as it is."""
    return jnp.swapaxes(x, -1, -2) if seq_minor else x


def heads_major(x: jax.Array, padded: int) -> jax.Array:  # [b, len, heads, hd]
    """-> [b, heads, padded, hd], the length zero-padded to `padded`."""
    x = jnp.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0), (0, 0)))
    return x.transpose(0, 2, 1, 3)


def from_heads_major(x: jax.Array, length: int) -> jax.Array:  # [b, heads, padded, hd]
    """The inverse of heads_major: [b, length, heads, hd]."""
    return x.transpose(0, 2, 1, 3)[:, :length]


def local_inputs(query, key, value, rows, params, query_offset) -> tuple:
    """The kernel's operands from local arrays: query, key, value heads-major with lengths
    padded to whole blocks, the rows as columns (queries) and rows (keys), padded keys in a
    segment no query has, the query offset after them, the parameters [heads, 1, P] float32."""
    q_padded, kv_padded = per_device.round_up(query.shape[1]), per_device.round_up(key.shape[1])
    query_pos, key_pos, query_seg, key_seg = rows

    def pad(ids: jax.Array, padded: int, fill: int = 0) -> jax.Array:
        return jnp.pad(ids, ((0, 0), (0, padded - ids.shape[1])), constant_values=fill)

    padded_rows = (pad(query_pos, q_padded)[:, :, None], pad(key_pos, kv_padded)[:, None, :],
                   pad(query_seg, q_padded)[:, :, None],
                   pad(key_seg, kv_padded, per_device.PADDING_KEY_SEGMENT)[:, None, :])
    if query_offset is not None:
        padded_rows = (*padded_rows, query_offset.astype(jnp.int32))
    params: Any = None if params is None else jax.tree.map(
        lambda leaf: leaf.astype(jnp.float32)[:, None, :], params)  # [heads, 1, P]
    return (heads_major(query, q_padded), heads_major(key, kv_padded),
            heads_major(value, kv_padded), padded_rows, params)
