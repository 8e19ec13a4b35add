"""Learned relative-position biases for long context, in the block form fused kernels evaluate
(tfm.nn.positions.BlockBiasFn: fn(head_params, query_positions [bq, 1], key_positions [1, bk])
-> [bq, bk] float32, elementwise in the positions, parameters one head's row [1, P]):

- Kerple (Chi et al. 2022), per head h and distance d = |i - j|:
    logarithmic  b = -r1_h log(1 + r2_h d),      r1, r2 > 0
    power        b = -r1_h d^r2_h,               r1 > 0, 0 < r2 <= 2
- FIRE (Li et al. 2023): b = f_theta(psi(d) / psi(max(L, i))), psi(x) = log(c x + 1), with
  f_theta an MLP of one hidden ReLU layer (width FIRE_WIDTH) from one input to one output per
  head, c > 0 and the threshold L > 0 learned ("progressive interpolation": the normaliser stops
  shrinking below position L). The paper's form is causal; bidirectional attention uses d = |i - j|
  as well, so FIRE cannot tell left from right there.

Parameters are kept unconstrained and mapped to their ranges by softplus / sigmoid, so any value
an optimizer reaches is valid. Each hook returns (function, params) with leaves [num_heads, P].
FIRE also has a whole-row form (`fire_dense_bias`) for kernels that write the bias out: its
input layer is shared by the heads, so the hidden units are computed once for all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array
# param(name, shape, init_stddev, logical_axes) -> a parameter of the calling module.
ParamFn = Callable[[str, tuple[int, ...], float, tuple[str | None, ...]], Array]

FIRE_WIDTH = 32
FIRE_THRESHOLD_INIT = 512.0  # L at initialisation (the paper learns it from a set start)
_LOG2 = float(np.log(2.0))


def _distance(query_positions: Array, key_positions: Array) -> Array:
    return jnp.abs(key_positions - query_positions).astype(jnp.float32)


def _column(row: Array, index: int) -> Array:
    """row[:, index] kept [rows, 1] by a masked sum: its gradient is a broadcast, which a TPU
    kernel can take (it cannot scatter into a lane)."""
    columns = jax.lax.broadcasted_iota(jnp.int32, row.shape, row.ndim - 1)
    return jnp.sum(jnp.where(columns == index, row, 0.0), axis=-1, keepdims=True)


def kerple_log_block_bias(head_params: tuple[Array], query_positions: Array,
                          key_positions: Array) -> Array:
    """-r1 log(1 + r2 d) for one head; head_params: ([1, 2] raw (r1, r2),) -> [bq, bk]."""
    (raw,) = head_params
    r1 = jax.nn.softplus(_column(raw.astype(jnp.float32), 0))
    r2 = jax.nn.softplus(_column(raw.astype(jnp.float32), 1))
    return -r1 * jnp.log1p(r2 * _distance(query_positions, key_positions))


def kerple_power_block_bias(head_params: tuple[Array], query_positions: Array,
                            key_positions: Array) -> Array:
    """-r1 d^r2 for one head; head_params: ([1, 2] raw (r1, r2),) -> [bq, bk]. d^r2 is
    exp(r2 log d) with d = 0 giving 0 (and a zero gradient for r2 there)."""
    (raw,) = head_params
    r1 = jax.nn.softplus(_column(raw.astype(jnp.float32), 0))
    r2 = 2.0 * jax.nn.sigmoid(_column(raw.astype(jnp.float32), 1))
    distance = _distance(query_positions, key_positions)
    safe = jnp.where(distance > 0, distance, 1.0)
    return jnp.where(distance > 0, -r1 * jnp.exp(r2 * jnp.log(safe)), 0.0)


def fire_block_bias(head_params: tuple[Array, Array, Array, Array, Array],
                    query_positions: Array, key_positions: Array) -> Array:
    """FIRE for one head. head_params: ([1, W] input weights, [1, W] hidden biases, [1, W] this
    head's output weights, [1, 1] this head's output bias, [1, 2] raw (c, L)) -> [bq, bk]."""
    w_in, b_in, w_out, b_out, raw = (leaf.astype(jnp.float32) for leaf in head_params)
    c = jax.nn.softplus(_column(raw, 0))
    threshold = FIRE_THRESHOLD_INIT / _LOG2 * jax.nn.softplus(_column(raw, 1))
    query = query_positions.astype(jnp.float32)
    normaliser = jnp.log(c * jnp.maximum(threshold, query) + 1.0)
    x = jnp.log(c * _distance(query_positions, key_positions) + 1.0) / normaliser
    bias = jnp.zeros(x.shape, jnp.float32) + b_out
    for unit in range(w_in.shape[-1]):  # one hidden unit at a time: 2-D tiles only
        hidden = jax.nn.relu(_column(w_in, unit) * x + _column(b_in, unit))
        bias = bias + _column(w_out, unit) * hidden
    return bias


# The gradient of the unit loop keeps a [block_q, block_k] tile per hidden unit: at 512 x 512
# tiles a TPU kernel needs more than its scoped on-chip memory (Mosaic: CompileTimeScopedVmemOom,
# v5e, any length), at 256 x 256 it fits (tfm.kernels.flex_attention reads this).
fire_block_bias.largest_block = 256


# Hidden activations held at once by fire_dense_bias ([batch, queries, keys, FIRE_WIDTH]):
# longer rows are taken a run of queries at a time.
FIRE_DENSE_ELEMENTS = 1 << 24


def _query_chunk(batch: int, q_len: int, kv_len: int) -> int:
    """The largest divisor of q_len whose hidden activations fit FIRE_DENSE_ELEMENTS."""
    largest = max(1, FIRE_DENSE_ELEMENTS // (batch * kv_len * FIRE_WIDTH))
    return max(size for size in range(1, min(q_len, largest) + 1) if q_len % size == 0)


def fire_dense_bias(head_params: tuple[Array, Array, Array, Array, Array],
                    query_positions: Array, key_positions: Array) -> Array:
    """FIRE over whole rows -> [batch, num_heads, q_len, kv_len] float32, from the hook's params
    (`fire`: the input layer and the scales c, L are one row broadcast to every head, so head
    0's row is read for them and the gradient reaches the shared parameter through the
    broadcast). The hidden units are computed once for all heads and mixed by a matmul.

    query_positions: [batch, q_len] int; key_positions: [batch, kv_len] int."""
    w_in, b_in, w_out, b_out, raw = (leaf.astype(jnp.float32) for leaf in head_params)
    c = jax.nn.softplus(raw[0, 0])
    threshold = FIRE_THRESHOLD_INIT / _LOG2 * jax.nn.softplus(raw[0, 1])
    keys = jnp.asarray(key_positions, jnp.float32)[:, None, :]  # [batch, 1, kv_len]

    def rows(queries: Array) -> Array:  # [batch, chunk] -> [batch, heads, chunk, kv_len]
        queries = queries.astype(jnp.float32)[:, :, None]
        normaliser = jnp.log(c * jnp.maximum(threshold, queries) + 1.0)
        x = jnp.log(c * jnp.abs(keys - queries) + 1.0) / normaliser  # [batch, chunk, kv_len]
        hidden = jax.nn.relu(x[..., None] * w_in[0] + b_in[0])  # [batch, chunk, kv_len, W]
        return jnp.einsum("bqkw,hw->bhqk", hidden, w_out) + b_out[None, :, :, None]

    batch, q_len = query_positions.shape
    chunk = _query_chunk(batch, q_len, key_positions.shape[1])
    if chunk == q_len:
        return rows(jnp.asarray(query_positions))
    runs = jnp.asarray(query_positions).reshape(batch, q_len // chunk, chunk).swapaxes(0, 1)
    out = jax.lax.map(rows, runs)  # [runs, batch, heads, chunk, kv_len]
    return jnp.moveaxis(out, 0, 2).reshape(batch, w_out.shape[0], q_len, -1)


def kerple_log(config: Any, bidirectional: bool, param: ParamFn) -> tuple[Callable, Any]:
    """The block_bias hook of `kerple_log`: ([num_heads, 2] raw (r1, r2),)."""
    return kerple_log_block_bias, (param("kerple_log", (config.num_heads, 2), 1.0,
                                         ("heads", None)),)


def kerple_power(config: Any, bidirectional: bool, param: ParamFn) -> tuple[Callable, Any]:
    """The block_bias hook of `kerple_power`: ([num_heads, 2] raw (r1, r2),)."""
    return kerple_power_block_bias, (param("kerple_power", (config.num_heads, 2), 1.0,
                                           ("heads", None)),)


def fire(config: Any, bidirectional: bool, param: ParamFn) -> tuple[Callable, Any]:
    """The block_bias hook of `fire`: the MLP's input layer is shared by the heads (broadcast to
    [num_heads, W] rows, so its gradient sums over them), its output layer is one column per
    head."""
    heads = config.num_heads
    w_in = param("fire_in_kernel", (1, FIRE_WIDTH), 1.0, (None, None))
    b_in = param("fire_in_bias", (1, FIRE_WIDTH), 1.0, (None, None))
    w_out = param("fire_out_kernel", (heads, FIRE_WIDTH), FIRE_WIDTH**-0.5, ("heads", None))
    b_out = param("fire_out_bias", (heads, 1), 0.02, ("heads", None))
    raw = param("fire_scales", (1, 2), 0.02, (None, None)) + jnp.asarray([[0.5413, 0.0]])
    rows = lambda leaf: jnp.broadcast_to(leaf, (heads, leaf.shape[-1]))  # noqa: E731
    return fire_block_bias, (rows(w_in), rows(b_in), w_out, b_out, rows(raw))
