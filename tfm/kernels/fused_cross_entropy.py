"""The output projection and the softmax statistics of cross-entropy in one Pallas kernel:
no [tokens, vocab] logits array reaches memory, in the forward or the backward pass.

For each token n (hidden h_n [d_model]) and the output table W [vocab, d_model] (bias b):
logits z_n = W h_n + b, and the kernel returns, per token,

    lse_n = log sum_v exp(z_nv)            target_logit_n = z_n[target_n]
    logit_sum_n = sum_v z_nv               argmax_n = the first v of the largest z_nv

from which every figure of tfm.training.losses.cross_entropy follows (nll = lse - target
logit; label smoothing's mean log-probability = logit_sum / vocab - lse). The first three are
differentiable: d/dz_nv = d_lse * softmax(z_n)_v + d_target * [v = target_n] + d_sum.

Online log-sum-exp over vocabulary blocks (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"). Under differentiation the same pass also sums, online as flash
attention sums its output (Dao et al. 2022), the softmax-weighted table rows of the words other
than the target, sum_{v != target} p_nv W_v, and their probability 1 - p_n[target]: d hidden
then needs no second pass over the table (d lse * that sum + (d lse p_target + d target)
W[target] + d sum * sum_v W_v), and leaving the target out keeps the nll's gradient, where
p_target is near 1, free of cancellation. d table (and d bias) recomputes each logits block from
the saved log-sum-exp, over (vocab block, token block) in the transposed orientation ([vocab
block, token block] tiles, per-token figures as lane-dense rows) so that every matmul is one the
MXU takes directly. About 8 N V d FLOPs instead of the unfused 6 N V d, for traffic that no
longer grows with N x V. On TPU (Mosaic); in interpret mode elsewhere (tests). Under a mesh each
device runs its own rows against the whole table (shard_map; the table's gradient is summed over
devices).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec

from tfm.kernels import per_device
from tfm.kernels.per_device import LANES


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes (multiples of 128): tokens and vocabulary rows per block of the statistics
    pass, which reads the whole table once per token block (tall blocks); the same for the d
    table pass, which reads all tokens once per vocabulary block (wide blocks); and the on-chip
    memory (VMEM) the calls may take (the statistics call: `statistics_vmem_limit`, when
    given)."""

    tokens: int
    vocab: int
    grad_tokens: int
    grad_vocab: int
    vmem_limit: int
    statistics_vmem_limit: int | None = None

    def limit(self, call: str) -> int:
        """The VMEM limit of `call`, "statistics" or "table_grad"."""
        if call == "statistics" and self.statistics_vmem_limit is not None:
            return self.statistics_vmem_limit
        return self.vmem_limit


# By chip (jax Device.device_kind), the largest tiles its VMEM takes (compiled for each): 128
# MiB on v5e and v6e (96 MiB for the differentiated statistics call, whose 4,096 tokens at
# d_model 768 asked 67.9 MiB in GPT-2 small's fsdp=8 step), 64 MiB usable on v5p (where 2,048
# of its tokens at d_model 1,280 took 66.5 MB: 1,024 there), 16 MiB per core on v2-v4.
BLOCKS = Blocks(1024, 512, 1024, 2048, 60 * 2**20)  # v5p, and chips not listed
BLOCKS_BY_CHIP = {
    "TPU v5 lite": Blocks(4096, 512, 1024, 4096, 64 * 2**20, 96 * 2**20),
    "TPU v6 lite": Blocks(4096, 512, 1024, 4096, 64 * 2**20, 96 * 2**20),
    **{f"TPU v{n}": Blocks(512, 512, 256, 512, 14 * 2**20) for n in (2, 3, 4)},
}


def blocks_for(device_kind: str) -> Blocks:
    """The tile sizes for a chip (jax Device.device_kind, e.g. "TPU v5 lite")."""
    return BLOCKS_BY_CHIP.get(device_kind, BLOCKS)


class SoftmaxStatistics(NamedTuple):
    """Per-token figures of softmax(W h + b), each [tokens]: `lse`, `target_logit` and
    `logit_sum` float32 (differentiable), `argmax` int32 (the first largest logit)."""

    lse: jax.Array
    target_logit: jax.Array
    logit_sum: jax.Array
    argmax: jax.Array


@dataclasses.dataclass(frozen=True)
class _Spec:
    vocab_size: int  # the table's rows; its last block may be partly past them
    blocks: Blocks  # fitted to the call's sizes
    precision: jax.lax.Precision
    compiler: str  # one of per_device.COMPILERS


def softmax_statistics(
    hidden: jax.Array,  # [..., d_model] in the compute dtype
    table: jax.Array,  # [vocab, d_model], the output projection (a tied embedding's table)
    bias: jax.Array | None,  # [vocab] or None
    targets: jax.Array,  # [...] int, same leading shape as hidden
    *,
    blocks: Blocks | None = None,  # None: blocks_for the chip compiled for
) -> SoftmaxStatistics:  # each [...]
    """The per-token softmax statistics of logits `hidden @ table.T + bias`, without writing
    the logits; under a mesh (jax.sharding.get_abstract_mesh) each device takes its own rows
    (the leading axes split as the "batch" and "length" logical rules say)."""
    if table.ndim != 2 or hidden.shape[-1] != table.shape[1]:
        raise ValueError(f"softmax_statistics needs hidden [..., d_model] and table [vocab, "
                         f"d_model]; got {hidden.shape} and {table.shape}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets {targets.shape} must have hidden's leading shape "
                         f"{hidden.shape[:-1]}")
    vocab_size = table.shape[0]
    bias = jnp.zeros((vocab_size,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    table = table.astype(hidden.dtype)
    mesh = per_device.context_mesh("loss_backend='fused'", hidden, table, targets)
    if blocks is None:
        blocks = blocks_for(per_device.device_kind())
    for name in ("tokens", "vocab", "grad_tokens", "grad_vocab"):
        size = getattr(blocks, name)
        if size <= 0 or size % LANES:
            raise ValueError(f"blocks.{name}={size} must be a positive multiple of "
                             f"{LANES}")
    local = functools.partial(_local, blocks=blocks)
    if mesh.empty:
        return local(hidden, table, bias, targets, compiler=None)
    compiler = per_device.COMPILER_OF_PLATFORM.get(mesh.abstract_device.platform, "interpret")
    if mesh.size == 1:
        return local(hidden, table, bias, targets, compiler=compiler)
    leading = ("batch", "length")[: targets.ndim] + (None,) * max(targets.ndim - 2, 0)
    rows_spec = per_device.divisible(nn.logical_to_mesh_axes(leading), targets.shape, mesh)
    hidden_spec = PartitionSpec(*rows_spec, None)
    return jax.shard_map(
        functools.partial(local, compiler=compiler), mesh=mesh, check_vma=False,
        in_specs=(hidden_spec, PartitionSpec(), PartitionSpec(), rows_spec),
        out_specs=SoftmaxStatistics(rows_spec, rows_spec, rows_spec, rows_spec),
    )(hidden, table, bias, targets)


def _local(hidden, table, bias, targets, *, blocks: Blocks,
           compiler: str | None) -> SoftmaxStatistics:
    """One device's rows: flattened to [tokens, d_model], padded to whole blocks."""
    leading = targets.shape
    tokens = math.prod(leading)
    vocab_size, d_model = table.shape
    blocks, padded_tokens = fit_blocks(blocks, tokens, vocab_size, d_model,
                                       jnp.dtype(hidden.dtype).itemsize)
    # Tokens are padded to whole blocks (a cheap [tokens, d_model] copy, usually none); the
    # table is not (that would copy it at every step): the last vocabulary block reads past its
    # end, and the kernels mask those rows.
    hidden = jnp.pad(hidden.reshape(tokens, d_model), ((0, padded_tokens - tokens), (0, 0)))
    targets = jnp.pad(targets.reshape(tokens).astype(jnp.int32), (0, padded_tokens - tokens))
    precision = (jax.lax.Precision.HIGHEST if jnp.dtype(hidden.dtype) == jnp.float32
                 else jax.lax.Precision.DEFAULT)

    def run(hidden, table, bias, targets, *, compiler: str) -> SoftmaxStatistics:
        spec = _Spec(vocab_size=vocab_size, blocks=blocks, precision=precision,
                     compiler=compiler)
        return _statistics(spec, hidden, table, bias, targets)

    stats = per_device.by_platform(run, compiler, hidden, table, bias, targets)
    return SoftmaxStatistics(*(value[:tokens].reshape(leading) for value in stats))


def fit_blocks(blocks: Blocks, tokens: int, vocab_size: int, d_model: int = 0,
               itemsize: int = 2) -> tuple[Blocks, int]:
    """`blocks` fitted to a call: (blocks, tokens padded to whole blocks). Blocks are evened out
    so that padding stays under 128 per block (5,000 tokens in blocks of at most 4,096: two of
    2,560; 50,304 words in blocks of at most 4,096: 13 of 3,968) and no block is larger than
    the input (rounded to 128 lanes); the d table pass's token block is the largest up to its
    size that divides the padded tokens. The token block of the statistics pass halves, and
    the vocabulary block of the d table pass shrinks by 128, until what those calls keep in VMEM
    (`_statistics_vmem_bytes` and `_vmem_bytes`, for d_model's `_vmem_width` and the hidden
    dtype's `itemsize`) fits its limit (`Blocks.limit`): on v5e, GPT-2 medium's d_model 1,024
    takes d table blocks of 3,200 words and statistics blocks of 2,048 tokens where 768 takes
    3,968 and 4,096."""
    d_model = _vmem_width(d_model)
    vocab_block = _even(blocks.vocab, vocab_size)
    block_tokens = _halved(blocks.tokens, tokens, lambda size: _statistics_vmem_bytes(
        size, vocab_block, d_model, itemsize) <= blocks.limit("statistics"))
    padded = -(-tokens // block_tokens) * block_tokens
    grad_tokens = next(size for size in range(min(blocks.grad_tokens, padded), 0, -LANES)
                       if padded % size == 0)
    grad_vocab = _shrunk(blocks.grad_vocab, vocab_size, lambda size: _vmem_bytes(
        size, grad_tokens, d_model, itemsize) <= blocks.vmem_limit)
    fitted = dataclasses.replace(blocks, tokens=block_tokens, grad_tokens=grad_tokens,
                                 vocab=vocab_block, grad_vocab=grad_vocab)
    return fitted, padded


def _vmem_width(d_model: int) -> int:
    """The width the VMEM estimates size blocks for: d_model in whole 128-lane tiles, twice
    that where the last tile is partial and d_model is over 1,280. There Mosaic took 1.5-1.8
    times the VMEM of the next whole width (v5e, 1,024 x 1,024 blocks, both calls: 54.6 /
    58.8 / 62.9 / 71.3 MB for the d table call at 1,472 / 1,600 / 1,728 / 1,984 against 35.8
    / 38.4 / 40.9 / 46.1 at 1,536 / 1,664 / 1,792 / 2,048; register spills, 16.3 MB in v5p's
    report at 1,600); at 1,088 and 1,216 it took what the next whole width takes."""
    width = per_device.round_up(d_model)
    return 2 * width if d_model % LANES and d_model > 1280 else width


def _vmem_bytes(rows: int, block: int, d_model: int, itemsize: int) -> int:
    """VMEM that the d table call (rows = its words, block = its tokens) keeps at once, as
    Mosaic allocates it: the [rows, d_model] input and output blocks double-buffered and their
    float32 accumulator, the other operand's [block, d_model] double-buffered, and the [rows,
    block] logits tile in float32 with its copy for the second matmul. (At d_model 1,024,
    3,968 x 1,024 d table blocks: 77.3e6 here, 76.9e6 in Mosaic's CompileTimeScopedVmemOom for
    v5e at a 64 MiB limit.)"""
    return (rows * d_model * (4 * itemsize + 4) + 2 * block * d_model * itemsize
            + rows * block * (4 + itemsize))


def _statistics_vmem_bytes(rows: int, block: int, d_model: int, itemsize: int) -> int:
    """An estimate of the VMEM the differentiated statistics call (rows = its tokens, block =
    its words) takes: the [rows, d_model] hidden block double-buffered and its float32 output
    (its own accumulator) double-buffered, the [block, d_model] table block double-buffered,
    and six float32 [rows, block] temporaries (logits, exponentials, their masked copy, the
    column indices, the comparisons, the bfloat16 copy for the MXU), set by what Mosaic asked
    on v5e (96 MiB allowed): 4,096 x 512 at d_model 768 compile in GPT-2 small's step (this:
    85.4 MiB); at 1,024 Mosaic asked 104.7 MiB for them in the loss alone under fsdp=8 (this:
    97.9 MiB, so they shrink)."""
    return (rows * d_model * (2 * itemsize + 8) + 2 * block * d_model * itemsize
            + 24 * rows * block)


def _halved(largest: int, length: int, fits) -> int:
    """The evened block (`_even`) of the largest size `largest` / 2**k (whole lanes) that
    `fits` (else 128): halving keeps a power-of-two token count in whole blocks (8,192 tokens:
    4,096 or 2,048, not 2,816 and 256 of padding)."""
    size = largest
    while size > LANES and not fits(_even(size, length)):
        size = per_device.round_up(size // 2)
    return _even(size, length)


def _shrunk(largest: int, length: int, fits) -> int:
    """The evened block (`_even`) of the largest size up to `largest`, by steps of 128, that
    `fits` (else 128)."""
    for size in range(largest, LANES, -LANES):
        if fits(_even(size, length)):
            return _even(size, length)
    return _even(LANES, length)


def _even(block: int, length: int) -> int:
    """The block (a multiple of LANES, at most `block`) that covers `length` in as many blocks
    as `block` would, with the least overhang."""
    count = -(-length // block)
    return per_device.round_up(-(-length // count))


# ---------------------------------------------------------------- the blocks' maths


def _real_rows(spec: _Spec, table, first_vocab):
    """The table block [block_v, d] with rows past the vocabulary (the last block's overhang,
    whose contents are unspecified) zeroed, so that no NaN they may hold reaches a product."""
    row = first_vocab + jax.lax.broadcasted_iota(jnp.int32, (table.shape[0], 1), 0)
    return jnp.where(row < spec.vocab_size, table, jnp.zeros((), table.dtype))


def _logits(spec: _Spec, hidden, table, bias, first_vocab, transposed: bool):
    """A logits block, float32, and which of its entries are real vocabulary: [block_t,
    block_v] from hidden [block_t, d] and table [block_v, d] (real rows) and bias [1, block_v];
    transposed: [block_v, block_t] (bias [block_v, 1])."""
    first, second = (table, hidden) if transposed else (hidden, table)
    logits = jax.lax.dot_general(first, second, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32, precision=spec.precision)
    vocab_axis = 0 if transposed else 1
    column = first_vocab + jax.lax.broadcasted_iota(jnp.int32, logits.shape, vocab_axis)
    real = column < spec.vocab_size
    return jnp.where(real, logits + bias, 0.0), column, real


def _logit_grads(spec: _Spec, hidden, table, bias, targets, lse, grads, first_vocab):
    """d loss / d logits of a block, [block_v, block_t] (the d table call's orientation):
    d_lse * softmax + d_target * onehot + d_sum (0 outside the vocabulary). targets, lse and
    the three cotangents: [1, block_t]."""
    lse_grad, target_grad, sum_grad = grads
    logits, column, real = _logits(spec, hidden, table, bias, first_vocab, transposed=True)
    probs = jnp.exp(logits - lse)  # finite: masked entries are 0 here
    grad = lse_grad * probs + jnp.where(column == targets, target_grad, 0.0) + sum_grad
    return jnp.where(real, grad, 0.0)


def _statistics_kernel(spec: _Spec, hidden_ref, table_ref, bias_ref, targets_ref,
                       max_ref, sumexp_ref, target_ref, sum_ref, argmax_ref,
                       *grad_refs) -> None:
    """The statistics, online over the vocabulary blocks; under differentiation (grad_refs:
    others_ref [block_t, d_model] and rest_ref [block_t, 1], float32) also sum_{v != target}
    p_v W_v and sum_{v != target} p_v, accumulated in their output blocks."""
    vocab_block = pl.program_id(1)

    @pl.when(vocab_block == 0)
    def _():
        max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
        for ref in (sumexp_ref, target_ref, sum_ref, argmax_ref, *grad_refs):
            ref[...] = jnp.zeros(ref.shape, ref.dtype)

    first_vocab = vocab_block * spec.blocks.vocab
    table = _real_rows(spec, table_ref[...], first_vocab)
    targets = targets_ref[...]
    logits, column, real = _logits(spec, hidden_ref[...], table, bias_ref[...], first_vocab,
                                   transposed=False)
    logits = jnp.where(real, logits, -jnp.inf)
    block_max = jnp.max(logits, axis=1, keepdims=True)
    old_max = max_ref[...]
    new_max = jnp.maximum(old_max, block_max)  # finite: every block holds a real column
    rescale = jnp.exp(old_max - new_max)  # 0 at the first block
    exps = jnp.exp(logits - new_max)  # 0 past the vocabulary
    sumexp_ref[...] = sumexp_ref[...] * rescale + jnp.sum(exps, axis=1, keepdims=True)
    max_ref[...] = new_max
    is_target = column == targets
    target_ref[...] += jnp.sum(jnp.where(is_target, logits, 0.0), axis=1, keepdims=True)
    sum_ref[...] += jnp.sum(jnp.where(real, logits, 0.0), axis=1, keepdims=True)
    # The first largest: the block's first maximum, taken only when it beats earlier blocks.
    # (Indices as float32, exact below 2**24, whose lane reduction every TPU has.)
    block_argmax = jnp.min(jnp.where(logits == block_max, column.astype(jnp.float32), jnp.inf),
                           axis=1, keepdims=True).astype(jnp.int32)
    argmax_ref[...] = jnp.where(block_max > old_max, block_argmax, argmax_ref[...])
    if not grad_refs:
        return
    others_ref, rest_ref = grad_refs
    others = jnp.where(is_target, 0.0, exps)
    others_ref[...] = others_ref[...] * rescale + jnp.dot(
        others.astype(table.dtype), table, preferred_element_type=jnp.float32,
        precision=spec.precision)
    rest_ref[...] = rest_ref[...] * rescale + jnp.sum(others, axis=1, keepdims=True)

    @pl.when(vocab_block == pl.num_programs(1) - 1)
    def _():
        others_ref[...] = others_ref[...] / sumexp_ref[...]
        rest_ref[...] = rest_ref[...] / sumexp_ref[...]


def _table_grad_kernel(spec: _Spec, hidden_ref, table_ref, bias_ref, targets_ref, lse_ref,
                       lse_grad_ref, target_grad_ref, sum_grad_ref, table_grad_ref,
                       bias_grad_ref, table_grad_sum) -> None:
    """d table in the table's dtype, summed over the token blocks in float32 (scratch)."""
    vocab_block, token_block = pl.program_id(0), pl.program_id(1)

    @pl.when(token_block == 0)
    def _():
        table_grad_sum[...] = jnp.zeros(table_grad_sum.shape, jnp.float32)
        bias_grad_ref[...] = jnp.zeros(bias_grad_ref.shape, jnp.float32)

    hidden = hidden_ref[...]
    first_vocab = vocab_block * spec.blocks.grad_vocab
    grads = (lse_grad_ref[...], target_grad_ref[...], sum_grad_ref[...])
    logit_grads = _logit_grads(spec, hidden, _real_rows(spec, table_ref[...], first_vocab),
                               bias_ref[...], targets_ref[...], lse_ref[...], grads,
                               first_vocab)  # [block_v, block_t]
    table_grad_sum[...] += jnp.dot(logit_grads.astype(hidden.dtype), hidden,
                                   preferred_element_type=jnp.float32,
                                   precision=spec.precision)
    bias_grad_ref[...] += jnp.sum(logit_grads, axis=1, keepdims=True)

    @pl.when(token_block == pl.num_programs(1) - 1)
    def _():
        table_grad_ref[...] = table_grad_sum[...].astype(table_grad_ref.dtype)


# ---------------------------------------------------------------- the calls


def _pallas(spec: _Spec, kernel, grid, in_specs, out_specs, out_shape, cost, name, *args,
            scratch_shapes=()):
    call = "statistics" if kernel is _statistics_kernel else "table_grad"
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                  vmem_limit_bytes=spec.blocks.limit(call))
    return pl.pallas_call(
        functools.partial(kernel, spec), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=spec.compiler == "interpret", cost_estimate=cost,
        name=name, compiler_params=params, scratch_shapes=scratch_shapes,
    )(*args)


def _nbytes(*arrays: Any) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)


def _column(block: int, axis: int) -> pl.BlockSpec:  # [tokens, 1] per-token figures
    return pl.BlockSpec((block, 1), lambda *ids: (ids[axis], 0))


def _row(block: int, axis: int) -> pl.BlockSpec:  # [1, tokens] / [1, vocab] rows
    return pl.BlockSpec((1, block), lambda *ids: (0, ids[axis]))


def _forward(spec: _Spec, hidden, table, bias, targets, differentiated: bool):
    """(lse, target logit, logit sum, argmax), each [tokens]; differentiated: with (others
    [tokens, d_model], rest [tokens]) float32, what d hidden needs (_statistics_kernel)."""
    tokens, d_model = hidden.shape
    bt, bv = spec.blocks.tokens, spec.blocks.vocab
    grid = (tokens // bt, pl.cdiv(spec.vocab_size, bv))
    computed = tokens * grid[1] * bv  # logits computed, the last block's overhang included
    column = jax.ShapeDtypeStruct((tokens, 1), jnp.float32)
    out_specs = [_column(bt, 0)] * 5
    out_shape = [column] * 4 + [jax.ShapeDtypeStruct((tokens, 1), jnp.int32)]
    if differentiated:
        out_specs += [pl.BlockSpec((bt, d_model), lambda i, j: (i, 0)), _column(bt, 0)]
        out_shape += [jax.ShapeDtypeStruct((tokens, d_model), jnp.float32), column]
    cost = pl.CostEstimate(
        flops=(4 if differentiated else 2) * computed * d_model, transcendentals=computed,
        bytes_accessed=_nbytes(hidden, bias) + grid[0] * _nbytes(table)
        + differentiated * tokens * d_model * 4)
    row_max, sumexp, target_logit, logit_sum, argmax, *for_grads = _pallas(
        spec, _statistics_kernel, grid,
        [pl.BlockSpec((bt, d_model), lambda i, j: (i, 0)),
         pl.BlockSpec((bv, d_model), lambda i, j: (j, 0)), _row(bv, 1), _column(bt, 0)],
        out_specs, out_shape, cost, "tfm_cross_entropy_statistics",
        hidden, table, bias[None, :], targets[:, None],
    )
    lse = row_max + jnp.log(sumexp)
    stats = SoftmaxStatistics(lse[:, 0], target_logit[:, 0], logit_sum[:, 0], argmax[:, 0])
    if not differentiated:
        return stats
    others, rest = for_grads
    return stats, others, rest[:, 0]


def _hidden_grad(spec: _Spec, hidden, table, targets, others, rest, grads):
    """d hidden [tokens, d_model] in hidden's dtype: sum_v g_v W_v with g_v = d_lse p_v +
    d_target [v = target] + d_sum, i.e. d_lse * others + (d_lse (1 - rest) + d_target) *
    W[target] + d_sum * sum_v W_v, from the differentiated forward's `others` [tokens,
    d_model] and `rest` [tokens] (a target outside the vocabulary has no row: rest = 1)."""
    lse_grad, target_grad, sum_grad = grads
    has_row = (targets >= 0) & (targets < spec.vocab_size)
    target_weight = jnp.where(has_row, lse_grad + target_grad - lse_grad * rest, 0.0)
    target_rows = jnp.take(table, targets, axis=0, mode="clip").astype(jnp.float32)
    row_sum = jnp.sum(table, axis=0, dtype=jnp.float32)
    grad = (lse_grad[:, None] * others + target_weight[:, None] * target_rows
            + sum_grad[:, None] * row_sum)
    return grad.astype(hidden.dtype)


def _table_grad(spec: _Spec, hidden, table, bias, targets, lse, grads):
    """d table [vocab, d_model] (table's dtype) and d bias [vocab] float32."""
    tokens, d_model = hidden.shape
    gbt, gbv = spec.blocks.grad_tokens, spec.blocks.grad_vocab
    grad_vocab_blocks = pl.cdiv(spec.vocab_size, gbv)
    per_token = [targets, lse, *grads]
    rows = [value[None, :] for value in per_token]
    computed = tokens * grad_vocab_blocks * gbv
    table_grad, bias_grad = _pallas(
        spec, _table_grad_kernel, (grad_vocab_blocks, tokens // gbt),
        [pl.BlockSpec((gbt, d_model), lambda j, i: (i, 0)),
         pl.BlockSpec((gbv, d_model), lambda j, i: (j, 0)),
         pl.BlockSpec((gbv, 1), lambda j, i: (j, 0)), *[_row(gbt, 1)] * 5],
        [pl.BlockSpec((gbv, d_model), lambda j, i: (j, 0)),
         pl.BlockSpec((gbv, 1), lambda j, i: (j, 0))],
        [jax.ShapeDtypeStruct(table.shape, table.dtype),
         jax.ShapeDtypeStruct((spec.vocab_size, 1), jnp.float32)],
        pl.CostEstimate(flops=4 * computed * d_model, transcendentals=computed,
                        bytes_accessed=grad_vocab_blocks * _nbytes(hidden, *rows)
                        + 2 * _nbytes(table) + 2 * _nbytes(bias)),
        "tfm_cross_entropy_table_grad",
        hidden, table, bias[:, None], *rows,
        scratch_shapes=[pltpu.VMEM((gbv, d_model), jnp.float32)],
    )
    return table_grad, bias_grad[:, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _statistics(spec: _Spec, hidden, table, bias, targets) -> SoftmaxStatistics:
    return _forward(spec, hidden, table, bias, targets, differentiated=False)


def _statistics_forward(spec: _Spec, hidden, table, bias, targets):
    stats, others, rest = _forward(spec, hidden, table, bias, targets, differentiated=True)
    return stats, (hidden, table, bias, targets, stats.lse, others, rest)


def _statistics_backward(spec: _Spec, residuals, stats_grad: SoftmaxStatistics):
    hidden, table, bias, targets, lse, others, rest = residuals
    grads = (stats_grad.lse, stats_grad.target_logit, stats_grad.logit_sum)
    hidden_grad = _hidden_grad(spec, hidden, table, targets, others, rest, grads)
    table_grad, bias_grad = _table_grad(spec, hidden, table, bias, targets, lse, grads)
    return hidden_grad, table_grad, bias_grad, None


_statistics.defvjp(_statistics_forward, _statistics_backward)
