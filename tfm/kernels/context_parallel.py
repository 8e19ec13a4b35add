"""Context parallelism: attention over a sequence split across the `context` mesh axis.

Each device holds one chunk of every row (queries, keys and values [batch, chunk, heads,
head_dim]) with its tokens' global indices, segment ids and positions, so every mask and
position bias is built from those, never from a chunk's local indices: a load-balanced
(permuted) layout needs nothing else. Two strategies (`STRATEGIES`), each run per device
inside `jax.shard_map` (`attention_shard`; `context_attention` wraps the shard_map):

  all_gather  keys and values (and their indices, segments, positions) are gathered over the
              axis, then the local queries attend the whole row (MaxText's default) by
              `kernel` (KERNELS): the reference maths (tfm.kernels.reference, dense [chunk, T]
              scores) on any layout, or the flex kernel (tfm.kernels.flex_attention: the mask
              and the position bias per block) on rows in a known order (SequenceMask.layout):
              the gathered keys are put back in their original order and each contiguous run
              of local queries (a load-balanced chunk's two halves) is one kernel call whose
              causal mask and window start at the run's first original index.
  ring        keys and values rotate around the axis by `ppermute`, one step per device, with
              an online softmax (running max, sum and output in float32); the backward pass
              recomputes each block and rotates dK/dV home (Liu et al. 2023, Ring Attention,
              arXiv 2310.01889; Dao et al. 2022 for the online softmax). Each visiting
              block is taken by halves of queries and keys, and a pair of halves that the
              causal mask, the window or the segments hide entirely is skipped (under load
              balancing, half of every block but the device's own). Each pair by `kernel`:
              the reference maths (dense scores), or on rows in a known order the flex kernel
              (tfm.kernels.ring_flex: one call per pair, placed by its query offset).

Causal load balancing (`load_balance` / `restore_order`): the row is cut into 2N chunks and
device i holds chunks i and 2N-1-i, so every device has the same share of the causal work.
It is a pure permutation of the sequence axis, applied once to the inputs (tokens, positions,
segment ids) and undone on the outputs (tfm.nn.context_split: before the output layer, so the
targets stay as the pipeline shifted them on whole rows); positions and indices travel with the
tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from tfm.kernels import per_device, reference
from tfm.kernels.call import BlockBias
from tfm.kernels.load_balance import (  # noqa: F401  (public here too: the model's side uses them)
    backward_by_pairs,
    halves,
    load_balance,
    load_balanced_index,
    restore_order,
)

AXIS = "context"  # the mesh axis the sequence is split over
STRATEGIES = ("all_gather", "ring")
KERNELS = ("reference", "flex")  # what computes a device's queries against (gathered) keys
LAYOUTS = ("original", "balanced")  # orders of the rows a fused kernel can run on
MeshAxes = str | tuple[str, ...] | None


@functools.partial(jax.tree_util.register_dataclass, meta_fields=("causal", "window", "layout"),
                   data_fields=("query_index", "key_index", "query_segments", "key_segments"))
@dataclasses.dataclass(frozen=True)
class SequenceMask:
    """The attention mask by parts, from per-token values that travel with the tokens.

    Query i attends key j iff query_segments[b, i] == key_segments[b, j] (None: one segment),
    and key_index <= query_index when causal, and |query_index - key_index| <= window when
    window is set. Indices are each token's place in the original (unsplit, unpermuted) row.
    Padding is a segment of its own (id 0 by tfm's convention): its keys are seen by no real
    query. A query that sees no key gets a zero output, as in the reference. layout: how the
    rows are ordered over the axis, when known (LAYOUTS): "original" (device i holds the i-th
    chunk) or "balanced" (`load_balance`'s order); None: any permutation, which only the
    reference maths reads.

    query_index: [batch, q_len] int32; key_index: [batch, kv_len] int32; query_segments:
    [batch, q_len] int32 | None; key_segments: [batch, kv_len] int32 | None (both or neither).
    Under shard_map each device holds its chunk of every array.
    """

    query_index: jax.Array
    key_index: jax.Array
    query_segments: jax.Array | None = None
    key_segments: jax.Array | None = None
    causal: bool = False
    window: int | None = None
    layout: str | None = None


def block_mask(
    mask: SequenceMask,
    key_index: jax.Array,  # [batch, kv_len] int32, the keys of this block
    key_segments: jax.Array | None,  # [batch, kv_len] int32 | None
) -> jax.Array | None:  # [batch, 1, q_len, kv_len] bool, or None: every key visible
    """`mask`'s queries against one block of keys, as the reference's dense mask."""
    masks = []
    if mask.query_segments is not None:
        masks.append(reference.segment_mask(mask.query_segments, key_segments))
    if mask.causal:
        masks.append(reference.causal_mask(mask.query_index, key_index))
    if mask.window is not None:
        masks.append(reference.local_window_mask(mask.query_index, key_index, mask.window))
    return reference.combine_masks(*masks)


def block_bias(
    bias: BlockBias | None,
    key_positions: jax.Array,  # [batch, kv_len] int32, the positions of this block's keys
) -> jax.Array | None:  # [batch, num_heads, q_len, kv_len] float32
    """A position scheme's bias (BlockBias: function and per-head parameters) for the local
    queries against one block of keys, from their global positions."""
    if bias is None:
        return None

    def one_head(head_params, query_row, key_row):  # [P] leaves, [q_len], [kv_len]
        head_params = jax.tree.map(lambda leaf: leaf[None], head_params)
        return bias.function(head_params, query_row[:, None], key_row[None, :])

    per_head = jax.vmap(one_head, in_axes=(0, None, None))
    dense = jax.vmap(per_head, in_axes=(None, 0, 0))(bias.params, bias.query_positions,
                                                    key_positions)
    return dense.astype(jnp.float32)


def gathered_attention(
    query: jax.Array,  # [batch, chunk, num_heads, head_dim], this device's queries
    key: jax.Array,  # [batch, chunk, num_kv_heads, head_dim], this device's keys
    value: jax.Array,  # like key
    mask: SequenceMask,  # this device's chunks
    bias: BlockBias | None = None,  # positions: this device's chunks
    *,
    scale: float | None = None,
    axis_name: str = AXIS,
    kernel: str = "reference",
    compiler: str | None = None,
) -> jax.Array:  # [batch, chunk, num_heads, head_dim]
    """The all_gather strategy, per device under shard_map: the whole row's keys and values
    (and their indices, segments, positions) gathered over `axis_name`, then `kernel`
    (KERNELS; flex: `fused_gathered_attention`, compiled by `compiler`)."""
    if kernel == "flex":
        return fused_gathered_attention(query, key, value, mask, bias, scale=scale,
                                        axis_name=axis_name, compiler=compiler)
    gather = functools.partial(jax.lax.all_gather, axis_name=axis_name, axis=1, tiled=True)
    key_segments = None if mask.key_segments is None else gather(mask.key_segments)
    dense_mask = block_mask(mask, gather(mask.key_index), key_segments)
    dense_bias = None if bias is None else block_bias(bias, gather(bias.key_positions))
    return reference.dot_product_attention(query, gather(key), gather(value), bias=dense_bias,
                                           mask=dense_mask, scale=scale)


def fused_gathered_attention(
    query: jax.Array,  # [batch, chunk, num_heads, head_dim], this device's queries
    key: jax.Array,  # [batch, chunk, num_kv_heads, head_dim], this device's keys
    value: jax.Array,  # like key
    mask: SequenceMask,  # this device's chunks; layout "original" or "balanced"
    bias: BlockBias | None = None,  # positions: this device's chunks
    *,
    scale: float | None = None,
    axis_name: str = AXIS,
    compiler: str | None = None,
) -> jax.Array:  # [batch, chunk, num_heads, head_dim]
    """The all_gather strategy on the flex kernel: keys, values, their segments and positions
    gathered and put back in the row's original order (a static permutation), so a key's
    index is its place; then one kernel call per contiguous run of local queries (the chunk,
    or a load-balanced chunk's two halves), with the run's first original index as the causal
    mask's and the window's query offset. No [chunk, T] array: the mask and the bias are made
    per block. compiler: one of per_device.COMPILERS, None: chosen at lowering."""
    _check_layout(mask)
    flex = importlib.import_module("tfm.kernels.flex_attention")  # Pallas: on first use
    size = jax.lax.axis_size(axis_name)
    balanced = mask.layout == "balanced"

    def gather(x: jax.Array) -> jax.Array:  # [batch, chunk, ...] -> [batch, T, ...], in order
        whole = jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
        return restore_order(whole, size) if balanced else whole

    batch, chunk = query.shape[:2]
    zeros = lambda length: jnp.zeros((batch, length), jnp.int32)  # noqa: E731
    query_segments, key_segments = ((zeros(chunk), zeros(chunk * size))
                                    if mask.query_segments is None else
                                    (mask.query_segments, gather(mask.key_segments)))
    query_positions, key_positions = ((zeros(chunk), zeros(chunk * size)) if bias is None
                                      else (bias.query_positions, gather(bias.key_positions)))
    local = functools.partial(
        flex.attend_local, causal=mask.causal, window=mask.window,
        scale=reference.default_scale(query.shape[-1]) if scale is None else float(scale),
        function=None if bias is None else bias.function,
        learned=bias is not None and bias.learned, compiler=compiler)
    keys, values = gather(key), gather(value)
    outs = []
    for run in halves(chunk) if balanced else [slice(0, chunk)]:
        rows = (query_positions[:, run], key_positions, query_segments[:, run], key_segments)
        outs.append(local(query[:, run], keys, values, rows,
                          None if bias is None else bias.params,
                          query_offset=mask.query_index[:, run.start],
                          cost_offset=_mean_first_index(size, chunk, balanced, run)))
    return jnp.concatenate(outs, axis=1)


def _check_layout(mask: SequenceMask) -> None:
    if mask.layout not in LAYOUTS:
        raise ValueError(f"the flex kernel under context parallelism needs rows in a known "
                         f"order: SequenceMask.layout={mask.layout!r}; choose one of: "
                         f"{', '.join(LAYOUTS)}")


def fused_ring_attention(
    query: jax.Array,  # [batch, chunk, num_heads, head_dim], this device's queries
    key: jax.Array,  # [batch, chunk, num_kv_heads, head_dim], this device's keys
    value: jax.Array,  # like key
    mask: SequenceMask,  # this device's chunks; layout "original" or "balanced"
    bias: BlockBias | None = None,  # positions: this device's chunks
    *,
    scale: float | None = None,
    axis_name: str = AXIS,
    compiler: str | None = None,
) -> jax.Array:  # [batch, chunk, num_heads, head_dim]
    """The ring strategy on the flex kernel (tfm.kernels.ring_flex): each pair of a device's
    query halves and a visiting block's key halves is one kernel call (forward and backward),
    contiguous in the original order, so the causal mask and the window come from the query
    offset; no block's scores reach memory. compiler: one of per_device.COMPILERS, None:
    chosen at lowering."""
    _check_layout(mask)
    reference.check_inputs(query, key, value, None, None, 0.0, None)
    ring_flex = importlib.import_module("tfm.kernels.ring_flex")  # Pallas: on first use
    scale = reference.default_scale(query.shape[-1]) if scale is None else float(scale)
    return ring_flex.ring_attention(query, key, value, mask, bias, scale=scale,
                                    axis_name=axis_name, compiler=compiler)


def _mean_first_index(size: int, chunk: int, balanced: bool, run: slice) -> int:
    """The mean over the `size` devices of a run of local queries' first original index: the
    query offset the kernel's cost estimate assumes (the real one is traced), so that XLA's
    FLOP count is the devices' mean work. Balanced, device i's halves are the row's chunks
    i and 2N-1-i of chunk / 2 tokens; else device i's chunk starts at i x chunk."""
    if not balanced:
        return (size - 1) * chunk // 2
    chunks = np.arange(size) if not run.start else 2 * size - 1 - np.arange(size)
    return int(chunks.mean() * (chunk // 2))


# ------------------------------------------------------------------------------ ring


def _block_scores(
    query: jax.Array,  # [batch, q_len, kv_heads, groups, head_dim]
    block: dict,  # key [batch, kv_len, kv_heads, head_dim], index, segments, positions
    mask: SequenceMask,
    bias: BlockBias | None,
    scale: float,
) -> tuple[jax.Array, jax.Array | None]:
    """(scaled logits + bias [batch, kv_heads, groups, q_len, kv_len] float32, which of them
    are visible [batch, 1, 1, q_len, kv_len] bool or None) of the local queries and one block."""
    num_kv_heads = query.shape[2]
    scores = jnp.einsum("bqkgh,bskh->bkgqs", query, block["key"],
                        preferred_element_type=jnp.float32) * jnp.float32(scale)
    if bias is not None:
        scores = scores + reference.group_heads(block_bias(bias, block["positions"]),
                                                num_kv_heads)
    visible = block_mask(mask, block["index"], block.get("segments"))
    return scores, None if visible is None else visible[:, :, None]


def _if_reached(mask: SequenceMask, block: dict, compute, skipped, operand):
    """compute(operand) when some local query sees some key of `block`, else skipped(operand):
    a block that the causal mask, the window or the segments hide entirely costs no work."""
    visible = block_mask(mask, block["index"], block.get("segments"))
    if visible is None:
        return compute(operand)
    return jax.lax.cond(jnp.any(visible), compute, skipped, operand)


def _forward_block(state: tuple, *, block: dict, query: jax.Array, mask: SequenceMask,
                   bias: BlockBias | None, scale: float) -> tuple:
    """The online softmax (output [b, kv_heads, groups, q_len, head_dim], row max and row sum
    [b, kv_heads, groups, q_len], float32) updated with one block of keys and values."""
    out, row_max, row_sum = state
    scores, visible = _block_scores(query, block, mask, bias, scale)
    if visible is not None:
        scores = jnp.where(visible, scores, reference.MASKED_LOGIT)
    new_max = jnp.maximum(row_max, jnp.max(scores, axis=-1))
    weights = jnp.exp(scores - new_max[..., None])
    if visible is not None:
        weights = jnp.where(visible, weights, 0.0)
    correction = jnp.exp(row_max - new_max)
    value = block["value"]
    update = jnp.einsum("bkgqs,bskh->bkgqh", weights.astype(value.dtype), value,
                        preferred_element_type=jnp.float32)
    return (out * correction[..., None] + update, new_max,
            row_sum * correction + jnp.sum(weights, axis=-1))


def _backward_block(carry: tuple, *, block: dict, query: jax.Array, mask: SequenceMask,
                    bias: BlockBias | None, scale: float, grad_out: jax.Array,
                    log_sum_exp: jax.Array, delta: jax.Array) -> tuple[tuple, tuple]:
    """((dquery [b, q_len, kv_heads, groups, head_dim] f32, dparams), (dkey, dvalue) [b, kv_len,
    kv_heads, head_dim] f32) of one block, from recomputed weights (FlashAttention-2's
    backward). grad_out: like dquery; log_sum_exp, delta: [b, kv_heads, groups, q_len]."""
    dquery, dparams = carry
    scores, visible = _block_scores(query, block, mask, bias, scale)
    weights = jnp.exp(scores - log_sum_exp[..., None])
    if visible is not None:
        weights = jnp.where(visible, weights, 0.0)
    key, value = block["key"], block["value"]
    dvalue = jnp.einsum("bkgqs,bqkgh->bskh", weights, grad_out)
    dweights = jnp.einsum("bqkgh,bskh->bkgqs", grad_out, value.astype(jnp.float32))
    dscores = weights * (dweights - delta[..., None])  # d loss / d (scaled logits + bias)
    dquery = dquery + jnp.einsum("bkgqs,bskh->bqkgh", dscores, key.astype(jnp.float32)) * scale
    dkey = jnp.einsum("bkgqs,bqkgh->bskh", dscores, query.astype(jnp.float32)) * scale
    if bias is not None and bias.learned:
        def dense(params):
            return block_bias(dataclasses.replace(bias, params=params), block["positions"])

        pull = jax.vjp(dense, bias.params)[1]
        batch, kv_heads, groups, q_len, kv_len = dscores.shape
        step = pull(dscores.reshape(batch, kv_heads * groups, q_len, kv_len))[0]
        dparams = jax.tree.map(jnp.add, dparams, step)
    return (dquery, dparams), (dkey, dvalue)


def _query_part(query: jax.Array, mask: SequenceMask, bias: BlockBias | None, part: slice):
    """The local queries [b, part, kv_heads, groups, head_dim] of `part`, with their mask rows
    and bias positions."""
    segments = None if mask.query_segments is None else mask.query_segments[:, part]
    mask = dataclasses.replace(mask, query_index=mask.query_index[:, part],
                               query_segments=segments)
    if bias is not None:
        bias = dataclasses.replace(bias, query_positions=bias.query_positions[:, part])
    return query[:, part], mask, bias


def _visit_forward(state: tuple, block: dict, query: jax.Array, mask: SequenceMask,
                   bias: BlockBias | None, scale: float) -> tuple:
    """The online softmax state (`_forward_block`'s) after one visiting block, by pairs of
    query and key halves, each skipped where the mask hides it."""
    parts = []
    for query_half in halves(query.shape[1]):
        part_query, part_mask, part_bias = _query_part(query, mask, bias, query_half)
        part = tuple(x[:, :, :, query_half] for x in state)  # their q_len axis
        for key_half in halves(block["key"].shape[1]):
            keys = {name: x[:, key_half] for name, x in block.items()}
            update = functools.partial(_forward_block, block=keys, query=part_query,
                                       mask=part_mask, bias=part_bias, scale=scale)
            part = _if_reached(part_mask, keys, update, lambda part: part, part)
        parts.append(part)
    return tuple(jnp.concatenate(xs, axis=3) for xs in zip(*parts, strict=True))


def _visit_backward(carry: tuple, block: dict, query: jax.Array, mask: SequenceMask,
                    bias: BlockBias | None, scale: float, saved: tuple) -> tuple:
    """((dquery, dparams), (dkey, dvalue)) of one visiting block (`_backward_block`'s), by
    pairs of query and key halves, each skipped where the mask hides it. saved: (grad_out,
    log_sum_exp, delta), per query as in `_backward_block`."""
    zeros = lambda half: tuple(jnp.zeros(block[name][:, half].shape, jnp.float32)  # noqa: E731
                               for name in ("key", "value"))
    grad_out, log_sum_exp, delta = saved

    def pair(part, query_half, key_half):
        part_query, part_mask, part_bias = _query_part(query, mask, bias, query_half)
        keys = {name: x[:, key_half] for name, x in block.items()}
        compute = functools.partial(
            _backward_block, block=keys, query=part_query, mask=part_mask, bias=part_bias,
            scale=scale, grad_out=grad_out[:, query_half],
            log_sum_exp=log_sum_exp[..., query_half], delta=delta[..., query_half])
        nothing = zeros(key_half)
        return _if_reached(part_mask, keys, compute, lambda part: (part, nothing), part)

    return backward_by_pairs(carry, query.shape[1], block["key"].shape[1], zeros, pair)


def _ring_forward(query, block, mask, bias, scale, axis_name):
    """(out [b, q_len, heads, head_dim] in query's dtype, log-sum-exp [b, kv_heads, groups,
    q_len] f32) of the grouped query [b, q_len, kv_heads, groups, head_dim] against every
    device's block, the blocks rotating N - 1 times."""
    batch, q_len, kv_heads, groups, head_dim = query.shape
    stats = jnp.full((batch, kv_heads, groups, q_len), reference.MASKED_LOGIT, jnp.float32)
    state = (jnp.zeros((*stats.shape, head_dim), jnp.float32), stats, jnp.zeros_like(stats))

    def visit(state, block):
        return _visit_forward(state, block, query, mask, bias, scale)

    def step(carry, _):
        state, block = carry
        return (visit(state, block), per_device.rotate(block, axis_name)), None

    size = jax.lax.psum(1, axis_name)
    (state, block), _ = jax.lax.scan(step, (state, block), None, length=size - 1)
    out, row_max, row_sum = visit(state, block)
    seen = row_sum > 0  # a query that sees no key reads nothing (zero output)
    row_sum = jnp.where(seen, row_sum, 1.0)
    out = jnp.where(seen[..., None], out / row_sum[..., None], 0.0)
    out = jnp.moveaxis(out, 3, 1).reshape(batch, q_len, kv_heads * groups, head_dim)
    return out.astype(query.dtype), row_max + jnp.log(row_sum)


def _ring_backward(query, block, mask, bias, scale, axis_name, grad_out, log_sum_exp, delta):
    """(dquery, dparams, (dkey, dvalue)) of the ring: the blocks rotate as in the forward pass
    with their dK/dV accumulators, which take one more step home at the end."""
    carry = (jnp.zeros(query.shape, jnp.float32),
             None if bias is None else jax.tree.map(jnp.zeros_like, bias.params))
    grads = jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float32),
                         (block["key"], block["value"]))

    def backward(carry, block):
        return _visit_backward(carry, block, query, mask, bias, scale,
                               (grad_out, log_sum_exp, delta))

    def step(state, _):
        carry, block, grads = state
        carry, block_grads = backward(carry, block)
        grads = jax.tree.map(jnp.add, grads, block_grads)
        return (carry, *per_device.rotate((block, grads), axis_name)), None

    size = jax.lax.psum(1, axis_name)
    (carry, block, grads), _ = jax.lax.scan(step, (carry, block, grads), None, length=size - 1)
    (dquery, dparams), block_grads = backward(carry, block)
    grads = per_device.rotate(jax.tree.map(jnp.add, grads, block_grads), axis_name)
    return dquery, dparams, grads


def _ring_function(function, learned: bool, scale: float, axis_name: str):
    """The ring as a jax.custom_vjp of (query, key, value, bias params, (mask, bias
    positions)): integer inputs take no gradient."""

    def parts(query, key, value, params, rows):
        mask, positions = rows
        bias = None if function is None else BlockBias(function, params, *positions, learned)
        block = {"key": key, "value": value, "index": mask.key_index,
                 "segments": mask.key_segments, "positions": None if bias is None
                 else bias.key_positions}
        batch, q_len, num_heads, head_dim = query.shape
        grouped = query.reshape(batch, q_len, key.shape[2], -1, head_dim)
        return grouped, {name: x for name, x in block.items() if x is not None}, mask, bias

    @jax.custom_vjp
    def ring(query, key, value, params, rows):
        grouped, block, mask, bias = parts(query, key, value, params, rows)
        return _ring_forward(grouped, block, mask, bias, scale, axis_name)[0]

    def forward(query, key, value, params, rows):
        grouped, block, mask, bias = parts(query, key, value, params, rows)
        out, log_sum_exp = _ring_forward(grouped, block, mask, bias, scale, axis_name)
        return out, (query, key, value, params, rows, out, log_sum_exp)

    def backward(saved, grad_out):
        query, key, value, params, rows, out, log_sum_exp = saved
        grouped, block, mask, bias = parts(query, key, value, params, rows)
        grad_out = grad_out.astype(jnp.float32).reshape(grouped.shape)
        delta = jnp.einsum("bqkgh,bqkgh->bkgq", grad_out,
                           out.astype(jnp.float32).reshape(grouped.shape))
        dquery, dparams, (dkey, dvalue) = _ring_backward(
            grouped, block, mask, bias, scale, axis_name, grad_out, log_sum_exp, delta)
        return (dquery.reshape(query.shape).astype(query.dtype), dkey.astype(key.dtype),
                dvalue.astype(value.dtype), dparams, None)

    ring.defvjp(forward, backward)
    return ring


def ring_attention(
    query: jax.Array,  # [batch, chunk, num_heads, head_dim], this device's queries
    key: jax.Array,  # [batch, chunk, num_kv_heads, head_dim], this device's keys
    value: jax.Array,  # like key
    mask: SequenceMask,  # this device's chunks
    bias: BlockBias | None = None,  # positions: this device's chunks
    *,
    scale: float | None = None,
    axis_name: str = AXIS,
) -> jax.Array:  # [batch, chunk, num_heads, head_dim]
    """The ring strategy, per device under shard_map: keys and values (with their indices,
    segments and positions) visit every device of `axis_name` in turn; the forward keeps an
    online softmax, the backward recomputes each block and rotates dK/dV back home. Gradients
    flow to query, key, value and a learned bias's parameters (summed over the ring)."""
    reference.check_inputs(query, key, value, None, None, 0.0, None)
    scale = reference.default_scale(query.shape[-1]) if scale is None else float(scale)
    function = None if bias is None else bias.function
    ring = _ring_function(function, bias is not None and bias.learned, scale, axis_name)
    params = None if bias is None else bias.params
    positions = None if bias is None else (bias.query_positions, bias.key_positions)
    return ring(query, key, value, params, (mask, positions))


def attention_shard(
    query: jax.Array,  # [batch, chunk, num_heads, head_dim]
    key: jax.Array,  # [batch, chunk, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    mask: SequenceMask,
    bias: BlockBias | None = None,
    *,
    strategy: str = "all_gather",
    scale: float | None = None,
    axis_name: str = AXIS,
    kernel: str = "reference",
    compiler: str | None = None,
) -> jax.Array:  # [batch, chunk, num_heads, head_dim]
    """Context-parallel attention on one device's chunk, by `strategy` (STRATEGIES) and
    `kernel` (KERNELS: each block by the reference maths, or by the flex kernel compiled by
    `compiler`); call it inside jax.shard_map over `axis_name`. Same values as the reference
    on the whole row."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} is unknown; choose one of: {', '.join(KERNELS)}")
    if strategy == "all_gather":
        return gathered_attention(query, key, value, mask, bias, scale=scale,
                                  axis_name=axis_name, kernel=kernel, compiler=compiler)
    if strategy == "ring":
        if kernel == "flex":
            return fused_ring_attention(query, key, value, mask, bias, scale=scale,
                                        axis_name=axis_name, compiler=compiler)
        return ring_attention(query, key, value, mask, bias, scale=scale, axis_name=axis_name)
    raise ValueError(f"context_parallel={strategy!r} is unknown; choose one of: "
                     f"{', '.join(STRATEGIES)}")


def context_attention(
    query: jax.Array,  # [batch, length, num_heads, head_dim], the whole (possibly permuted) row
    key: jax.Array,  # [batch, length, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    mask: SequenceMask,  # whole rows, in the same order as query
    bias: BlockBias | None = None,  # params: [num_heads, P] leaves
    *,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    strategy: str = "all_gather",
    scale: float | None = None,
    batch_axes: MeshAxes = None,
    head_axes: MeshAxes = None,
    axis_name: str = AXIS,
    kernel: str = "reference",
) -> jax.Array:  # [batch, length, num_heads, head_dim]
    """`attention_shard` under jax.shard_map: the length split over `axis_name`, the batch over
    `batch_axes` and the heads (and the bias parameters' head rows) over `head_axes`. `mesh`
    defaults to the one set by jax.set_mesh; a Pallas `kernel` compiles for its devices'
    platform (chosen at lowering when the mesh names none)."""
    abstract = (jax.sharding.get_abstract_mesh() if mesh is None else mesh).abstract_mesh
    device = abstract.abstract_device
    compiler = None if device is None else per_device.COMPILER_OF_PLATFORM.get(
        device.platform, "interpret")
    row_spec = P(batch_axes, axis_name)
    tensor_spec = P(batch_axes, axis_name, head_axes, None)
    mask_specs = jax.tree.map(lambda _: row_spec, mask)
    bias_specs = None if bias is None else dataclasses.replace(
        bias, params=jax.tree.map(lambda _: P(head_axes, None), bias.params),
        query_positions=row_spec, key_positions=row_spec)
    run = functools.partial(attention_shard, strategy=strategy, scale=scale,
                            axis_name=axis_name, kernel=kernel, compiler=compiler)
    return jax.shard_map(
        run, mesh=mesh, check_vma=False,
        in_specs=(tensor_spec, tensor_spec, tensor_spec, mask_specs, bias_specs),
        out_specs=tensor_spec,
    )(query, key, value, mask, bias)


def mesh_context_size() -> int:
    """The size of the `context` axis of the mesh set around tracing (jax.set_mesh), 1 if
    there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or AXIS not in mesh.axis_names:
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))[AXIS]


def attention_by_rules(
    query: jax.Array,  # [batch, length, num_heads, head_dim]
    key: jax.Array,  # [batch, length, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    mask: SequenceMask,  # whole rows
    bias: BlockBias | None = None,
    *,
    strategy: str = "all_gather",
    scale: float | None = None,
    kernel: str = "reference",
) -> jax.Array:  # [batch, length, num_heads, head_dim]
    """`context_attention` over the mesh set around tracing, split by `axes_by_rules`."""
    mesh, batch, heads = axes_by_rules(query, key)
    return context_attention(query, key, value, mask, bias, mesh=mesh, strategy=strategy,
                             scale=scale, batch_axes=batch, head_axes=heads, kernel=kernel)


def axes_by_rules(query: jax.Array, key: jax.Array) -> tuple:  # [B, T, N, H], [B, S, K, H]
    """The mesh set around tracing; the batch's and heads' mesh axes by flax's logical axis
    rules where they divide (heads: None unless query and kv heads split alike)."""
    mesh = jax.sharding.get_abstract_mesh()
    batch = per_device.divisible(nn.logical_to_mesh_axes(("batch",)), query.shape[:1], mesh)[0]
    heads = per_device.divisible(nn.logical_to_mesh_axes(("heads",)), query.shape[2:3], mesh)[0]
    kv_heads = per_device.divisible(nn.logical_to_mesh_axes(("kv_heads",)), key.shape[2:3],
                                    mesh)[0]
    return mesh, batch, heads if heads == kv_heads else None
