"""Masks shared by the fused-attention tests (splash, flex): segment ids of padded or packed
rows, and a structure's mask written out with tfm.nn.attention's functions."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tfm.kernels.call import AttentionStructure
from tfm.nn import attention as reference


def segments(kind: str, batch: int, length: int) -> np.ndarray | None:
    """None, padding (1 real / 0 padded, different lengths per row) or packed ids (0 = pad)."""
    if kind == "none":
        return None
    ids = np.zeros((batch, length), np.int32)
    if kind == "padding":
        for row in range(batch):
            ids[row, : length - 17 * (row + 1)] = 1
        return ids
    cuts = sorted(np.random.default_rng(length).choice(np.arange(5, length - 5), 3, False))
    for row in range(batch):
        ids[row, : cuts[0]], ids[row, cuts[0]: cuts[1]], ids[row, cuts[1]: cuts[2]] = 1, 2, 3
    return ids


def dense_mask(
    structure: AttentionStructure, q_len: int, kv_len: int
) -> jax.Array:  # [batch | 1, 1, q_len, kv_len]
    """The same mask written out with tfm.nn.attention's mask functions."""
    q_index = jnp.arange(q_len)[None]
    kv_index = jnp.arange(kv_len)[None]
    masks = []
    if structure.causal:
        masks.append(reference.causal_mask(q_index, kv_index))
    if structure.window is not None:
        masks.append(reference.local_window_mask(q_index, kv_index, structure.window))
    if structure.query_segments is not None:
        masks.append(reference.segment_mask(structure.query_segments, structure.key_segments))
    return reference.combine_masks(*masks)
