"""Causal load balancing for context parallelism (tfm.kernels.context_parallel): a row cut into
2N equal chunks, device i holding chunks i and 2N-1-i, so every device has as many early
(cheap) as late (costly) causal queries. A pure permutation of the sequence axis; the ring
takes each device's chunk by its two halves (`halves`), each one of the row's 2N chunks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _check_split(length: int, num_shards: int) -> None:
    if length % (2 * num_shards):
        raise ValueError(f"load balancing cuts a row of length {length} into 2 x {num_shards} "
                         f"chunks; the length must be a multiple of {2 * num_shards}")


def load_balance(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """x with its `axis` (the sequence, of length T) reordered so that an even split into
    num_shards (N) pieces gives piece i the chunks i and 2N-1-i of 2N equal chunks: each
    device then holds as many early (cheap) as late (costly) causal queries.

    x: [..., T, ...] -> same shape; T must be a multiple of 2N. `restore_order` undoes it."""
    x = jnp.moveaxis(jnp.asarray(x), axis, 0)
    _check_split(x.shape[0], num_shards)
    chunks = x.reshape(2, num_shards, -1, *x.shape[1:])  # [2, N, chunk, ...]: halves of the row
    pairs = jnp.stack([chunks[0], jnp.flip(chunks[1], axis=0)], axis=1)  # [N, 2, chunk, ...]
    return jnp.moveaxis(pairs.reshape(x.shape), 0, axis)


def restore_order(x: jax.Array, num_shards: int, axis: int = 1) -> jax.Array:
    """The inverse of `load_balance`: x [..., T, ...] back in the original order."""
    x = jnp.moveaxis(jnp.asarray(x), axis, 0)
    _check_split(x.shape[0], num_shards)
    pairs = x.reshape(num_shards, 2, -1, *x.shape[1:])  # [N, 2, chunk, ...]
    chunks = jnp.stack([pairs[:, 0], jnp.flip(pairs[:, 1], axis=0)], axis=0)
    return jnp.moveaxis(chunks.reshape(x.shape), 0, axis)


def load_balanced_index(length: int, num_shards: int) -> np.ndarray:
    """[length] int32: the original index of each token of a load-balanced row."""
    return np.asarray(load_balance(np.arange(length, dtype=np.int32), num_shards, axis=0))


def halves(length: int) -> list[slice]:
    """A chunk's two halves (one whole chunk if its length is odd). Under causal load
    balancing each half is one of the row's 2N chunks, contiguous in the original order, and
    a pair of halves is often hidden entirely (a later chunk's keys from an earlier chunk's
    queries), so the ring skips it."""
    half = length // 2
    return [slice(None)] if length % 2 else [slice(0, half), slice(half, length)]


def backward_by_pairs(carry: tuple, query_length: int, key_length: int, key_zeros, pair
                      ) -> tuple:
    """A ring's backward pass over one visiting block, pair by pair of query and key halves:
    ((dquery, dparams), (dkey, dvalue)) with the block's key gradients summed over the query
    halves. carry: (dquery [batch, query_length, ...] f32, dparams pytree); key_zeros(half):
    the zero (dkey, dvalue) of a key half; pair(part, query_half, key_half) -> (part, (dkey,
    dvalue) of the key half), part = (dquery of the query half, dparams) with the pair's
    contribution added (nothing where the pair is hidden)."""
    dquery, dparams = carry
    key_halves = halves(key_length)
    key_grads = [key_zeros(half) for half in key_halves]
    dquery_parts = []
    for query_half in halves(query_length):
        part = (dquery[:, query_half], dparams)
        for index, key_half in enumerate(key_halves):
            part, grads = pair(part, query_half, key_half)
            key_grads[index] = jax.tree.map(jnp.add, key_grads[index], grads)
        dquery_parts.append(part[0])
        dparams = part[1]
    dkey, dvalue = (jnp.concatenate(xs, axis=1) for xs in zip(*key_grads, strict=True))
    return (jnp.concatenate(dquery_parts, axis=1), dparams), (dkey, dvalue)
