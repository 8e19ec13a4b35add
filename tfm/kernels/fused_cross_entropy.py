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
calculation for softmax"); the backward recomputes each logits block from the saved
log-sum-exp, as flash attention does for its scores (Dao et al. 2022): about 10 N V d FLOPs
instead of the unfused 6 N V d, for traffic that no longer grows with N x V. Three calls: the
statistics over grid (token block, vocab block); d hidden over the same grid; d table (and
d bias) over (vocab block, token block), in the transposed orientation ([vocab block, token
block] tiles, per-token figures as lane-dense rows) so that every matmul is one the MXU takes
directly. On TPU (Mosaic); in interpret mode elsewhere (tests). Under a mesh each device runs
its own rows against the whole table (shard_map; the table's gradient is summed over devices).
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


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes: tokens per block of the statistics and d hidden passes, vocabulary rows per
    block, tokens per block of the d table pass (multiples of 128), and the on-chip memory
    (VMEM) the calls may take. Larger token blocks read the table fewer times."""

    tokens: int
    vocab: int
    grad_tokens: int
    vmem_limit: int


BLOCKS = Blocks(2048, 1024, 512, 64 * 2**20)  # v5e, v5p, v6e: 95-128 MiB of VMEM
SMALL_VMEM_BLOCKS = Blocks(512, 512, 256, 14 * 2**20)  # 16 MiB of VMEM per core
SMALL_VMEM_CHIPS = ("TPU v2", "TPU v3", "TPU v4")  # device_kind prefixes


def blocks_for(device_kind: str) -> Blocks:
    """The tile sizes for a chip (jax Device.device_kind)."""
    return SMALL_VMEM_BLOCKS if device_kind.startswith(SMALL_VMEM_CHIPS) else BLOCKS


class SoftmaxStatistics(NamedTuple):
    """Per-token figures of softmax(W h + b), each [tokens]: `lse`, `target_logit` and
    `logit_sum` float32 (differentiable), `argmax` int32 (the first largest logit)."""

    lse: jax.Array
    target_logit: jax.Array
    logit_sum: jax.Array
    argmax: jax.Array


@dataclasses.dataclass(frozen=True)
class _Spec:
    vocab_size: int  # real vocabulary; the table is padded to whole vocab blocks
    block_tokens: int
    block_vocab: int
    grad_block_tokens: int
    vmem_limit: int
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
    mesh = jax.sharding.get_abstract_mesh()
    if blocks is None:
        blocks = blocks_for(jax.devices()[0].device_kind if mesh.empty
                            else mesh.abstract_device.device_kind)
    for name in ("tokens", "vocab", "grad_tokens"):
        size = getattr(blocks, name)
        if size <= 0 or size % per_device.LANES:
            raise ValueError(f"blocks.{name}={size} must be a positive multiple of "
                             f"{per_device.LANES}")
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


def _round_up(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def _local(hidden, table, bias, targets, *, blocks: Blocks,
           compiler: str | None) -> SoftmaxStatistics:
    """One device's rows: flattened to [tokens, d_model], padded to whole blocks."""
    leading = targets.shape
    tokens = math.prod(leading)
    vocab_size, d_model = table.shape
    block_tokens, block_vocab, grad_block_tokens = blocks.tokens, blocks.vocab, blocks.grad_tokens
    # Small inputs take one block (rounded to the 128-lane tile), not a mostly-padded one.
    block_vocab = min(block_vocab, _round_up(vocab_size, per_device.LANES))
    block_tokens = min(block_tokens, _round_up(tokens, per_device.LANES))
    grad_block_tokens = min(grad_block_tokens, block_tokens)
    token_multiple = math.lcm(block_tokens, grad_block_tokens)
    padded_tokens = _round_up(tokens, token_multiple)
    padded_vocab = _round_up(vocab_size, block_vocab)
    hidden = jnp.pad(hidden.reshape(tokens, d_model), ((0, padded_tokens - tokens), (0, 0)))
    targets = jnp.pad(targets.reshape(tokens).astype(jnp.int32), (0, padded_tokens - tokens))
    table = jnp.pad(table, ((0, padded_vocab - vocab_size), (0, 0)))
    bias = jnp.pad(bias, (0, padded_vocab - vocab_size))
    precision = (jax.lax.Precision.HIGHEST if jnp.dtype(hidden.dtype) == jnp.float32
                 else jax.lax.Precision.DEFAULT)

    def run(hidden, table, bias, targets, *, compiler: str) -> SoftmaxStatistics:
        spec = _Spec(vocab_size=vocab_size, block_tokens=block_tokens, block_vocab=block_vocab,
                     grad_block_tokens=grad_block_tokens, vmem_limit=blocks.vmem_limit,
                     precision=precision, compiler=compiler)
        return _statistics(spec, hidden, table, bias, targets)

    stats = per_device.by_platform(run, compiler, hidden, table, bias, targets)
    return SoftmaxStatistics(*(value[:tokens].reshape(leading) for value in stats))


# ---------------------------------------------------------------- the blocks' maths


def _logits(spec: _Spec, hidden, table, bias, first_vocab, transposed: bool):
    """A logits block, float32, and which of its entries are real vocabulary: [block_t,
    block_v] from hidden [block_t, d] and table [block_v, d] (bias [1, block_v]); transposed:
    [block_v, block_t] (bias [block_v, 1])."""
    first, second = (table, hidden) if transposed else (hidden, table)
    logits = jax.lax.dot_general(first, second, (((1,), (1,)), ((), ())),
                                 preferred_element_type=jnp.float32, precision=spec.precision)
    logits = logits + bias
    vocab_axis = 0 if transposed else 1
    column = first_vocab + jax.lax.broadcasted_iota(jnp.int32, logits.shape, vocab_axis)
    return logits, column, column < spec.vocab_size


def _logit_grads(spec: _Spec, hidden, table, bias, targets, lse, grads, first_vocab,
                 transposed: bool = False):
    """d loss / d logits of a block: d_lse * softmax + d_target * onehot + d_sum (0 outside
    the vocabulary). targets, lse and the three cotangents: [block_t, 1] ([1, block_t] when
    transposed)."""
    lse_grad, target_grad, sum_grad = grads
    logits, column, real = _logits(spec, hidden, table, bias, first_vocab, transposed)
    probs = jnp.exp(logits - lse)
    grad = lse_grad * probs + jnp.where(column == targets, target_grad, 0.0) + sum_grad
    return jnp.where(real, grad, 0.0)


def _statistics_kernel(spec: _Spec, hidden_ref, table_ref, bias_ref, targets_ref,
                       max_ref, sumexp_ref, target_ref, sum_ref, argmax_ref) -> None:
    vocab_block = pl.program_id(1)

    @pl.when(vocab_block == 0)
    def _():
        max_ref[...] = jnp.full(max_ref.shape, -jnp.inf, jnp.float32)
        sumexp_ref[...] = jnp.zeros(sumexp_ref.shape, jnp.float32)
        target_ref[...] = jnp.zeros(target_ref.shape, jnp.float32)
        sum_ref[...] = jnp.zeros(sum_ref.shape, jnp.float32)
        argmax_ref[...] = jnp.zeros(argmax_ref.shape, jnp.int32)

    logits, column, real = _logits(spec, hidden_ref[...], table_ref[...], bias_ref[...],
                                   vocab_block * spec.block_vocab, transposed=False)
    logits = jnp.where(real, logits, -jnp.inf)
    block_max = jnp.max(logits, axis=1, keepdims=True)
    old_max = max_ref[...]
    new_max = jnp.maximum(old_max, block_max)  # finite: every block holds a real column
    sumexp_ref[...] = (sumexp_ref[...] * jnp.exp(old_max - new_max)
                       + jnp.sum(jnp.exp(logits - new_max), axis=1, keepdims=True))
    max_ref[...] = new_max
    target_ref[...] += jnp.sum(jnp.where(column == targets_ref[...], logits, 0.0), axis=1,
                               keepdims=True)
    sum_ref[...] += jnp.sum(jnp.where(real, logits, 0.0), axis=1, keepdims=True)
    # The first largest: the block's first maximum, taken only when it beats earlier blocks.
    # (Indices as float32, exact below 2**24, whose lane reduction every TPU has.)
    block_argmax = jnp.min(jnp.where(logits == block_max, column.astype(jnp.float32), jnp.inf),
                           axis=1, keepdims=True).astype(jnp.int32)
    argmax_ref[...] = jnp.where(block_max > old_max, block_argmax, argmax_ref[...])


def _hidden_grad_kernel(spec: _Spec, hidden_ref, table_ref, bias_ref, targets_ref, lse_ref,
                        lse_grad_ref, target_grad_ref, sum_grad_ref, hidden_grad_ref) -> None:
    vocab_block = pl.program_id(1)

    @pl.when(vocab_block == 0)
    def _():
        hidden_grad_ref[...] = jnp.zeros(hidden_grad_ref.shape, jnp.float32)

    table = table_ref[...]
    grads = (lse_grad_ref[...], target_grad_ref[...], sum_grad_ref[...])
    logit_grads = _logit_grads(spec, hidden_ref[...], table, bias_ref[...], targets_ref[...],
                               lse_ref[...], grads, vocab_block * spec.block_vocab)
    hidden_grad_ref[...] += jnp.dot(logit_grads.astype(table.dtype), table,
                                    preferred_element_type=jnp.float32,
                                    precision=spec.precision)


def _table_grad_kernel(spec: _Spec, hidden_ref, table_ref, bias_ref, targets_ref, lse_ref,
                       lse_grad_ref, target_grad_ref, sum_grad_ref, table_grad_ref,
                       bias_grad_ref) -> None:
    vocab_block, token_block = pl.program_id(0), pl.program_id(1)

    @pl.when(token_block == 0)
    def _():
        table_grad_ref[...] = jnp.zeros(table_grad_ref.shape, jnp.float32)
        bias_grad_ref[...] = jnp.zeros(bias_grad_ref.shape, jnp.float32)

    hidden = hidden_ref[...]
    grads = (lse_grad_ref[...], target_grad_ref[...], sum_grad_ref[...])
    logit_grads = _logit_grads(spec, hidden, table_ref[...], bias_ref[...], targets_ref[...],
                               lse_ref[...], grads, vocab_block * spec.block_vocab,
                               transposed=True)  # [block_v, block_t]
    table_grad_ref[...] += jnp.dot(logit_grads.astype(hidden.dtype), hidden,
                                   preferred_element_type=jnp.float32,
                                   precision=spec.precision)
    bias_grad_ref[...] += jnp.sum(logit_grads, axis=1, keepdims=True)


# ---------------------------------------------------------------- the calls


def _pallas(spec: _Spec, kernel, grid, in_specs, out_specs, out_shape, cost, name, *args):
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                  vmem_limit_bytes=spec.vmem_limit)
    return pl.pallas_call(
        functools.partial(kernel, spec), grid=grid, in_specs=in_specs, out_specs=out_specs,
        out_shape=out_shape, interpret=spec.compiler == "interpret", cost_estimate=cost,
        name=name, compiler_params=params,
    )(*args)


def _nbytes(*arrays: Any) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in arrays)


def _column(block: int, axis: int) -> pl.BlockSpec:  # [tokens, 1] per-token figures
    return pl.BlockSpec((block, 1), lambda *ids: (ids[axis], 0))


def _row(block: int, axis: int) -> pl.BlockSpec:  # [1, tokens] / [1, vocab] rows
    return pl.BlockSpec((1, block), lambda *ids: (0, ids[axis]))


def _forward(spec: _Spec, hidden, table, bias, targets):
    tokens, d_model = hidden.shape
    padded_vocab = table.shape[0]
    bt, bv = spec.block_tokens, spec.block_vocab
    grid = (tokens // bt, padded_vocab // bv)
    column = jax.ShapeDtypeStruct((tokens, 1), jnp.float32)
    cost = pl.CostEstimate(flops=2 * tokens * padded_vocab * d_model,
                           transcendentals=tokens * padded_vocab,
                           bytes_accessed=_nbytes(hidden, bias) + grid[0] * _nbytes(table))
    row_max, sumexp, target_logit, logit_sum, argmax = _pallas(
        spec, _statistics_kernel, grid,
        [pl.BlockSpec((bt, d_model), lambda i, j: (i, 0)),
         pl.BlockSpec((bv, d_model), lambda i, j: (j, 0)), _row(bv, 1), _column(bt, 0)],
        [_column(bt, 0)] * 5,
        [column] * 4 + [jax.ShapeDtypeStruct((tokens, 1), jnp.int32)],
        cost, "tfm_cross_entropy_statistics",
        hidden, table, bias[None, :], targets[:, None],
    )
    lse = row_max + jnp.log(sumexp)
    return lse[:, 0], target_logit[:, 0], logit_sum[:, 0], argmax[:, 0]


def _backward(spec: _Spec, hidden, table, bias, targets, lse, grads):
    tokens, d_model = hidden.shape
    padded_vocab = table.shape[0]
    bt, bv, gbt = spec.block_tokens, spec.block_vocab, spec.grad_block_tokens
    flops = 4 * tokens * padded_vocab * d_model
    per_token = [targets, lse, *grads]
    columns = [value[:, None] for value in per_token]
    hidden_grad = _pallas(
        spec, _hidden_grad_kernel, (tokens // bt, padded_vocab // bv),
        [pl.BlockSpec((bt, d_model), lambda i, j: (i, 0)),
         pl.BlockSpec((bv, d_model), lambda i, j: (j, 0)), _row(bv, 1),
         *[_column(bt, 0)] * 5],
        pl.BlockSpec((bt, d_model), lambda i, j: (i, 0)),
        jax.ShapeDtypeStruct((tokens, d_model), jnp.float32),
        pl.CostEstimate(flops=flops, transcendentals=tokens * padded_vocab,
                        bytes_accessed=_nbytes(hidden, *columns) * 2
                        + tokens // bt * _nbytes(table)),
        "tfm_cross_entropy_hidden_grad",
        hidden, table, bias[None, :], *columns,
    )
    rows = [value[None, :] for value in per_token]
    table_grad, bias_grad = _pallas(
        spec, _table_grad_kernel, (padded_vocab // bv, tokens // gbt),
        [pl.BlockSpec((gbt, d_model), lambda j, i: (i, 0)),
         pl.BlockSpec((bv, d_model), lambda j, i: (j, 0)),
         pl.BlockSpec((bv, 1), lambda j, i: (j, 0)), *[_row(gbt, 1)] * 5],
        [pl.BlockSpec((bv, d_model), lambda j, i: (j, 0)), pl.BlockSpec((bv, 1),
                                                                    lambda j, i: (j, 0))],
        [jax.ShapeDtypeStruct((padded_vocab, d_model), jnp.float32),
         jax.ShapeDtypeStruct((padded_vocab, 1), jnp.float32)],
        pl.CostEstimate(flops=flops, transcendentals=tokens * padded_vocab,
                        bytes_accessed=padded_vocab // bv * _nbytes(hidden, *rows)
                        + 3 * _nbytes(table)),
        "tfm_cross_entropy_table_grad",
        hidden, table, bias[:, None], *rows,
    )
    return hidden_grad.astype(hidden.dtype), table_grad.astype(table.dtype), bias_grad[:, 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _statistics(spec: _Spec, hidden, table, bias, targets) -> SoftmaxStatistics:
    return SoftmaxStatistics(*_forward(spec, hidden, table, bias, targets))


def _statistics_forward(spec: _Spec, hidden, table, bias, targets):
    stats = SoftmaxStatistics(*_forward(spec, hidden, table, bias, targets))
    return stats, (hidden, table, bias, targets, stats.lse)


def _statistics_backward(spec: _Spec, residuals, stats_grad: SoftmaxStatistics):
    hidden, table, bias, targets, lse = residuals
    grads = (stats_grad.lse, stats_grad.target_logit, stats_grad.logit_sum)
    hidden_grad, table_grad, bias_grad = _backward(spec, hidden, table, bias, targets, lse,
                                                   grads)
    return hidden_grad, table_grad, bias_grad, None


_statistics.defvjp(_statistics_forward, _statistics_backward)
