"""The ring strategy of context parallelism (tfm.kernels.context_parallel) on the flex kernel
(tfm.kernels.flex_attention: Mosaic on TPU, Triton on GPU, interpret mode elsewhere): no
block's scores reach memory.

Keys and values (with their original indices, segments and positions) rotate around the
axis as in the reference ring. At each step a device's two query halves each meet the
visiting block's two key halves; each half is contiguous in the row's original order (a
known SequenceMask.layout), so a pair is one kernel call whose query offset (the query
half's first index minus the key half's) places the causal mask and the window: negative
and beyond the window, nothing is visible and the pair is skipped; within a half, the
diagonal; past it, every key. The forward pass combines each pair's output and log-sum-exp
by the online-softmax rule (a pair that sees no key changes nothing); the backward pass runs
the kernel's backward per pair from the final output and log-sum-exp (FlashAttention-2),
the dK/dV accumulators rotating with their blocks and taking one more step home (Liu et al.
2023, Ring Attention, arXiv 2310.01889). Position biases come from the global positions; a
learned bias's parameter gradient is summed over the ring.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from tfm.kernels import flex_attention, per_device
from tfm.kernels.call import BlockBias
from tfm.kernels.load_balance import backward_by_pairs, halves

if TYPE_CHECKING:
    from tfm.kernels.context_parallel import SequenceMask

EMPTY_LSE = -1e30  # the combined log-sum-exp of a query that has seen no key yet
# Rings of at most this many rotations are unrolled on TPU and GPU: XLA's cost analysis
# counts a loop body once (the TPU program's ring loops carry no trip count), and the
# scheduler may overlap each rotation with its step's kernels (not with later steps':
# _after_step). On CPU (interpret mode, tests) the loop stays rolled: same values, faster to
# compile.
MAX_UNROLLED_ROTATIONS = 15


def unrolled(rotations: int) -> bool:
    """Whether the ring's `rotations` steps are unrolled for the chip being compiled for."""
    return (0 < rotations <= MAX_UNROLLED_ROTATIONS
            and per_device.device_kind().lower() != "cpu")


def ring_attention(
    query: jax.Array,  # [batch, chunk, num_heads, head_dim], this device's queries
    key: jax.Array,  # [batch, chunk, num_kv_heads, head_dim], this device's keys
    value: jax.Array,  # like key
    mask: SequenceMask,  # this device's chunks, layout "original" or "balanced"
    bias: BlockBias | None,  # positions: this device's chunks
    *,
    scale: float,
    axis_name: str,
    compiler: str | None,
) -> jax.Array:  # [batch, chunk, num_heads, head_dim]
    """The ring, per device under shard_map over `axis_name`, each pair of query and key
    halves one flex kernel call (compiled by `compiler`, one of per_device.COMPILERS; None:
    chosen at lowering). Gradients flow to query, key, value and a learned bias's params."""
    # queries and keys may differ in length (cross-attention: the source's chunk)
    zeros = tuple(jnp.zeros(x.shape[:2], jnp.int32) for x in (query, key))
    segments = (zeros if mask.query_segments is None
                else (mask.query_segments, mask.key_segments))
    positions = zeros if bias is None else (bias.query_positions, bias.key_positions)
    rows = (mask.query_index, mask.key_index, *segments, *positions)
    options = dict(causal=mask.causal, window=mask.window, scale=scale,
                   function=None if bias is None else bias.function,
                   learned=bias is not None and bias.learned, compiler=compiler)
    ring = _ring_function(options, axis_name)
    return ring(query, key, value, None if bias is None else bias.params,
                tuple(x.astype(jnp.int32) for x in rows))


def _ring_function(options: dict, axis_name: str):
    """The ring as a jax.custom_vjp of (query, key, value, bias params, rows): rows (indices,
    segments, positions of queries and keys, int32) take no gradient. options: the kernel's
    keyword arguments (flex_attention.attend_local's) but the query offset."""

    @jax.custom_vjp
    def ring(query, key, value, params, rows):
        return _ring_forward(query, key, value, params, rows, options, axis_name)[0]

    def forward(query, key, value, params, rows):
        out, lse = _ring_forward(query, key, value, params, rows, options, axis_name)
        return out, (query, key, value, params, rows, out, lse)

    def backward(saved, out_grad):
        saved, out_grad = _once_cotangent_exists(saved, out_grad)
        query, key, value, params, rows, out, lse = saved
        dquery, dkey, dvalue, dparams = _ring_backward(
            query, key, value, params, rows, out, lse, out_grad, options, axis_name)
        dparams = (jax.tree.map(lambda grad, leaf: grad.astype(leaf.dtype), dparams, params)
                   if options["learned"] else jax.tree.map(jnp.zeros_like, params))
        return (dquery.astype(query.dtype), dkey.astype(key.dtype), dvalue.astype(value.dtype),
                dparams, None)

    ring.defvjp(forward, backward)
    return ring


def _pair(query_rows: tuple, block: dict, query_half: slice, key_half: slice,
          options: dict) -> tuple[jax.Array, tuple, jax.Array]:
    """(whether some query of `query_half` may see some key of `key_half` by index []
    bool, the kernel's rows, the query offset [batch] int32) of one pair of halves, from the
    first and last original indices of each (halves are contiguous in the original order)."""
    query_index, query_segments, query_positions = query_rows
    first_query, last_query = (query_index[:, query_half][:, i] for i in (0, -1))
    first_key, last_key = (block["index"][:, key_half][:, i] for i in (0, -1))
    window = options["window"]
    ahead = 0 if options["causal"] else window
    reached = jnp.ones_like(first_query, bool)
    if ahead is not None:
        reached = reached & (first_key <= last_query + ahead)
    if window is not None:
        reached = reached & (last_key >= first_query - window)
    rows = (query_positions[:, query_half], block["positions"][:, key_half],
            query_segments[:, query_half], block["segments"][:, key_half])
    return jnp.any(reached), rows, first_query - first_key


def _halves(query: jax.Array, block: dict, query_half: slice, key_half: slice) -> tuple:
    """A pair's query, key and value halves, sliced outside the pair's branch: the branch then
    copies only the halves, not the whole chunks (XLA's cost analysis of the GPT-2-small ring
    at 32,768 tokens, 2 layers, v5e-8 context 8: 48.5 GB per chip against 57.5 GB)."""
    return query[:, query_half], block["key"][:, key_half], block["value"][:, key_half]


def _if_reached(reached: jax.Array, compute, skipped, operand):
    """compute(operand), or skipped(operand) where no query of the pair sees any key."""
    return jax.lax.cond(reached, compute, skipped, operand)


def _kernel_options(options: dict) -> dict:
    """The kernel's keyword arguments for one pair of halves. Its cost estimate (the offset is
    traced) assumes the diagonal, offset 0: about half a pair's keys, the mean over the ring
    under causal load balancing (per step 2 of 4 pairs run whole, the rest are skipped; XLA
    counts a lax.cond's kernel as run), so the compiled FLOP count is the ring's work."""
    return dict(options, cost_offset=0)


def _combine(state: tuple, out: jax.Array, lse: jax.Array) -> tuple:
    """The online-softmax rule: (output [b, q, heads, hd] f32, log-sum-exp [b, heads, q] f32)
    of the keys seen so far joined with one pair's (a query that sees none of its keys has
    lse NO_KEY_LSE and output 0: it changes nothing)."""
    total_out, total_lse = state
    lse = jnp.where(lse >= flex_attention.NO_KEY_LSE, EMPTY_LSE, lse)
    new_lse = jnp.logaddexp(total_lse, lse)
    as_rows = lambda x: jnp.swapaxes(jnp.exp(x - new_lse), 1, 2)[..., None]  # noqa: E731
    return (total_out * as_rows(total_lse) + out.astype(jnp.float32) * as_rows(lse), new_lse)


def _visit_forward(state: tuple, block: dict, query: jax.Array, query_rows: tuple,
                   params: Any, options: dict) -> tuple:
    """The combined (output, log-sum-exp) after one visiting block, by pairs of halves."""
    parts = []
    for query_half in halves(query.shape[1]):
        part = (state[0][:, query_half], state[1][:, :, query_half])
        for key_half in halves(block["key"].shape[1]):
            reached, rows, offset = _pair(query_rows, block, query_half, key_half, options)
            arrays = _halves(query, block, query_half, key_half)

            def compute(part, arrays=arrays, rows=rows, offset=offset):
                out, lse = flex_attention.block_forward(
                    *arrays, rows, params, query_offset=offset, **_kernel_options(options))
                return _combine(part, out, lse)

            part = _if_reached(reached, compute, lambda part: part, part)
        parts.append(part)
    return (jnp.concatenate([out for out, _ in parts], axis=1),
            jnp.concatenate([lse for _, lse in parts], axis=2))


def _ring_forward(query, key, value, params, rows, options, axis_name):
    """(out [b, chunk, heads, hd] in query's dtype, log-sum-exp [b, heads, chunk] f32, with
    NO_KEY_LSE where a query sees no key) against every device's block, the blocks rotating
    N - 1 times."""
    query_rows, block = _split_rows(key, value, rows)
    batch, chunk, num_heads, _ = query.shape
    state = (jnp.zeros(query.shape, jnp.float32),
             jnp.full((batch, num_heads, chunk), EMPTY_LSE, jnp.float32))
    visit = functools.partial(_visit_forward, query=query, query_rows=query_rows, params=params,
                              options=options)

    def step(carry, _):
        state, block = carry
        arriving = per_device.rotate(block, axis_name)
        return _after_step(visit(state, block), arriving), None

    rotations = jax.lax.axis_size(axis_name) - 1
    (state, block), _ = jax.lax.scan(step, (state, block), None, length=rotations,
                                     unroll=unrolled(rotations))
    out, lse = visit(state, block)
    seen = lse > EMPTY_LSE / 2
    out = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None], out, 0.0)
    return out.astype(query.dtype), jnp.where(seen, lse, flex_attention.NO_KEY_LSE)


def _after_step(computed: Any, arriving: dict) -> tuple:
    """(computed, arriving) released together (jax.lax.optimization_barrier): the block
    arriving for the next step, sent while this step's pairs compute, is usable, and so sent
    on, only once they are done. A device then holds two blocks, the one it computes on and
    the one arriving, as the rolled loop does; unrolled, XLA's scheduler otherwise starts the
    rotations, which depend on nothing the pairs compute, ahead of them and keeps more blocks
    alive (a 2-layer GPT-2 small, T5 bias, 32,768 tokens, v5e-8, context 8: 0.57 GB of
    temporaries per chip unrolled, 0.44 GB with this barrier or rolled)."""
    return jax.lax.optimization_barrier((computed, arriving))


def _once_cotangent_exists(saved: tuple, out_grad: jax.Array) -> tuple:
    """(saved, out_grad) released together (jax.lax.optimization_barrier): the backward
    pass's first rotation of the saved keys and values waits for the output's gradient, so XLA
    can neither merge it with the forward pass's identical first rotation nor start it in the
    forward pass, which kept one rotated block per layer alive from one pass to the other
    (GPT-2 small, T5 bias, 131,072 tokens, v5e-8, context 8: 7.65 -> 6.84 GB per chip)."""
    return jax.lax.optimization_barrier((saved, out_grad))


def _split_rows(key, value, rows) -> tuple[tuple, dict]:
    """(the queries' (index, segments, positions), the travelling block: key, value and the
    keys' index, segments and positions)."""
    query_index, key_index, query_segments, key_segments, query_positions, key_positions = rows
    block = dict(key=key, value=value, index=key_index, segments=key_segments,
                 positions=key_positions)
    return (query_index, query_segments, query_positions), block


def _visit_backward(carry: tuple, block: dict, query: jax.Array, query_rows: tuple,
                    params: Any, saved: tuple, options: dict) -> tuple:
    """((dquery f32, dparams f32), (dkey, dvalue) f32 of the visiting block) after one block,
    by pairs of halves. saved: the final (out, lse) and the output's gradient."""
    zeros = lambda half: tuple(jnp.zeros(block[name][:, half].shape, jnp.float32)  # noqa: E731
                               for name in ("key", "value"))

    def pair(part, query_half, key_half):
        reached, rows, offset = _pair(query_rows, block, query_half, key_half, options)
        out, lse, out_grad = (x[:, query_half] if x.ndim == 4 else x[:, :, query_half]
                              for x in saved)
        arrays = _halves(query, block, query_half, key_half)

        def compute(part):
            dq, dk, dv, dp = flex_attention.block_backward(
                *arrays, rows, params, out, lse, out_grad, query_offset=offset,
                **_kernel_options(options))
            dquery, dparams = part
            dparams = jax.tree.map(lambda total, grad: total + grad.astype(jnp.float32),
                                   dparams, dp)
            grads = (dk.astype(jnp.float32), dv.astype(jnp.float32))
            return (dquery + dq.astype(jnp.float32), dparams), grads

        nothing = zeros(key_half)
        return _if_reached(reached, compute, lambda part: (part, nothing), part)

    return backward_by_pairs(carry, query.shape[1], block["key"].shape[1], zeros, pair)


def _ring_backward(query, key, value, params, rows, out, lse, out_grad, options, axis_name):
    """(dquery, dkey, dvalue, dparams) of the ring, float32: the blocks rotate as in the
    forward pass with their dK/dV accumulators, which take one more step home at the end."""
    query_rows, block = _split_rows(key, value, rows)
    float_zeros = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jnp.zeros(x.shape, jnp.float32), tree)
    carry = (float_zeros(query), float_zeros(params))
    grads = float_zeros((key, value))
    backward = functools.partial(_visit_backward, query=query, query_rows=query_rows,
                                 params=params, saved=(out, lse, out_grad), options=options)

    def step(state, _):
        carry, block, grads = state
        arriving = per_device.rotate(block, axis_name)
        (carry, block_grads), arriving = _after_step(backward(carry, block), arriving)
        grads = jax.tree.map(jnp.add, grads, block_grads)
        return (carry, arriving, per_device.rotate(grads, axis_name)), None

    rotations = jax.lax.axis_size(axis_name) - 1
    (carry, block, grads), _ = jax.lax.scan(step, (carry, block, grads), None,
                                            length=rotations, unroll=unrolled(rotations))
    (dquery, dparams), block_grads = backward(carry, block)
    dkey, dvalue = per_device.rotate(jax.tree.map(jnp.add, grads, block_grads), axis_name)
    return dquery, dkey, dvalue, dparams
