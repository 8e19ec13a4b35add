"""Tests for tfm/kernels/context_parallel.py on 8 simulated CPU devices (tests/conftest.py).

Context-parallel attention (all_gather and ring over 2, 4 and 8 devices, with and without causal
load balancing) against a naive unsharded attention written here: outputs and the gradients of
query, key, value and the T5 table equal it in float32 (relative 1e-5). One batch holds a plain
row, a row packed with segments that cross every chunk boundary, and a row with padding.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType

from tfm.kernels import context_parallel as context
from tfm.kernels import ring_flex
from tfm.kernels.call import BlockBias
from tfm.nn import positions

LENGTH, HEADS, KV_HEADS, HEAD_DIM, BUCKETS = 16, 4, 2, 8, 4
SEGMENTS = np.array([
    [1] * LENGTH,
    [1] * 5 + [2] * 7 + [3] * 4,  # documents crossing chunk boundaries at every split
    [1] * (LENGTH - 3) + [0] * 3,  # padding: a segment of its own (id 0)
], np.int32)


def _positions(segments):
    """Each token's position within its segment (packed rows restart at 0)."""
    out = np.zeros_like(segments)
    for row in range(segments.shape[0]):
        for t in range(1, segments.shape[1]):
            same = segments[row, t] == segments[row, t - 1]
            out[row, t] = out[row, t - 1] + 1 if same else 0
    return out


POSITIONS = _positions(SEGMENTS)
INDEX = np.broadcast_to(np.arange(LENGTH, dtype=np.int32), SEGMENTS.shape)


def naive_attention(query, key, value, bias, *, causal, window):
    """softmax(q k^T / sqrt(d) + bias) v over the whole row, masked from SEGMENTS and INDEX;
    a query that sees no key reads nothing. query [B, T, N, H], key/value [B, T, K, H]."""
    groups = query.shape[2] // key.shape[2]
    key, value = jnp.repeat(key, groups, axis=2), jnp.repeat(value, groups, axis=2)
    logits = jnp.einsum("bqnh,bknh->bnqk", query, key) / np.sqrt(HEAD_DIM)
    if bias is not None:
        logits = logits + bias
    allowed = SEGMENTS[:, :, None] == SEGMENTS[:, None, :]
    if causal:
        allowed = allowed & (INDEX[:, None, :] <= INDEX[:, :, None])
    if window is not None:
        allowed = allowed & (np.abs(INDEX[:, :, None] - INDEX[:, None, :]) <= window)
    allowed = jnp.asarray(allowed[:, None])
    logits = jnp.where(allowed, logits, -jnp.inf)
    peak = jnp.max(jnp.where(allowed, logits, 0.0), axis=-1, keepdims=True)
    weights = jnp.where(allowed, jnp.exp(logits - peak), 0.0)
    total = jnp.sum(weights, axis=-1, keepdims=True)
    weights = weights / jnp.where(total > 0, total, 1.0)
    return jnp.einsum("bnqk,bknh->bqnh", weights, value)


def _naive_bias(kind, table, causal):
    if kind == "t5":
        return positions.t5_bias(table, POSITIONS, POSITIONS, bidirectional=not causal,
                                 num_buckets=BUCKETS, max_distance=16)
    if kind == "alibi":
        return positions.alibi_bias(POSITIONS, POSITIONS, positions.alibi_slopes(HEADS))
    return None


def _block_bias(kind, table, causal, token_positions):
    if kind == "t5":
        function = functools.partial(positions.t5_block_bias, bidirectional=not causal,
                                     num_buckets=BUCKETS, max_distance=16)
        return BlockBias(function, (table.T,), token_positions, token_positions, learned=True)
    if kind == "alibi":
        slopes = (jnp.asarray(positions.alibi_slopes(HEADS))[:, None],)
        return BlockBias(positions.alibi_block_bias, slopes, token_positions, token_positions)
    return None


def _context_run(size, strategy, balanced, kind, causal, window, kernel="reference"):
    """loss(query, key, value, table) -> out [B, T, N, H] in the original order, computed by
    context.context_attention over `size` devices, each chunk by `kernel`."""
    mesh = jax.make_mesh((size,), (context.AXIS,), devices=jax.devices()[:size],
                         axis_types=(AxisType.Auto,))
    order = functools.partial(context.load_balance, num_shards=size)
    if not balanced:
        order = lambda x: x
    index, segments, token_positions = (jnp.asarray(order(x)) for x in
                                        (INDEX, SEGMENTS, POSITIONS))
    mask = context.SequenceMask(index, index, segments, segments, causal, window,
                                layout="balanced" if balanced else "original")

    def run(query, key, value, table):
        bias = _block_bias(kind, table, causal, token_positions)
        out = context.context_attention(order(query), order(key), order(value), mask, bias,
                                        mesh=mesh, strategy=strategy, kernel=kernel)
        return context.restore_order(out, size) if balanced else out

    return run


def _inputs():
    rng = np.random.default_rng(0)
    shapes = [(3, LENGTH, HEADS, HEAD_DIM), (3, LENGTH, KV_HEADS, HEAD_DIM),
              (3, LENGTH, KV_HEADS, HEAD_DIM), (BUCKETS, HEADS), (3, LENGTH, HEADS, HEAD_DIM)]
    return [jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in shapes]


def _values_and_grads(run, query, key, value, table, cotangent):
    """run's output and the gradients of sum(output * cotangent) by query, key, value, table."""
    out, pull = jax.vjp(run, query, key, value, table)
    return out, pull(cotangent)


# name: (causal, window, load balanced, bias kind, context sizes). Every mask part with and
# without load balancing, each bias kind, each size; the batch's rows add packing across chunk
# boundaries and padding to each. A window of 3 is shorter than a chunk at size 2 and longer
# at size 8. One jit (values and gradients) per case, strategy and size: compiling dominates.
CASES = {
    "causal-balanced-t5": (True, None, True, "t5", (2, 4, 8)),
    "causal-window-alibi": (True, 3, False, "alibi", (2,)),
    "causal-window-balanced-alibi": (True, 3, True, "alibi", (8,)),
    "bidirectional-t5": (False, None, False, "t5", (4,)),
    "bidirectional-window-balanced": (False, 3, True, None, (8,)),
}
RUNS = [(case, size) for case, (*_, sizes) in CASES.items() for size in sizes]


@functools.cache
def _naive_values_and_grads(case):
    causal, window, _, kind, _ = CASES[case]

    def naive(query, key, value, table):
        return naive_attention(query, key, value, _naive_bias(kind, table, causal),
                               causal=causal, window=window)

    return jax.jit(functools.partial(_values_and_grads, naive))(*_inputs())


def _assert_equals_naive(run, case):
    """run's output and gradients equal the naive attention's of `case` (float32, 1e-5)."""
    got, got_grads = jax.jit(functools.partial(_values_and_grads, run))(*_inputs())
    want, want_grads = _naive_values_and_grads(case)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for name, got_grad, want_grad in zip(("query", "key", "value", "table"), got_grads,
                                         want_grads, strict=True):
        scale = float(jnp.max(jnp.abs(want_grad))) or 1.0
        np.testing.assert_allclose(got_grad / scale, want_grad / scale, rtol=1e-5, atol=1e-5,
                                   err_msg=name)


@pytest.mark.parametrize("strategy", context.STRATEGIES)
@pytest.mark.parametrize("case, size", RUNS)
def test_context_attention_equals_naive_attention(case, size, strategy):
    causal, window, balanced, kind, _ = CASES[case]
    run = _context_run(size, strategy, balanced, kind, causal, window)
    _assert_equals_naive(run, case)


# The flex kernel per device under all_gather (Pallas interpret mode here): a load-balanced
# chunk's halves as two calls, each with its query offset, or one call per plain chunk; the
# window reaches ahead of the offset queries too when the mask is not causal.
@pytest.mark.parametrize("case, size", [("causal-balanced-t5", 4), ("causal-window-alibi", 2),
                                        ("causal-window-balanced-alibi", 8),
                                        ("bidirectional-window-balanced", 8)])
def test_all_gather_on_the_flex_kernel_equals_naive_attention(case, size):
    causal, window, balanced, kind, _ = CASES[case]
    run = _context_run(size, "all_gather", balanced, kind, causal, window, kernel="flex")
    _assert_equals_naive(run, case)


def test_load_balance_gives_device_i_chunks_i_and_its_mirror():
    row = np.arange(16)[None]
    balanced = np.asarray(context.load_balance(row, 4))
    shards = balanced.reshape(4, 4)  # device i's 4 tokens: chunks i and 7 - i of 8
    np.testing.assert_array_equal(shards[1], [2, 3, 12, 13])
    np.testing.assert_array_equal(shards[3], [6, 7, 8, 9])
    np.testing.assert_array_equal(context.restore_order(balanced, 4), row)
    np.testing.assert_array_equal(context.load_balanced_index(16, 4), balanced[0])
    features = np.arange(2 * 16 * 3).reshape(2, 16, 3)
    np.testing.assert_array_equal(
        context.restore_order(context.load_balance(features, 2), 2), features)
    with pytest.raises(ValueError, match="must be a multiple of 8"):
        context.load_balance(np.arange(12)[None], 4)


def test_unknown_strategy_is_refused():
    query = jnp.zeros((1, 4, 2, 8))
    mask = context.SequenceMask(jnp.zeros((1, 4), jnp.int32), jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match="context_parallel='ulysses' is unknown"):
        context.attention_shard(query, query, query, mask, strategy="ulysses")


def test_the_ring_skips_half_of_every_other_block_under_load_balancing():
    """Which pairs of query and key halves the causal mask leaves visible (the ring computes
    only those): on a load-balanced row, 3 of 4 in a device's own block, 2 of 4 in every other
    block, so every device does the same work, about half of the unmasked ring's."""
    size, length = 4, 32
    index = jnp.asarray(context.load_balanced_index(length, size)).reshape(size, 1, -1)
    for device in range(size):
        for visiting in range(size):
            mask = context.SequenceMask(index[device], index[device], causal=True)
            block = {"index": index[visiting]}
            reached = sum(
                bool(jnp.any(context.block_mask(
                    context._query_part(jnp.zeros((1, 8)), mask, None, query_half)[1],
                    block["index"][:, key_half], None)))
                for query_half in context.halves(8) for key_half in context.halves(8))
            assert reached == (3 if device == visiting else 2), (device, visiting, reached)


# The ring on the flex kernel (tfm.kernels.ring_flex; Pallas interpret mode here): each pair of
# a device's query halves and a visiting block's key halves one kernel call, forward and
# backward, combined by the online-softmax rule; every mask part, each bias kind (T5's table
# gradient summed over the ring), packed rows crossing chunk boundaries, 2, 4 and 8 devices.
@pytest.mark.parametrize("case, size", [
    ("causal-balanced-t5", 2), ("causal-balanced-t5", 4), ("causal-balanced-t5", 8),
    ("causal-window-alibi", 2), ("causal-window-balanced-alibi", 8), ("bidirectional-t5", 4),
    ("bidirectional-window-balanced", 8)])
def test_the_ring_on_the_flex_kernel_equals_naive_attention(case, size):
    causal, window, balanced, kind, _ = CASES[case]
    run = _context_run(size, "ring", balanced, kind, causal, window, kernel="flex")
    _assert_equals_naive(run, case)


def test_the_unrolled_ring_equals_naive_attention(monkeypatch):
    """The ring's steps unrolled, as on TPU and GPU (ring_flex.unrolled; rolled on CPU): the
    same values and gradients, over 4 devices (3 rotations)."""
    monkeypatch.setattr(ring_flex, "unrolled", lambda rotations: True)
    causal, window, balanced, kind, _ = CASES["causal-balanced-t5"]
    run = _context_run(4, "ring", balanced, kind, causal, window, kernel="flex")
    _assert_equals_naive(run, "causal-balanced-t5")


def _nested_jaxprs(jaxpr):
    """Every jaxpr inside `jaxpr`'s equations (shard_map, scan, cond, custom rules), recursively."""
    for eqn in jaxpr.eqns:
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield inner
                    yield from _nested_jaxprs(inner)


def _ancestors(jaxpr, var) -> set[str]:
    """The primitives that compute `var` inside `jaxpr` (the body, not its inputs)."""
    return {eqn.primitive.name for eqn in _upstream(jaxpr, [var])[0]}


def _upstream(jaxpr, variables, barrier=None) -> tuple[list, set]:
    """(the equations of `jaxpr` that compute `variables`, the jaxpr's inputs they read), not
    looking past the equation `barrier` (an optimization barrier)."""
    producer = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
    seen, equations, inputs = set(), [], set()
    stack = [v for v in variables if isinstance(v, jax.extend.core.Var)]
    while stack:
        var = stack.pop()
        eqn = producer.get(var)
        if eqn is None:
            inputs.add(var)
        elif id(eqn) not in seen and eqn is not barrier:
            seen.add(id(eqn))
            equations.append(eqn)
            stack.extend(v for v in eqn.invars if isinstance(v, jax.extend.core.Var))
    return equations, inputs


def test_each_rotation_waits_for_the_step_before_it():
    """In both of the ring's loops (forward and backward), the visiting block's rotation leaves
    the step through an optimization barrier together with a result of the step's pairs (their
    lax.cond): the next rotation cannot start before this step's kernels ran, so a device holds
    the block it computes on and the one arriving, not the whole ring, also where the loop is
    unrolled and a scheduler may start every rotation at once (ring_flex.unrolled)."""
    causal, window, balanced, kind, _ = CASES["causal-balanced-t5"]
    run = _context_run(4, "ring", balanced, kind, causal, window, kernel="flex")
    program = jax.make_jaxpr(functools.partial(_values_and_grads, run))(*_inputs()).jaxpr
    loops = []  # (loop body, the rotations of the block it carries)
    for body in _nested_jaxprs(program):
        carried = set(body.invars)
        rotations = [eqn for eqn in body.eqns if eqn.primitive.name == "ppermute"
                     and all(v in carried for v in eqn.invars)]
        if rotations and any(eqn.primitive.name == "cond" for eqn in body.eqns):
            loops.append((body, rotations))
    assert len(loops) >= 2, "the forward loop and the backward one"
    for body, rotations in loops:
        barriers = [eqn for eqn in body.eqns if eqn.primitive.name == "optimization_barrier"]
        for rotation in rotations:
            held = [eqn for eqn in barriers if set(rotation.outvars) & set(eqn.invars)]
            assert held, "a rotation leaves the step without waiting for its pairs"
            waits_for = set().union(*(_ancestors(body, v) for v in held[0].invars))
            assert "cond" in waits_for, waits_for
            released = set(held[0].outvars)
            assert set(body.outvars) & released


def test_the_backward_ring_starts_once_the_cotangent_exists():
    """The ring's backward loop reads the forward pass's residuals (the keys and values it
    rotates first) only through an optimization barrier that also holds the output's
    cotangent (ring_flex._once_cotangent_exists): its first rotation cannot be hoisted into the
    forward pass, nor merged with the forward's identical first rotation, which would keep a
    rotated block per layer alive from one pass to the other."""
    causal, window, balanced, kind, _ = CASES["causal-balanced-t5"]
    run = _context_run(4, "ring", balanced, kind, causal, window, kernel="flex")
    program = jax.make_jaxpr(functools.partial(_values_and_grads, run))(*_inputs()).jaxpr
    cotangent = program.invars[-1]
    backward = [eqn for eqn in program.eqns if eqn.primitive.name == "shard_map"
                and any(e.primitive.name == "optimization_barrier"
                        for e in eqn.params["jaxpr"].eqns)]
    assert len(backward) == 1, "one shard_map computes the ring's backward pass"
    body = backward[0].params["jaxpr"]
    carries_cotangent = {inner for outer, inner in zip(backward[0].invars, body.invars,
                                                       strict=True)
                         if cotangent in _upstream(program, [outer])[1]}
    (barrier,) = [eqn for eqn in body.eqns if eqn.primitive.name == "optimization_barrier"]
    (loop,) = [eqn for eqn in body.eqns if eqn.primitive.name == "scan"]
    assert carries_cotangent & _upstream(body, barrier.invars)[1], "the barrier holds it"
    read_directly = _upstream(body, loop.invars, barrier)[1]
    assert not read_directly & set(body.invars), "the loop reads a residual past the barrier"


def test_the_ring_on_the_flex_kernel_equals_the_reference_ring():
    """Both rings' outputs and gradients on the load-balanced T5 case over 4 devices agree to
    float32 rounding: the same blocks, combined in the same order."""
    causal, window, balanced, kind, _ = CASES["causal-balanced-t5"]
    results = [jax.jit(functools.partial(_values_and_grads, _context_run(
        4, "ring", balanced, kind, causal, window, kernel=kernel)))(*_inputs())
        for kernel in context.KERNELS]
    (fused, fused_grads), (ring, ring_grads) = results
    np.testing.assert_allclose(fused, ring, rtol=1e-5, atol=1e-6)
    for name, got, want in zip(("query", "key", "value", "table"), fused_grads, ring_grads,
                               strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)
