"""Shaw et al. 2018's relative positions: clipped relative-distance indices, the logit bias
from learned key embeddings and the value term from learned value embeddings (the `relative`
scheme of tfm.nn.positions)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
ArrayLike = jax.Array | np.ndarray  # concrete or traced integer ids


def relative_indices(
    query_positions: ArrayLike, key_positions: ArrayLike, max_distance: int
) -> Array:
    """Shaw et al. 2018 indices clip(key - query, -k, k) + k, k = max_distance;
    query_positions: [B, T], key_positions: [B, S] -> [B, T, S] int32 in [0, 2k]."""
    if max_distance <= 0:
        raise ValueError(f"max_distance={max_distance} must be > 0")
    offsets = jnp.asarray(key_positions, jnp.int32)[:, None, :] - jnp.asarray(
        query_positions, jnp.int32)[:, :, None]
    return jnp.clip(offsets, -max_distance, max_distance) + max_distance


def shaw_logit_bias(query: Array, key_table: Array, rel_idx: Array, scale: float) -> Array:
    """scale * q_i . a^K_ij (Shaw et al. 2018, eq. 5); query: [B, T, N, H], key_table: [2k+1, H],
    rel_idx: [B, T, S] -> [B, N, T, S].

    Dots each query with all 2k+1 table rows first, then gathers: no [B, T, S, H] tensor.
    """
    per_row = jnp.einsum("btnh,rh->bntr", query, key_table)  # [B, N, T, 2k+1]
    gathered = jnp.take_along_axis(per_row, rel_idx[:, None].astype(jnp.int32), axis=-1)
    return scale * gathered


def shaw_bias(query: Array, key_table: Array, query_positions: Array, key_positions: Array,
              scale: float, *, max_distance: int) -> Array:
    """shaw_logit_bias from positions (the function of the scheme's RelativeBias, which the
    attention kernel calls); query: [B, T, N, H], key_table: [2k+1, H], query_positions:
    [B, T], key_positions: [B, S] -> [B, N, T, S]."""
    rel_idx = relative_indices(query_positions, key_positions, max_distance)
    return shaw_logit_bias(query, key_table, rel_idx, scale)


def shaw_value_term(weights: Array, value_table: Array, rel_idx: Array) -> Array:
    """sum_j w_ij a^V_ij (Shaw et al. 2018, eq. 3); weights: [B, N, T, S], value_table: [2k+1, H],
    rel_idx: [B, T, S] -> [B, T, N, H].

    Sums the weights per relative index first, then multiplies by the table.
    """
    one_hot = jax.nn.one_hot(rel_idx, value_table.shape[0], dtype=weights.dtype)  # [B, T, S, R]
    per_row = jnp.einsum("bnts,btsr->btnr", weights, one_hot)
    return jnp.einsum("btnr,rh->btnh", per_row, value_table)


def shaw_values(weights: Array, value_table: Array, query_positions: Array,
                key_positions: Array, *, max_distance: int) -> Array:
    """shaw_value_term from positions (the function of the scheme's RelativeValue); weights:
    [B, N, T, S], value_table: [2k+1, H], query_positions: [B, T], key_positions: [B, S]
    -> [B, T, N, H]."""
    rel_idx = relative_indices(query_positions, key_positions, max_distance)
    return shaw_value_term(weights, value_table, rel_idx)
