"""Flash attention with the position scheme's logit bias computed per block inside the kernel
(Pallas: Mosaic on TPU, Triton on GPU, interpret mode elsewhere): ALiBi, T5 buckets, or any
scheme that gives a block bias function (tfm.nn.positions.BlockBiasFn), with the mask built
per block from its parts (causal, local window, packed segments, padding). No [batch, heads,
q_len, kv_len] score, bias or mask array reaches memory, in the forward or the backward pass;
the backward accumulates the bias parameters' gradient (the T5 table) block by block. Shaw's
relative positions do not fit this form (their bias is q_i . r[k - q], a function of the
query vector, not of positions): they keep the reference.

In the spirit of FlexAttention (Dong et al. 2024, arXiv 2412.05496: a score modification
compiled into one flash kernel). Online softmax over key blocks (Dao et al. 2022,
FlashAttention; the backward recomputes scores from the saved log-sum-exp, FlashAttention-2).

Layout inside: heads-major [batch, heads, length, head_dim], lengths padded to 128-lane blocks
(padded keys get a segment no query has); under Mosaic a query, key and value narrower than a
lane tile are read as [.., head_dim, length] (tfm.kernels.flex_operands). Grid (batch, head,
query block) with a loop over the key blocks the mask can reach (causal and window ranges are
skipped, as are padded blocks); on TPU the head's keys and values stay in on-chip memory (VMEM)
while the chip's budget holds them (tfm.kernels.flex_vmem: single-buffered where two copies
would not fit), else they stream from HBM one key block at a time; on GPU 64-row tiles are read
from HBM. The dk/dv pass works on transposed [block_k, block_q] tiles, so that its per-query
rows (positions, segments, log-sum-exp) are lane-dense [1, q_len] arrays. GQA: query head h
reads kv head h // (heads / kv_heads). Same values as the reference (tfm.nn.attention) at every
real query, including zero output for a query that sees no key. A prefill chunk reading a KV
cache runs here with its rows' query offset; decoding steps run the reference on the cache as
stored.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

from tfm.checks import ConfigError
from tfm.kernels import flex_blocks, flex_operands, flex_vmem, masks, per_device, reference
from tfm.kernels.call import AttentionCall
from tfm.kernels.flex_spec import KernelSpec
from tfm.kernels.tpu_cache import TPU_LAYOUT

TRITON_BLOCK = 64  # query and key blocks on GPU
MASKED = reference.MASKED_LOGIT
NO_KEY_LSE = 1e30  # log-sum-exp of a query that sees no key: every weight exp(s - it) is 0
_Spec = KernelSpec  # the name the kernels below (and tests) use


def serves(call: AttentionCall, q_len: int, kv_len: int) -> bool:
    """Whether this kernel computes the call (else the reference does): calls that describe
    their mask, and their bias if any, by parts (a KV cache read: prefill chunks only)."""
    if not per_device.blocked(call, q_len, kv_len):
        return False
    return call.bias is None or call.structure.bias is not None


def attention(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim]; call.cache_layout: TPU_LAYOUT's
    value: jax.Array,  # like key
    call: AttentionCall,
) -> jax.Array:  # [batch, q_len, num_heads, head_dim]
    """softmax(Q K^T * scale + bias) V with the bias and mask made per block; under
    shard_map on a multi-device mesh (tfm.kernels.per_device)."""
    if call.dropout_rate > 0 or call.return_weights:
        raise ConfigError("attention_backend='flex' has no attention dropout and returns no "
                          "weights; use 'reference'")
    slots = key.shape[TPU_LAYOUT.slot_axis(True) if call.cache_layout else 1]
    if not serves(call, query.shape[1], slots):  # a cache read: the reference, as it is stored
        return masks.reference_attention(query, key, value, call, TPU_LAYOUT)
    call, key, value = masks.in_model_order(call, key, value, TPU_LAYOUT)  # a chunk's copy
    query, key, value, _, _ = reference.check_inputs(query, key, value, None, None, 0.0, None)
    structure = call.structure
    (batch, q_len), kv_len = query.shape[:2], key.shape[1]
    scale = reference.default_scale(query.shape[-1]) if call.scale is None else call.scale
    bias = structure.bias
    segments = masks.block_segments(structure, q_len, per_device.PADDING_KEY_SEGMENT)
    if segments is None:
        segments = (jnp.zeros((batch, q_len), jnp.int32), jnp.zeros((batch, kv_len), jnp.int32))
    query_segments, key_segments = segments
    positions = segments if bias is None else (bias.query_positions, bias.key_positions)
    offset = () if structure.query_offset is None else (structure.query_offset,)  # [batch]
    rows = (*(ids.astype(jnp.int32) for ids in positions),  # (positions unread without bias)
            query_segments.astype(jnp.int32), key_segments.astype(jnp.int32), *offset)
    local = functools.partial(
        attend_local, causal=structure.causal, window=structure.window, scale=scale,
        function=None if bias is None else bias.function,
        learned=bias is not None and bias.learned,
    )
    params = None if bias is None else bias.params
    return per_device.run(local, query, key, value, rows, params,
                          backend="attention_backend='flex'")


def _scores(spec: _Spec, query: jax.Array, key: jax.Array, rows: tuple, params: Any,
            first_query: Any, first_key: Any, transposed: bool = False,
            ) -> tuple[jax.Array, jax.Array]:
    """Scaled scores plus bias [block_q, block_k] float32 and which pairs may attend.
    query: [block_q, head_dim]; key: [block_k, head_dim] ([head_dim, block_k] when
    spec.seq_minor; transposed: key [block_k, head_dim], query [head_dim, block_q]); rows:
    (query positions [block_q, 1], key positions [1, block_k], query segments [block_q, 1],
    key segments [1, block_k]).
    transposed: [block_k, block_q] instead, from query rows [1, block_q] and key columns
    [block_k, 1] (the block function is elementwise in the positions, so broadcasting the
    other way round gives its transpose)."""
    query_positions, key_positions, query_segments, key_segments = rows
    first, second = (key, query) if transposed else (query, key)  # second: a block as read
    scores = _dot_t(spec, first, second, spec.seq_minor) * jnp.float32(spec.scale)
    if spec.function is not None:
        scores = scores + spec.function(params, query_positions, key_positions)
    shape = scores.shape
    query_axis, key_axis = (1, 0) if transposed else (0, 1)
    query_index = first_query + jax.lax.broadcasted_iota(jnp.int32, shape, query_axis)
    key_index = first_key + jax.lax.broadcasted_iota(jnp.int32, shape, key_axis)
    mask = query_segments == key_segments
    back, ahead = spec.reach
    if back is not None:
        mask = mask & (query_index - key_index <= back)
    if ahead is not None:
        mask = mask & (key_index - query_index <= ahead)
    return scores, mask


def _dot(spec: _Spec, a: jax.Array, b: jax.Array, seq_minor: bool = False) -> jax.Array:
    """a [m, n] @ b [n, d] ([d, n] read with the sequence on the lanes) -> [m, d] float32."""
    dims = ((1,), (1,) if seq_minor else (0,))
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32,
                               precision=spec.precision)


def _dot_t(spec: _Spec, a: jax.Array, b: jax.Array, seq_minor: bool = False) -> jax.Array:
    """a [m, d] @ b^T, b [n, d] ([d, n] read with the sequence on the lanes) -> [m, n]."""
    dims = ((1,), (0,) if seq_minor else (1,))
    return jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32,
                               precision=spec.precision)


def _rows(spec: _Spec, tile: jax.Array) -> jax.Array:
    """A query, key or value tile read once per grid step, as [n, head_dim]. (Interpreted, a
    barrier keeps XLA's CPU dot from folding the transpose in: it has no bfloat16 x bfloat16
    -> float32 product with the lhs contracted on its first axis.)"""
    if not spec.seq_minor:
        return tile
    return jax.lax.optimization_barrier(tile.T) if spec.compiler == "interpret" else tile.T


def _key_loop(spec: _Spec, refs: tuple, scratch: Any, first: Any, end: Any,
              visit: Callable[..., Any], init: Any) -> Any:
    """flex_vmem.block_loop over key blocks [first, end) of the grid step's kv head: refs
    (keys, values, key positions, key segments), held whole or (scratch) streamed from HBM."""
    leads = (pl.program_id(0), jax.lax.div(pl.program_id(1), spec.groups))
    axis = int(spec.seq_minor)  # keys and values as read: [head_dim, kv_len] when seq_minor
    return flex_vmem.block_loop(refs, (axis, axis, 1, 1), spec.block_k, first, end, visit, init,
                                (leads, leads, leads[:1], leads[:1]), scratch)


def _forward_kernel(spec: _Spec, streamed: int, *refs: Any) -> None:
    refs, scratch = flex_vmem.split_scratch(refs, streamed)
    (query_ref, key_ref, value_ref, query_pos_ref, key_pos_ref, query_seg_ref, key_seg_ref,
     *param_refs, out_ref, lse_ref) = refs
    offset_refs, param_refs = param_refs[:spec.offset], param_refs[spec.offset:]
    first_query = spec.first_query(offset_refs, pl.program_id(2))
    block_k = spec.block_k
    query = _rows(spec, query_ref[...])
    query_rows = (query_pos_ref[...], query_seg_ref[...])
    params = jax.tree.unflatten(spec.params_tree, [ref[...] for ref in param_refs])

    def visit(k_block, views, carry):
        key_view, value_view, key_pos_view, key_seg_view = views
        running_max, total, acc = carry
        start = pl.multiple_of(k_block * block_k, block_k)
        rows = (query_rows[0], key_pos_view[...], query_rows[1], key_seg_view[...])
        scores, mask = _scores(spec, query, key_view[...], rows, params, first_query, start)
        scores = jnp.where(mask, scores, MASKED)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1, keepdims=True))
        weights = jnp.where(mask, jnp.exp(scores - new_max), 0.0)
        rescale = jnp.exp(running_max - new_max)
        total = rescale * total + jnp.sum(weights, axis=1, keepdims=True)
        value = value_view[...]
        acc = rescale * acc + _dot(spec, weights.astype(value.dtype), value, spec.seq_minor)
        return new_max, total, acc

    first, end = spec.key_blocks(first_query)
    rows_shape = (spec.block_q, 1)
    init = (jnp.full(rows_shape, MASKED, jnp.float32), jnp.zeros(rows_shape, jnp.float32),
            jnp.zeros(query.shape, jnp.float32))
    running_max, total, acc = _key_loop(spec, (key_ref, value_ref, key_pos_ref, key_seg_ref),
                                        scratch, first, end, visit, init)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    out_ref[...] = jnp.where(seen, acc / total, 0.0).astype(out_ref.dtype)
    lse_ref[...] = _transposed(jnp.where(seen, running_max + jnp.log(total), NO_KEY_LSE))


def _transposed(vector: jax.Array) -> jax.Array:  # [n, 1] -> [1, n], [1, n] -> [n, 1]
    """A query block's per-query figure (log-sum-exp, delta) turned, exactly, between the
    column the scores' row reductions give and the lane-dense row it is stored as: a
    [b, heads, 1, len] row takes 1/16 of the HBM of a [b, heads, len, 1] column, whose one lane
    TPU tiles pad to 128 (GPT-2 small at 32,768 tokens: 192 MiB per layer's log-sum-exp, kept
    for the backward pass). By a diagonal mask and a sum of one value and zeros, which any
    Pallas backend lowers: n^2 elementwise operations per query block."""
    n = max(vector.shape)
    diagonal = (jax.lax.broadcasted_iota(jnp.int32, (n, n), 0)
                == jax.lax.broadcasted_iota(jnp.int32, (n, n), 1))
    return jnp.sum(jnp.where(diagonal, vector, 0.0), axis=int(vector.shape[0] == 1),
                   keepdims=True)


def _weights_and_score_grads(spec: _Spec, query, key, value, out_grad, lse, delta, rows, params,
                             first_query, first_key, transposed: bool = False,
                             ) -> tuple[jax.Array, jax.Array]:
    """The block's softmax weights and d loss / d scores (= d loss / d bias), both
    [block_q, block_k] float32 ([block_k, block_q] when transposed), from the saved
    log-sum-exp and delta = rowsum(dO * O), [block_q, 1] (rows [1, block_q] when transposed)."""
    scores, mask = _scores(spec, query, key, rows, params, first_query, first_key, transposed)
    weights = jnp.where(mask, jnp.exp(scores - lse), 0.0)
    first, second = (value, out_grad) if transposed else (out_grad, value)
    weight_grads = _dot_t(spec, first, second, spec.seq_minor and not transposed)
    return weights, weights * (weight_grads - delta)


def _query_grad_kernel(spec: _Spec, num_params: int, streamed: int, *refs: Any) -> None:
    refs, scratch = flex_vmem.split_scratch(refs, streamed)
    (query_ref, key_ref, value_ref, out_grad_ref, lse_ref, delta_ref, query_pos_ref,
     key_pos_ref, query_seg_ref, key_seg_ref, *rest) = refs
    offset_refs, rest = rest[:spec.offset], rest[spec.offset:]
    param_refs, query_grad_ref, param_grad_refs = (
        rest[:num_params], rest[num_params], rest[num_params + 1:])
    first_query = spec.first_query(offset_refs, pl.program_id(2))
    block_k = spec.block_k
    query, out_grad = _rows(spec, query_ref[...]), out_grad_ref[...]
    lse, delta = _transposed(lse_ref[...]), _transposed(delta_ref[...])
    params = jax.tree.unflatten(spec.params_tree, [ref[...] for ref in param_refs])

    def visit(k_block, views, carry):
        key_view, value_view, key_pos_view, key_seg_view = views
        query_grad, param_grads = carry
        start = pl.multiple_of(k_block * block_k, block_k)
        key = key_view[...]
        rows = (query_pos_ref[...], key_pos_view[...], query_seg_ref[...], key_seg_view[...])
        _, score_grads = _weights_and_score_grads(
            spec, query, key, value_view[...], out_grad, lse, delta, rows, params,
            first_query, start)
        query_grad = query_grad + _dot(spec, score_grads.astype(key.dtype), key, spec.seq_minor)
        if param_grads:
            _, pull = jax.vjp(lambda p: spec.function(p, rows[0], rows[1]), params)
            (grads,) = pull(score_grads)
            param_grads = tuple(total + grad for total, grad in
                                zip(param_grads, jax.tree.leaves(grads), strict=True))
        return query_grad, param_grads

    first, end = spec.key_blocks(first_query)
    init_params = tuple(jnp.zeros(ref.shape, jnp.float32) for ref in param_grad_refs)
    query_grad, param_grads = _key_loop(
        spec, (key_ref, value_ref, key_pos_ref, key_seg_ref), scratch, first, end, visit,
        (jnp.zeros(query.shape, jnp.float32), init_params))
    query_grad_ref[...] = (query_grad * jnp.float32(spec.scale)).astype(query_grad_ref.dtype)
    for ref, grad in zip(param_grad_refs, param_grads, strict=True):
        ref[...] = grad


def _key_value_grad_kernel(spec: _Spec, streamed: int, *refs: Any) -> None:
    """dk, dv of one key block of one query head, over the query blocks that can see it,
    in the transposed orientation ([block_k, block_q] tiles): the per-query figures (positions,
    segments, log-sum-exp, delta) are then lane-dense rows [1, q_len], held whole on chip with
    the head's queries and output gradients, or (streamed) copied from HBM block by block."""
    refs, scratch = flex_vmem.split_scratch(refs, streamed)
    (query_ref, key_ref, value_ref, out_grad_ref, lse_ref, delta_ref, query_pos_ref,
     key_pos_ref, query_seg_ref, key_seg_ref, *rest) = refs
    offset_refs, param_refs = rest[:spec.offset], rest[spec.offset:-2]
    key_grad_ref, value_grad_ref = rest[-2:]
    offset = spec.first_query(offset_refs, 0)  # the row's query offset (0 without one)
    k_block = pl.program_id(2)
    block_q = spec.block_q
    key, value = _rows(spec, key_ref[...]), _rows(spec, value_ref[...])
    key_columns = (key_pos_ref[...], key_seg_ref[...])  # [block_k, 1]
    params = jax.tree.unflatten(spec.params_tree, [ref[...] for ref in param_refs])

    def visit(q_block, views, carry):
        query_view, out_grad_view, lse_view, delta_view, query_pos_view, query_seg_view = views
        key_grad, value_grad = carry
        start = pl.multiple_of(q_block * block_q, block_q)
        query, out_grad = query_view[...], out_grad_view[...]
        rows = (query_pos_view[...], key_columns[0], query_seg_view[...], key_columns[1])
        weights, score_grads = _weights_and_score_grads(
            spec, query, key, value, out_grad, lse_view[...], delta_view[...],
            rows, params, start + offset, k_block * spec.block_k, transposed=True)
        value_grad = value_grad + _dot(spec, weights.astype(out_grad.dtype), out_grad)
        key_grad = key_grad + _dot(spec, score_grads.astype(query.dtype), query, spec.seq_minor)
        return key_grad, value_grad

    first, end = spec.query_blocks(k_block, offset)
    zeros = jnp.zeros(key.shape, jnp.float32)
    head = (pl.program_id(0), pl.program_id(1))
    key_grad, value_grad = flex_vmem.block_loop(
        (query_ref, out_grad_ref, lse_ref, delta_ref, query_pos_ref, query_seg_ref),
        (int(spec.seq_minor), 0, 1, 1, 1, 1), block_q, first, end, visit, (zeros, zeros),
        (head, head, head, head, head[:1], head[:1]), scratch)
    key_grad_ref[...] = (key_grad * jnp.float32(spec.scale)).astype(key_grad_ref.dtype)
    value_grad_ref[...] = value_grad.astype(value_grad_ref.dtype)


def _pallas(spec: _Spec, kernel: Callable[..., None], grid: tuple[int, ...],
            in_specs: list, out_specs: Any, out_shape: Any, cost: pl.CostEstimate,
            vmem_bytes: int, *args: Any, scratch: tuple = ()) -> Any:
    limit = flex_vmem.call_limit(spec.vmem_budget, vmem_bytes)

    def call(*args: Any, compiler: str) -> Any:
        if compiler == "triton":
            params = plgpu.CompilerParams(num_warps=4, num_stages=2)
        else:
            params = pltpu.CompilerParams(dimension_semantics=("parallel",) * len(grid),
                                          vmem_limit_bytes=limit)
        return pl.pallas_call(
            kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
            scratch_shapes=scratch, interpret=compiler == "interpret", cost_estimate=cost,
            name="tfm_flex_attention",
            compiler_params=params,
        )(*args)

    return call(*args, compiler=spec.compiler)


def _nbytes(*arrays: Any) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(arrays))


def _forward(spec: _Spec, query, key, value, rows, params):
    batch, heads, q_padded, head_dim = query.shape
    kv_padded = key.shape[2]
    query_pos, key_pos, query_seg, key_seg, *offsets = rows
    param_leaves = jax.tree.leaves(params)
    pairs = batch * heads * spec.visible_pairs()
    keys = flex_vmem.key_inputs(spec, batch * heads, kv_padded, head_dim, key.dtype)
    cost = pl.CostEstimate(flops=4 * pairs * head_dim, transcendentals=pairs,
                           bytes_accessed=_nbytes(query, key, value, rows, query)
                           + keys.extra_bytes)
    grid = (batch, heads, q_padded // spec.block_q)
    query_spec, query_rows = (flex_blocks.query_block(spec, head_dim),
                              flex_blocks.column(spec.block_q, True))
    query_read = flex_blocks.query_block(spec, head_dim, operand=True)
    query, key, value = (flex_operands.as_read(spec.seq_minor, x) for x in (query, key, value))
    out, lse = _pallas(
        spec, functools.partial(_forward_kernel, spec, keys.streamed), grid,
        [query_read, keys.operand, keys.operand, query_rows, keys.row, query_rows, keys.row,
         *flex_blocks.offsets(spec, rows), *map(flex_blocks.per_head_row, param_leaves)],
        [query_spec, flex_blocks.row_stats(spec)],
        [jax.ShapeDtypeStruct((batch, heads, q_padded, head_dim), query.dtype),
         jax.ShapeDtypeStruct((batch, heads, 1, q_padded), jnp.float32)],
        cost, keys.on_chip,
        query, key, value, query_pos, key_pos, query_seg, key_seg, *offsets, *param_leaves,
        scratch=keys.scratch,
    )
    return out, lse


def _query_grads(spec: _Spec, inputs: tuple, num_params: int) -> list:
    """dq and the per-query-block bias parameter gradients, over grid (batch, head, query
    block), reading the kv head's key blocks held whole or streamed (`_key_inputs`)."""
    query, key, *_ = inputs
    batch, heads, q_padded, head_dim = query.shape
    param_leaves = inputs[len(inputs) - num_params:]
    q_blocks = q_padded // spec.block_q
    learned = spec.learned and bool(param_leaves)
    param_grad_shapes = [jax.ShapeDtypeStruct((batch, heads, q_blocks, 1, leaf.shape[-1]),
                                              jnp.float32) for leaf in param_leaves] * learned
    param_grad_specs = [pl.BlockSpec((None, None, None, 1, leaf.shape[-1]),
                                     lambda b, h, i: (b, h, i, 0, 0))
                        for leaf in param_leaves] * learned
    keys = flex_vmem.key_inputs(spec, batch * heads, key.shape[2], head_dim, key.dtype)
    pairs = batch * heads * spec.visible_pairs()
    query_spec, query_rows = (flex_blocks.query_block(spec, head_dim),
                              flex_blocks.column(spec.block_q, True))
    stats = flex_blocks.row_stats(spec)
    read = tuple(flex_operands.as_read(spec.seq_minor, x) for x in inputs[:3])
    return _pallas(
        spec, functools.partial(_query_grad_kernel, spec, num_params, keys.streamed),
        (batch, heads, q_blocks),
        [flex_blocks.query_block(spec, head_dim, operand=True), keys.operand, keys.operand,
         query_spec, stats, stats, query_rows, keys.row,
         query_rows, keys.row, *flex_blocks.offsets(spec, inputs[6:10]),
         *map(flex_blocks.per_head_row, param_leaves)],
        [query_spec, *param_grad_specs],
        [jax.ShapeDtypeStruct(query.shape, query.dtype), *param_grad_shapes],
        pl.CostEstimate(flops=6 * pairs * head_dim, transcendentals=pairs,
                        bytes_accessed=_nbytes(*inputs, query) + keys.extra_bytes),
        keys.on_chip, *read, *inputs[3:], scratch=keys.scratch,
    )


def _key_value_grads(spec: _Spec, inputs: tuple, num_params: int) -> list:
    """dk and dv of every query head, over grid (batch, head, key block), in the transposed
    orientation: per-query figures as rows [1, q_len]."""
    (query, key, value, out_grad, lse, delta, query_pos, key_pos, query_seg, key_seg,
     *rest) = inputs
    offsets, param_leaves = rest[:len(rest) - num_params], rest[len(rest) - num_params:]
    batch, heads, q_padded, head_dim = query.shape
    kv_padded = key.shape[2]
    pairs = batch * heads * spec.visible_pairs()
    per_query_head = jax.ShapeDtypeStruct((batch, heads, kv_padded, head_dim), key.dtype)
    as_row = lambda column: column.reshape(*column.shape[:-2], 1, column.shape[-2])
    as_column = lambda row: row.reshape(*row.shape[:-2], row.shape[-1], 1)
    read = (flex_operands.as_read(spec.seq_minor, x) for x in (query, key, value))
    transposed_inputs = (*read, out_grad, lse, delta, as_row(query_pos),
                         as_column(key_pos), as_row(query_seg), as_column(key_seg), *offsets,
                         *param_leaves)
    reads = flex_vmem.query_inputs(spec, batch * heads, q_padded, head_dim, query.dtype)
    query_rows, whole_rows = reads.row, reads.head_row
    key_spec = flex_blocks.key_block(spec, head_dim, spec.groups, operand=True)
    key_columns = flex_blocks.column(spec.block_k, True)
    return _pallas(
        spec, functools.partial(_key_value_grad_kernel, spec, reads.streamed),
        (batch, heads, kv_padded // spec.block_k),
        [reads.operand, key_spec, key_spec, reads.head, whole_rows, whole_rows, query_rows,
         key_columns, query_rows, key_columns, *flex_blocks.offsets(spec, inputs[6:10]),
         *map(flex_blocks.per_head_row, param_leaves)],
        [flex_blocks.key_block(spec, head_dim)] * 2,
        [per_query_head, per_query_head],
        pl.CostEstimate(flops=8 * pairs * head_dim, transcendentals=pairs,
                        bytes_accessed=_nbytes(*inputs, key, value) + reads.extra_bytes),
        reads.on_chip, *transposed_inputs, scratch=reads.scratch,
    )


def _backward(spec: _Spec, query, key, value, rows, params, out, lse, out_grad):
    batch, kv_heads, kv_padded, head_dim = key.shape
    param_leaves = jax.tree.leaves(params)
    delta = jnp.sum(out_grad.astype(jnp.float32) * out.astype(jnp.float32),
                    axis=-1)[:, :, None, :]  # [batch, heads, 1, q_padded], as lse
    inputs = (query, key, value, out_grad, lse, delta, *rows, *param_leaves)
    query_grad, *param_grads = _query_grads(spec, inputs, len(param_leaves))
    key_grad, value_grad = _key_value_grads(spec, inputs, len(param_leaves))

    def per_kv_head(grad: jax.Array) -> jax.Array:  # sum the query heads of each kv head
        grouped = grad.astype(jnp.float32).reshape(batch, kv_heads, spec.groups, kv_padded,
                                                   head_dim)
        return grouped.sum(axis=2).astype(key.dtype)

    if spec.learned and bool(param_leaves):
        grads = [grad.sum(axis=(0, 2)).astype(leaf.dtype)
                 for grad, leaf in zip(param_grads, param_leaves, strict=True)]
        params_grad = jax.tree.unflatten(spec.params_tree, grads)
    else:
        params_grad = jax.tree.map(jnp.zeros_like, params)
    return query_grad, per_kv_head(key_grad), per_kv_head(value_grad), params_grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flex(spec: _Spec, query, key, value, rows, params):  # no gradient: narrow heads are
    # read sequence-minor as in training, the order TPU's cache stores a prefill's keys and
    # values in (tfm/kernels/tpu_cache.py), so the prefill writes the arrays the kernel reads
    return _forward(spec, query, key, value, rows, params)[0]


def _flex_forward(spec: _Spec, query, key, value, rows, params):
    out, lse = _forward(spec, query, key, value, rows, params)
    return out, (query, key, value, rows, params, out, lse)


def _flex_backward(spec: _Spec, residuals, out_grad):
    query, key, value, rows, params, out, lse = residuals
    query_grad, key_grad, value_grad, params_grad = _backward(
        spec, query, key, value, rows, params, out, lse, out_grad)
    rows_grad = jax.tree.map(lambda ids: None, rows)
    return query_grad, key_grad, value_grad, rows_grad, params_grad


_flex.defvjp(_flex_forward, _flex_backward)


def attend_local(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim], this device's rows and heads
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    rows: tuple[jax.Array, ...],  # query positions [batch, q_len], key positions [batch,
    # kv_len], query segments [batch, q_len], key segments [batch, kv_len]; int32 (a 5th:
    # the query offset [batch], as query_offset)
    params: Any,  # pytree of [num_heads, P]
    *, causal: bool, window: int | None, scale: float,
    function: Callable[..., jax.Array] | None, learned: bool, compiler: str | None,
    query_offset: jax.Array | None = None,  # [batch] int32
    cost_offset: int = 0,
    vmem_budget: int | None = None,
) -> jax.Array:  # [batch, q_len, num_heads, head_dim]
    """The kernel over local arrays (one device's; call it inside shard_map with the mesh's
    compiler, or without a mesh with None): lengths padded to whole blocks, heads-major
    layout. query_offset: query i's index among the keys is i + query_offset[b] (None: i), for
    the causal mask and the window, as AttentionStructure.query_offset says; context
    parallelism runs a device's contiguous queries against the whole row's keys with it.
    cost_offset: the offset the kernel's cost estimate (XLA's FLOP count) assumes, a static
    int: context parallelism passes the mean of its devices' offsets. vmem_budget: the on-chip
    bytes a call may use (None: the compiled-for chip's, flex_vmem.budget); past it, keys and
    values stream from HBM block by block (tests pass a small one to run that in interpret
    mode)."""
    if len(rows) > 4:  # the query offset travelling with the rows (a prefill chunk's)
        rows, query_offset = rows[:4], rows[4]
    spec_of = _spec_of(query, key, params, causal=causal, window=window, scale=scale,
                       function=function, learned=learned, offset=query_offset is not None,
                       cost_offset=cost_offset, vmem_budget=vmem_budget)
    inputs = flex_operands.local_inputs(query, key, value, rows, params, query_offset)
    out = per_device.by_platform(lambda *arrays, compiler: _flex(spec_of(compiler), *arrays),
                                 compiler, *inputs)
    return flex_operands.from_heads_major(out, query.shape[1])


def block_forward(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    rows: tuple[jax.Array, ...],  # as attend_local's
    params: Any,  # pytree of [num_heads, P]
    **options: Any,  # attend_local's keyword arguments
) -> tuple[jax.Array, jax.Array]:  # out [batch, q_len, num_heads, head_dim], lse [batch,
    # num_heads, q_len] float32
    """attend_local's forward pass with the log-sum-exp of each query's weights (NO_KEY_LSE
    for a query that sees no key, whose output is zero), no gradient: for callers that combine
    blocks of keys themselves (the fused ring, tfm.kernels.ring_flex)."""
    compiler, spec_of, inputs = _block_call(query, key, value, rows, params, options)
    out, lse = per_device.by_platform(
        lambda *arrays, compiler: _forward(spec_of(compiler), *arrays), compiler, *inputs)
    q_len = query.shape[1]
    return flex_operands.from_heads_major(out, q_len), lse[:, :, 0, :q_len]


def block_backward(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    rows: tuple[jax.Array, ...],  # as attend_local's
    params: Any,  # pytree of [num_heads, P]
    out: jax.Array,  # [batch, q_len, num_heads, head_dim], the final output of these queries
    lse: jax.Array,  # [batch, num_heads, q_len] float32, their final log-sum-exp (NO_KEY_LSE:
    # no key seen)
    out_grad: jax.Array,  # like out
    **options: Any,  # attend_local's keyword arguments
) -> tuple:  # dquery, dkey, dvalue (like their inputs), dparams (like params, float32)
    """The gradients of this block of keys' share of the loss, from the final output and
    log-sum-exp of queries that may have attended other blocks too (FlashAttention-2's
    backward: each block's weights are exp(score - lse)): the fused ring's backward pass."""
    compiler, spec_of, inputs = _block_call(query, key, value, rows, params, options)
    q_len, kv_len = query.shape[1], key.shape[1]
    q_padded = per_device.round_up(q_len)
    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, q_padded - q_len)), constant_values=NO_KEY_LSE)
    inputs = (*inputs, flex_operands.heads_major(out, q_padded), lse[:, :, None, :],
              flex_operands.heads_major(out_grad, q_padded))
    query_grad, key_grad, value_grad, params_grad = per_device.by_platform(
        lambda *arrays, compiler: _backward(spec_of(compiler), *arrays), compiler, *inputs)
    params_grad = None if params is None else jax.tree.map(lambda grad: grad[:, 0], params_grad)
    back = flex_operands.from_heads_major
    return (back(query_grad, q_len), back(key_grad, kv_len), back(value_grad, kv_len),
            params_grad)


def _block_call(query, key, value, rows, params, options: dict) -> tuple:
    """(compiler, spec_of(compiler) -> KernelSpec, the kernel's operands) of a block call
    given attend_local's keyword arguments (compiler and query_offset among them)."""
    options = dict(options)
    compiler, query_offset = options.pop("compiler"), options.pop("query_offset", None)
    spec_of = _spec_of(query, key, params, offset=query_offset is not None, **options)
    inputs = flex_operands.local_inputs(query, key, value, rows, params, query_offset)
    return compiler, spec_of, inputs


def _spec_of(query, key, params, *, causal: bool, window: int | None, scale: float,
             function: Callable[..., jax.Array] | None, learned: bool, offset: bool,
             cost_offset: int = 0, vmem_budget: int | None = None,
             ) -> Callable[[str], KernelSpec]:
    """compiler -> the KernelSpec of a call on local query [b, q_len, heads, hd], key
    [b, kv_len, kv_heads, hd] and bias parameters (the compiler may be known only at
    lowering)."""
    q_len, num_heads = query.shape[1:3]
    kv_len, kv_heads = key.shape[1], key.shape[2]
    q_padded, kv_padded = per_device.round_up(q_len), per_device.round_up(kv_len)
    precision = (jax.lax.Precision.HIGHEST if jnp.dtype(query.dtype) == jnp.float32
                 else jax.lax.Precision.DEFAULT)
    # A block function whose gradient keeps many tiles live (FIRE's MLP: one per hidden unit)
    # names the largest tile side that fits on chip (`largest_block`); Mosaic refuses 512 there.
    largest = getattr(function, "largest_block", None)
    params_tree = jax.tree.structure(params)

    def spec(compiler: str) -> KernelSpec:
        triton = compiler == "triton"  # a GPU block's tiles live in 228 kB of shared memory
        return KernelSpec(
            block_q=TRITON_BLOCK if triton else per_device.block_size(q_padded, largest),
            block_k=TRITON_BLOCK if triton else per_device.block_size(kv_padded, largest),
            q_len=q_len, kv_len=kv_len,
            causal=causal, window=window, scale=scale, groups=num_heads // kv_heads,
            function=function, learned=learned, params_tree=params_tree,
            precision=precision, compiler=compiler, offset=offset, cost_offset=cost_offset,
            vmem_budget=flex_vmem.budget(compiler) if vmem_budget is None else vmem_budget,
            seq_minor=flex_operands.sequence_minor(compiler, query.shape[-1]),
        )

    return spec
