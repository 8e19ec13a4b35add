"""Tests for tfm/kernels/context_relative.py on simulated CPU devices (tests/conftest.py): Shaw's
relative attention (the logit term from the queries, the value term from the weights) split
over 2 and 4 devices, load balanced, against the reference maths on the whole row: the output
and the gradients of query, key, value and both tables equal it in float32 (relative 1e-5).
The rows: one causal document, and a packed row whose documents cross every chunk boundary
(positions restart per document) with padding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from tfm.kernels import context_parallel as context
from tfm.kernels import reference
from tfm.kernels.call import RelativeBias, RelativeValue
from tfm.kernels.context_relative import relative_context_attention
from tfm.nn import shaw

LENGTH, HEADS, KV_HEADS, HEAD_DIM, DISTANCE = 16, 4, 2, 8, 3
SEGMENTS = np.array([[1] * LENGTH, [1] * 5 + [2] * 7 + [3] * 2 + [0] * 2], np.int32)
INDEX = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), SEGMENTS.shape)
POSITIONS = np.array([[*range(LENGTH)], [*range(5), *range(7), *range(2), *range(2)]], np.int32)
SCALE = HEAD_DIM**-0.5


def _parts(key_table, value_table, token_positions):
    bias = RelativeBias(functools.partial(shaw.shaw_bias, max_distance=DISTANCE), key_table,
                        token_positions, token_positions)
    values = RelativeValue(functools.partial(shaw.shaw_values, max_distance=DISTANCE),
                           value_table, token_positions, token_positions)
    return bias, values


def _one_device(query, key, value, key_table, value_table):
    """The reference maths on whole rows, as MultiHeadAttention runs Shaw on one device."""
    bias, values = _parts(key_table, value_table, jnp.asarray(POSITIONS))
    mask = reference.combine_masks(reference.segment_mask(SEGMENTS, SEGMENTS),
                                   reference.causal_mask(INDEX, INDEX))
    out, weights = reference.dot_product_attention(
        query, key, value, mask=mask, scale=SCALE, return_weights=True,
        bias=bias.function(query, key_table, POSITIONS, POSITIONS, SCALE))
    return out + values(weights)


def _context_run(size):
    mesh = jax.make_mesh((size,), (context.AXIS,), devices=jax.devices()[:size],
                         axis_types=(AxisType.Auto,))
    order = functools.partial(context.load_balance, num_shards=size)
    index, segments, token_positions = (jnp.asarray(order(x)) for x in
                                        (INDEX, SEGMENTS, POSITIONS))
    mask = context.SequenceMask(index, index, segments, segments, causal=True)

    def run(query, key, value, key_table, value_table):
        bias, values = _parts(key_table, value_table, token_positions)
        out = relative_context_attention(order(query), order(key), order(value), mask, bias,
                                         values, mesh=mesh, scale=SCALE)
        return context.restore_order(out, size)

    return run


def _values_and_grads(run, *inputs):
    out, pull = jax.vjp(run, *inputs)
    return out, pull(jnp.cos(out))


@pytest.mark.parametrize("size", [2, 4])
def test_shaw_under_all_gather_equals_the_reference_on_one_device(size):
    rng = np.random.default_rng(0)
    shapes = [(2, LENGTH, HEADS, HEAD_DIM), (2, LENGTH, KV_HEADS, HEAD_DIM),
              (2, LENGTH, KV_HEADS, HEAD_DIM), (2 * DISTANCE + 1, HEAD_DIM),
              (2 * DISTANCE + 1, HEAD_DIM)]
    inputs = [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in shapes]
    want, want_grads = jax.jit(functools.partial(_values_and_grads, _one_device))(*inputs)
    got, got_grads = jax.jit(functools.partial(_values_and_grads, _context_run(size)))(*inputs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    names = ("query", "key", "value", "key_table", "value_table")
    for name, got_grad, want_grad in zip(names, got_grads, want_grads, strict=True):
        scale = float(jnp.max(jnp.abs(want_grad)))
        np.testing.assert_allclose(got_grad / scale, want_grad / scale, rtol=1e-5, atol=1e-5,
                                   err_msg=name)
