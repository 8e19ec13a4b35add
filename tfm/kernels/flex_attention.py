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

Layout inside: heads-major [batch, heads, length, head_dim], lengths padded to 128-lane
blocks (padded keys get a segment no query has). Grid (batch, head, query block) with a loop
over the key blocks the mask can reach (causal and window ranges are skipped, as are padded
blocks); on TPU the head's keys and values stay in on-chip memory (VMEM: up to VMEM_LIMIT,
single-buffered where two copies would not fit, so the longest contexts need a chip with
that much), on GPU 64-row tiles are read from HBM. The
dk/dv pass works on transposed [block_k, block_q] tiles, so that its per-query rows (positions,
segments, log-sum-exp) are lane-dense [1, q_len] arrays. GQA: query head h reads kv
head h // (heads / kv_heads). Same values as the reference (tfm.nn.attention) at every real
query, including zero output for a query that sees no key. A prefill chunk that reads a KV
cache runs here with its rows' query offset; decoding steps (a query or a few) the reference.
"""

from __future__ import annotations

import dataclasses
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
from tfm.kernels import masks, per_device, reference
from tfm.kernels.call import AttentionCall

TRITON_BLOCK = 64  # query and key blocks on GPU
MASKED = reference.MASKED_LOGIT
NO_KEY_LSE = 1e30  # log-sum-exp of a query that sees no key: every weight exp(s - it) is 0
VMEM_LIMIT = 96 * 2**20  # the most on-chip memory a call asks for (v5e/v6e have 128 MiB)


def serves(call: AttentionCall, q_len: int, kv_len: int) -> bool:
    """Whether this kernel computes the call (else the reference does): calls that describe
    their mask, and their bias if any, by parts (a KV cache read: prefill chunks only)."""
    if not per_device.blocked(call, q_len, kv_len):
        return False
    return call.bias is None or call.structure.bias is not None


def attention(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    call: AttentionCall,
) -> jax.Array:  # [batch, q_len, num_heads, head_dim]
    """softmax(Q K^T * scale + bias) V with the bias and mask made per block; under
    shard_map on a multi-device mesh (tfm.kernels.per_device)."""
    if call.dropout_rate > 0 or call.return_weights:
        raise ConfigError("attention_backend='flex' has no attention dropout and returns no "
                          "weights; use 'reference'")
    if not serves(call, query.shape[1], key.shape[1]):
        return masks.reference_attention(query, key, value, call)
    query, key, value, _, _ = reference.check_inputs(query, key, value, None, None, 0.0, None)
    structure = call.structure
    batch, q_len = query.shape[:2]
    kv_len = key.shape[1]
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


def _maximum(a: Any, b: int) -> Any:  # on Python ints (cost estimates) or traced block ids
    return max(a, b) if isinstance(a, int) else jnp.maximum(a, b)


def _minimum(a: Any, b: int) -> Any:
    return min(a, b) if isinstance(a, int) else jnp.minimum(a, b)


def _divide(a: Any, b: int) -> Any:  # a >= 0: truncating division is floor division (and
    return a // b if isinstance(a, int) else jax.lax.div(a, jnp.int32(b))  # lowers on any TPU)


@dataclasses.dataclass(frozen=True)
class _Spec:
    """The static description of one kernel call."""

    block_q: int
    block_k: int
    q_len: int  # real lengths; the arrays are padded to whole blocks
    kv_len: int
    causal: bool
    window: int | None
    scale: float
    groups: int  # query heads per kv head
    function: Callable[..., jax.Array] | None  # the block bias, None: no bias
    learned: bool  # whether the bias parameters take a gradient
    params_tree: Any  # treedef of the bias parameters
    precision: jax.lax.Precision
    compiler: str  # one of per_device.COMPILERS
    offset: bool = False  # whether a per-row query offset ([batch] int32) is passed
    cost_offset: int = 0  # the query offset the cost estimate assumes (the real one is traced)

    def first_query(self, offset_refs: list, q_block: Any) -> Any:
        """The index, among the keys, of query block `q_block`'s first query: its place in
        the queries, shifted by the row's query offset when there is one."""
        first = q_block * self.block_q
        return first + offset_refs[0][pl.program_id(0)] if offset_refs else first

    @property
    def reach(self) -> tuple[int | None, int | None]:
        """How far back and ahead of its own index a query may see (None: unbounded)."""
        ahead = 0 if self.causal else self.window
        return self.window, ahead

    def key_blocks(self, first_row: Any) -> tuple[Any, Any]:
        """[first, end) key blocks a query block whose first query has index `first_row`
        among the keys (`first_query`) can see."""
        back, ahead = self.reach
        real_blocks = -(-self.kv_len // self.block_k)
        first = 0 if back is None else _divide(_maximum(first_row - back, 0), self.block_k)
        if ahead is None:
            return first, real_blocks
        last_key = first_row + self.block_q - 1 + ahead
        return first, _minimum(_divide(last_key, self.block_k) + 1, real_blocks)

    def query_blocks(self, k_block: Any, offset: Any = 0) -> tuple[Any, Any]:
        """[first, end) query blocks that can see key block `k_block`, the queries' indices
        among the keys shifted by `offset`."""
        back, ahead = self.reach
        real_blocks = -(-self.q_len // self.block_q)
        first_key = k_block * self.block_k - offset
        first = 0 if ahead is None else _divide(_maximum(first_key - ahead, 0), self.block_q)
        if back is None:
            return first, real_blocks
        last_query = first_key + self.block_k - 1 + back
        return first, _minimum(_divide(last_query, self.block_q) + 1, real_blocks)

    def visible_pairs(self) -> int:
        """Query-key pairs the kernel computes (whole blocks): for its cost estimate."""
        pairs = 0
        for q_block in range(-(-self.q_len // self.block_q)):
            first, end = self.key_blocks(q_block * self.block_q + self.cost_offset)
            pairs += max(end - first, 0) * self.block_q * self.block_k
        return pairs


def _scores(spec: _Spec, query: jax.Array, key: jax.Array, rows: tuple, params: Any,
            first_query: Any, first_key: Any, transposed: bool = False,
            ) -> tuple[jax.Array, jax.Array]:
    """Scaled scores plus bias [block_q, block_k] float32 and which pairs may attend.
    query: [block_q, head_dim]; key: [block_k, head_dim]; rows: (query positions [block_q, 1],
    key positions [1, block_k], query segments [block_q, 1], key segments [1, block_k]).
    transposed: [block_k, block_q] instead, from query rows [1, block_q] and key columns
    [block_k, 1] (the block function is elementwise in the positions, so broadcasting the
    other way round gives its transpose)."""
    query_positions, key_positions, query_segments, key_segments = rows
    first, second = (key, query) if transposed else (query, key)
    scores = jax.lax.dot_general(first, second, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32, precision=spec.precision)
    scores = scores * jnp.float32(spec.scale)
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


def _dot(spec: _Spec, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=jnp.float32, precision=spec.precision)


def _forward_kernel(spec: _Spec, *refs: Any) -> None:
    (query_ref, key_ref, value_ref, query_pos_ref, key_pos_ref, query_seg_ref, key_seg_ref,
     *param_refs, out_ref, lse_ref) = refs
    offset_refs, param_refs = param_refs[:spec.offset], param_refs[spec.offset:]
    first_query = spec.first_query(offset_refs, pl.program_id(2))
    block_k = spec.block_k
    query = query_ref[...]
    query_rows = (query_pos_ref[...], query_seg_ref[...])
    params = jax.tree.unflatten(spec.params_tree, [ref[...] for ref in param_refs])

    def visit(k_block, carry):
        running_max, total, acc = carry
        start = pl.multiple_of(k_block * block_k, block_k)
        keys = pl.ds(start, block_k)
        rows = (query_rows[0], key_pos_ref[:, keys], query_rows[1], key_seg_ref[:, keys])
        scores, mask = _scores(spec, query, key_ref[keys, :], rows, params, first_query,
                               start)
        scores = jnp.where(mask, scores, MASKED)
        new_max = jnp.maximum(running_max, jnp.max(scores, axis=1, keepdims=True))
        weights = jnp.where(mask, jnp.exp(scores - new_max), 0.0)
        rescale = jnp.exp(running_max - new_max)
        total = rescale * total + jnp.sum(weights, axis=1, keepdims=True)
        value = value_ref[keys, :]
        acc = rescale * acc + _dot(spec, weights.astype(value.dtype), value)
        return new_max, total, acc

    first, end = spec.key_blocks(first_query)
    rows_shape = (spec.block_q, 1)
    init = (jnp.full(rows_shape, MASKED, jnp.float32), jnp.zeros(rows_shape, jnp.float32),
            jnp.zeros(query.shape, jnp.float32))
    running_max, total, acc = jax.lax.fori_loop(first, end, visit, init)
    seen = total > 0
    total = jnp.where(seen, total, 1.0)
    out_ref[...] = jnp.where(seen, acc / total, 0.0).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen, running_max + jnp.log(total), NO_KEY_LSE)


def _weights_and_score_grads(spec: _Spec, query, key, value, out_grad, lse, delta, rows, params,
                             first_query, first_key, transposed: bool = False,
                             ) -> tuple[jax.Array, jax.Array]:
    """The block's softmax weights and d loss / d scores (= d loss / d bias), both
    [block_q, block_k] float32 ([block_k, block_q] when transposed), from the saved
    log-sum-exp and delta = rowsum(dO * O), [block_q, 1] (rows [1, block_q] when transposed)."""
    scores, mask = _scores(spec, query, key, rows, params, first_query, first_key, transposed)
    weights = jnp.where(mask, jnp.exp(scores - lse), 0.0)
    first, second = (value, out_grad) if transposed else (out_grad, value)
    weight_grads = jax.lax.dot_general(first, second, (((1,), (1,)), ((), ())),
                                       preferred_element_type=jnp.float32,
                                       precision=spec.precision)
    return weights, weights * (weight_grads - delta)


def _query_grad_kernel(spec: _Spec, num_params: int, *refs: Any) -> None:
    (query_ref, key_ref, value_ref, out_grad_ref, lse_ref, delta_ref, query_pos_ref,
     key_pos_ref, query_seg_ref, key_seg_ref, *rest) = refs
    offset_refs, rest = rest[:spec.offset], rest[spec.offset:]
    param_refs, query_grad_ref, param_grad_refs = (
        rest[:num_params], rest[num_params], rest[num_params + 1:])
    first_query = spec.first_query(offset_refs, pl.program_id(2))
    block_k = spec.block_k
    query, out_grad = query_ref[...], out_grad_ref[...]
    lse, delta = lse_ref[...], delta_ref[...]
    params = jax.tree.unflatten(spec.params_tree, [ref[...] for ref in param_refs])

    def visit(k_block, carry):
        query_grad, param_grads = carry
        start = pl.multiple_of(k_block * block_k, block_k)
        keys = pl.ds(start, block_k)
        key = key_ref[keys, :]
        rows = (query_pos_ref[...], key_pos_ref[:, keys], query_seg_ref[...],
                key_seg_ref[:, keys])
        _, score_grads = _weights_and_score_grads(
            spec, query, key, value_ref[keys, :], out_grad, lse, delta, rows, params,
            first_query, start)
        query_grad = query_grad + _dot(spec, score_grads.astype(key.dtype), key)
        if param_grads:
            _, pull = jax.vjp(lambda p: spec.function(p, rows[0], rows[1]), params)
            (grads,) = pull(score_grads)
            param_grads = tuple(total + grad for total, grad in
                                zip(param_grads, jax.tree.leaves(grads), strict=True))
        return query_grad, param_grads

    first, end = spec.key_blocks(first_query)
    init_params = tuple(jnp.zeros(ref.shape, jnp.float32) for ref in param_grad_refs)
    query_grad, param_grads = jax.lax.fori_loop(
        first, end, visit, (jnp.zeros(query.shape, jnp.float32), init_params))
    query_grad_ref[...] = (query_grad * jnp.float32(spec.scale)).astype(query_grad_ref.dtype)
    for ref, grad in zip(param_grad_refs, param_grads, strict=True):
        ref[...] = grad


def _key_value_grad_kernel(spec: _Spec, *refs: Any) -> None:
    """dk, dv of one key block of one query head, over the query blocks that can see it,
    in the transposed orientation ([block_k, block_q] tiles): the per-query figures (positions,
    segments, log-sum-exp, delta) are then lane-dense rows [1, q_len] held whole on chip."""
    (query_ref, key_ref, value_ref, out_grad_ref, lse_ref, delta_ref, query_pos_ref,
     key_pos_ref, query_seg_ref, key_seg_ref, *rest) = refs
    offset_refs, param_refs = rest[:spec.offset], rest[spec.offset:-2]
    key_grad_ref, value_grad_ref = rest[-2:]
    offset = spec.first_query(offset_refs, 0)  # the row's query offset (0 without one)
    k_block = pl.program_id(2)
    block_q = spec.block_q
    key, value = key_ref[...], value_ref[...]
    key_columns = (key_pos_ref[...], key_seg_ref[...])  # [block_k, 1]
    params = jax.tree.unflatten(spec.params_tree, [ref[...] for ref in param_refs])

    def visit(q_block, carry):
        key_grad, value_grad = carry
        start = pl.multiple_of(q_block * block_q, block_q)
        queries = pl.ds(start, block_q)
        query, out_grad = query_ref[queries, :], out_grad_ref[queries, :]
        rows = (query_pos_ref[:, queries], key_columns[0], query_seg_ref[:, queries],
                key_columns[1])
        weights, score_grads = _weights_and_score_grads(
            spec, query, key, value, out_grad, lse_ref[:, queries], delta_ref[:, queries],
            rows, params, start + offset, k_block * spec.block_k, transposed=True)
        value_grad = value_grad + _dot(spec, weights.astype(out_grad.dtype), out_grad)
        key_grad = key_grad + _dot(spec, score_grads.astype(query.dtype), query)
        return key_grad, value_grad

    first, end = spec.query_blocks(k_block, offset)
    zeros = jnp.zeros(key.shape, jnp.float32)
    key_grad, value_grad = jax.lax.fori_loop(first, end, visit, (zeros, zeros))
    key_grad_ref[...] = (key_grad * jnp.float32(spec.scale)).astype(key_grad_ref.dtype)
    value_grad_ref[...] = value_grad.astype(value_grad_ref.dtype)


# Block specs over grid (batch, head, block): a query block of a head, a kv head's whole keys,
# rows of positions/segments (queries as [len, 1] columns, keys as [1, len] rows), a head's
# parameter rows.
def _query_block(spec: _Spec, head_dim: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, None, spec.block_q, head_dim), lambda b, h, i: (b, h, i, 0))


def _whole_head(length: int, head_dim: int, groups: int = 1,
                mode: pl.Buffered | None = None) -> pl.BlockSpec:
    return pl.BlockSpec((None, None, length, head_dim),
                        lambda b, h, i: (b, jax.lax.div(h, groups), 0, 0), pipeline_mode=mode)


def _key_block(spec: _Spec, head_dim: int, groups: int = 1) -> pl.BlockSpec:
    return pl.BlockSpec((None, None, spec.block_k, head_dim),
                        lambda b, h, j: (b, jax.lax.div(h, groups), j, 0))


def _column(length: int, blocked: bool) -> pl.BlockSpec:  # [batch, len, 1] arrays
    return pl.BlockSpec((None, length, 1), (lambda b, h, i: (b, i, 0)) if blocked
                        else (lambda b, h, i: (b, 0, 0)))


def _row(length: int, blocked: bool,
         mode: pl.Buffered | None = None) -> pl.BlockSpec:  # [batch, 1, len] arrays
    return pl.BlockSpec((None, 1, length), (lambda b, h, j: (b, 0, j)) if blocked
                        else (lambda b, h, j: (b, 0, 0)), pipeline_mode=mode)


def _per_head_row(leaf: jax.Array) -> pl.BlockSpec:  # [heads, 1, P] arrays
    return pl.BlockSpec((None, 1, leaf.shape[-1]), lambda b, h, i: (h, 0, 0))


def _offsets(spec: _Spec, rows: tuple) -> list[pl.BlockSpec]:
    """The per-row query offset ([batch] int32, whole), if the call has one: scalars read
    from scalar memory on TPU."""
    if not spec.offset:
        return []
    batch = rows[-1].shape[0]
    if spec.compiler == "triton":
        return [pl.BlockSpec((batch,), lambda b, h, i: (0,))]
    return [pl.BlockSpec(memory_space=pltpu.SMEM)]


def _row_stats(spec: _Spec, length: int, blocked: bool) -> pl.BlockSpec:  # [b, heads, len, 1]
    block = spec.block_q if blocked else length
    return pl.BlockSpec((None, None, block, 1), (lambda b, h, i: (b, h, i, 0)) if blocked
                        else (lambda b, h, i: (b, h, 0, 0)))


def _pallas(spec: _Spec, kernel: Callable[..., None], grid: tuple[int, ...],
            in_specs: list, out_specs: Any, out_shape: Any, cost: pl.CostEstimate,
            vmem_bytes: int, *args: Any) -> Any:
    limit = int(min(max(2 * vmem_bytes + 8 * 2**20, 32 * 2**20), VMEM_LIMIT))

    def call(*args: Any, compiler: str) -> Any:
        if compiler == "triton":
            params = plgpu.CompilerParams(num_warps=4, num_stages=2)
        else:
            params = pltpu.CompilerParams(dimension_semantics=("parallel",) * len(grid),
                                          vmem_limit_bytes=limit)
        return pl.pallas_call(
            kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
            interpret=compiler == "interpret", cost_estimate=cost, name="tfm_flex_attention",
            compiler_params=params,
        )(*args)

    return call(*args, compiler=spec.compiler)


def _nbytes(*arrays: Any) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(arrays))


def _residency(spec: _Spec, length: int, head_dim: int, dtype: Any) -> pl.Buffered | None:
    """How the arrays a grid step keeps for a whole head (keys and values and their rows) are
    buffered: double (None: the next head's copy loads while this one is used) unless two
    copies would pass VMEM_LIMIT on TPU, then single (Buffered(1): each head waits for its
    load). At 131,072 keys of 64 lanes in bf16 two copies need 168 MB, over the v5e's 128 MiB."""
    two_copies = per_device.resident_bytes(length, head_dim, dtype, 2)
    if spec.compiler != "mosaic" or two_copies <= VMEM_LIMIT:
        return None
    return pl.Buffered(1)


def _forward(spec: _Spec, query, key, value, rows, params):
    batch, heads, q_padded, head_dim = query.shape
    kv_padded = key.shape[2]
    query_pos, key_pos, query_seg, key_seg, *offsets = rows
    param_leaves = jax.tree.leaves(params)
    pairs = batch * heads * spec.visible_pairs()
    cost = pl.CostEstimate(flops=4 * pairs * head_dim, transcendentals=pairs,
                           bytes_accessed=_nbytes(query, key, value, rows, query))
    grid = (batch, heads, q_padded // spec.block_q)
    mode = _residency(spec, kv_padded, head_dim, key.dtype)
    out, lse = _pallas(
        spec, functools.partial(_forward_kernel, spec), grid,
        [_query_block(spec, head_dim), _whole_head(kv_padded, head_dim, spec.groups, mode),
         _whole_head(kv_padded, head_dim, spec.groups, mode), _column(spec.block_q, True),
         _row(kv_padded, False, mode), _column(spec.block_q, True), _row(kv_padded, False, mode),
         *_offsets(spec, rows), *(_per_head_row(leaf) for leaf in param_leaves)],
        [_query_block(spec, head_dim), _row_stats(spec, q_padded, True)],
        [jax.ShapeDtypeStruct(query.shape, query.dtype),
         jax.ShapeDtypeStruct((batch, heads, q_padded, 1), jnp.float32)],
        cost, per_device.resident_bytes(kv_padded, head_dim, key.dtype, 2, 1 if mode else 2),
        query, key, value, query_pos, key_pos, query_seg, key_seg, *offsets, *param_leaves,
    )
    return out, lse


def _backward(spec: _Spec, query, key, value, rows, params, out, lse, out_grad):
    batch, heads, q_padded, head_dim = query.shape
    kv_heads, kv_padded = key.shape[1], key.shape[2]
    query_pos, key_pos, query_seg, key_seg, *offsets = rows
    param_leaves = jax.tree.leaves(params)
    delta = jnp.sum(out_grad.astype(jnp.float32) * out.astype(jnp.float32), axis=-1,
                    keepdims=True)  # [batch, heads, q_padded, 1]
    pairs = batch * heads * spec.visible_pairs()
    inputs = (query, key, value, out_grad, lse, delta, query_pos, key_pos, query_seg, key_seg,
              *offsets, *param_leaves)
    learned = spec.learned and bool(param_leaves)
    q_blocks = q_padded // spec.block_q
    param_grad_shapes = [jax.ShapeDtypeStruct((batch, heads, q_blocks, 1, leaf.shape[-1]),
                                              jnp.float32) for leaf in param_leaves] * learned
    param_grad_specs = [pl.BlockSpec((None, None, None, 1, leaf.shape[-1]),
                                     lambda b, h, i: (b, h, i, 0, 0))
                        for leaf in param_leaves] * learned
    mode = _residency(spec, kv_padded, head_dim, key.dtype)
    query_grad, *param_grads = _pallas(
        spec, functools.partial(_query_grad_kernel, spec, len(param_leaves)),
        (batch, heads, q_blocks),
        [_query_block(spec, head_dim), _whole_head(kv_padded, head_dim, spec.groups, mode),
         _whole_head(kv_padded, head_dim, spec.groups, mode), _query_block(spec, head_dim),
         _row_stats(spec, q_padded, True), _row_stats(spec, q_padded, True),
         _column(spec.block_q, True), _row(kv_padded, False, mode), _column(spec.block_q, True),
         _row(kv_padded, False, mode), *_offsets(spec, rows),
         *(_per_head_row(leaf) for leaf in param_leaves)],
        [_query_block(spec, head_dim), *param_grad_specs],
        [jax.ShapeDtypeStruct(query.shape, query.dtype), *param_grad_shapes],
        pl.CostEstimate(flops=6 * pairs * head_dim, transcendentals=pairs,
                        bytes_accessed=_nbytes(*inputs, query)),
        per_device.resident_bytes(kv_padded, head_dim, key.dtype, 2, 1 if mode else 2),
        *inputs,
    )
    per_query_head = jax.ShapeDtypeStruct((batch, heads, kv_padded, head_dim), key.dtype)
    as_row = lambda column: column.reshape(*column.shape[:-2], 1, column.shape[-2])
    as_column = lambda row: row.reshape(*row.shape[:-2], row.shape[-1], 1)
    whole_rows = pl.BlockSpec((None, None, 1, q_padded), lambda b, h, j: (b, h, 0, 0))
    transposed_inputs = (query, key, value, out_grad, as_row(lse), as_row(delta),
                         as_row(query_pos), as_column(key_pos), as_row(query_seg),
                         as_column(key_seg), *offsets, *param_leaves)
    key_grad, value_grad = _pallas(
        spec, functools.partial(_key_value_grad_kernel, spec),
        (batch, heads, kv_padded // spec.block_k),
        [_whole_head(q_padded, head_dim), _key_block(spec, head_dim, spec.groups),
         _key_block(spec, head_dim, spec.groups), _whole_head(q_padded, head_dim),
         whole_rows, whole_rows, _row(q_padded, False), _column(spec.block_k, True),
         _row(q_padded, False), _column(spec.block_k, True), *_offsets(spec, rows),
         *(_per_head_row(leaf) for leaf in param_leaves)],
        [_key_block(spec, head_dim), _key_block(spec, head_dim)],
        [per_query_head, per_query_head],
        pl.CostEstimate(flops=8 * pairs * head_dim, transcendentals=pairs,
                        bytes_accessed=_nbytes(*inputs, key, value)),
        per_device.resident_bytes(q_padded, head_dim, query.dtype, 2),
        *transposed_inputs,
    )

    def per_kv_head(grad: jax.Array) -> jax.Array:  # sum the query heads of each kv head
        grouped = grad.astype(jnp.float32).reshape(batch, kv_heads, spec.groups, kv_padded,
                                                   head_dim)
        return grouped.sum(axis=2).astype(key.dtype)

    if learned:
        grads = [grad.sum(axis=(0, 2)).astype(leaf.dtype)
                 for grad, leaf in zip(param_grads, param_leaves, strict=True)]
        params_grad = jax.tree.unflatten(spec.params_tree, grads)
    else:
        params_grad = jax.tree.map(jnp.zeros_like, params)
    return query_grad, per_kv_head(key_grad), per_kv_head(value_grad), params_grad


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _flex(spec: _Spec, query, key, value, rows, params):
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
) -> jax.Array:  # [batch, q_len, num_heads, head_dim]
    """The kernel over local arrays (one device's; call it inside shard_map with the mesh's
    compiler, or without a mesh with None): lengths padded to whole blocks, heads-major
    layout. query_offset: query i's index among the keys is i + query_offset[b] (None: i), for
    the causal mask and the window, as AttentionStructure.query_offset says; context
    parallelism runs a device's contiguous queries against the whole row's keys with it.
    cost_offset: the offset the kernel's cost estimate (XLA's FLOP count) assumes, a static
    int: context parallelism passes the mean of its devices' offsets."""
    batch, q_len, num_heads, head_dim = query.shape
    kv_len, kv_heads = key.shape[1], key.shape[2]
    q_padded, kv_padded = per_device.round_up(q_len), per_device.round_up(kv_len)
    query_pos, key_pos, query_seg, key_seg, *offset = rows
    query_offset = offset[0] if offset else query_offset

    def pad(ids: jax.Array, padded: int, fill: int = 0) -> jax.Array:
        return jnp.pad(ids, ((0, 0), (0, padded - ids.shape[1])), constant_values=fill)

    padded_rows = (pad(query_pos, q_padded)[:, :, None], pad(key_pos, kv_padded)[:, None, :],
                   pad(query_seg, q_padded)[:, :, None],
                   pad(key_seg, kv_padded, per_device.PADDING_KEY_SEGMENT)[:, None, :])
    if query_offset is not None:
        padded_rows = (*padded_rows, query_offset.astype(jnp.int32))

    def heads_major(x: jax.Array, padded: int) -> jax.Array:  # -> [batch, heads, padded, hd]
        x = jnp.pad(x, ((0, 0), (0, padded - x.shape[1]), (0, 0), (0, 0)))
        return x.transpose(0, 2, 1, 3)

    params = None if params is None else jax.tree.map(
        lambda leaf: leaf.astype(jnp.float32)[:, None, :], params)  # [heads, 1, P]
    precision = (jax.lax.Precision.HIGHEST if jnp.dtype(query.dtype) == jnp.float32
                 else jax.lax.Precision.DEFAULT)

    # A block function whose gradient keeps many tiles live (FIRE's MLP: one per hidden unit)
    # names the largest tile side that fits on chip (`largest_block`); Mosaic refuses 512 there.
    largest = getattr(function, "largest_block", None)

    def run(*arrays: Any, compiler: str) -> jax.Array:
        triton = compiler == "triton"  # a GPU block's tiles live in 228 kB of shared memory
        spec = _Spec(
            block_q=TRITON_BLOCK if triton else per_device.block_size(q_padded, largest),
            block_k=TRITON_BLOCK if triton else per_device.block_size(kv_padded, largest),
            q_len=q_len, kv_len=kv_len,
            causal=causal, window=window, scale=scale, groups=num_heads // kv_heads,
            function=function, learned=learned, params_tree=jax.tree.structure(params),
            precision=precision, compiler=compiler, offset=query_offset is not None,
            cost_offset=cost_offset,
        )
        return _flex(spec, *arrays)

    out = per_device.by_platform(
        run, compiler, heads_major(query, q_padded), heads_major(key, kv_padded),
        heads_major(value, kv_padded), padded_rows, params)
    return out.transpose(0, 2, 1, 3)[:, :q_len]

