"""The flex kernel's block specs (tfm.kernels.flex_attention) over its grid (batch, head,
block): a query block of a head, a kv head's whole keys or one key block, rows of positions
and segments (queries as [len, 1] columns, keys as [1, len] rows), the per-query log-sum-exp
and delta as lane-dense rows, a head's parameter rows.
`spec` is the kernel's static description (flex_attention._Spec)."""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu


def query_block(spec: Any, head_dim: int, operand: bool = False) -> pl.BlockSpec:
    """A query head's block of [b, heads, q_len, head_dim] (the output, its gradient), or of
    the query as the kernel reads it (`operand`: [.., head_dim, q_len] when spec.seq_minor)."""
    if operand and spec.seq_minor:
        return pl.BlockSpec((None, None, head_dim, spec.block_q), lambda b, h, i: (b, h, 0, i))
    return pl.BlockSpec((None, None, spec.block_q, head_dim), lambda b, h, i: (b, h, i, 0))


def whole_head(length: int, head_dim: int, groups: int = 1,
                mode: pl.Buffered | None = None, seq_minor: bool = False) -> pl.BlockSpec:
    """A head's whole [length, head_dim] ([head_dim, length] when seq_minor)."""
    shape = (head_dim, length) if seq_minor else (length, head_dim)
    return pl.BlockSpec((None, None, *shape),
                        lambda b, h, i: (b, jax.lax.div(h, groups), 0, 0), pipeline_mode=mode)


def key_block(spec: Any, head_dim: int, groups: int = 1, operand: bool = False) -> pl.BlockSpec:
    """A kv head's key block (a gradient's), or the key or value as the kernel reads it."""
    if operand and spec.seq_minor:
        return pl.BlockSpec((None, None, head_dim, spec.block_k),
                            lambda b, h, j: (b, jax.lax.div(h, groups), 0, j))
    return pl.BlockSpec((None, None, spec.block_k, head_dim),
                        lambda b, h, j: (b, jax.lax.div(h, groups), j, 0))


def column(length: int, blocked: bool) -> pl.BlockSpec:  # [batch, len, 1] arrays
    return pl.BlockSpec((None, length, 1), (lambda b, h, i: (b, i, 0)) if blocked
                        else (lambda b, h, i: (b, 0, 0)))


def row(length: int, blocked: bool,
         mode: pl.Buffered | None = None) -> pl.BlockSpec:  # [batch, 1, len] arrays
    return pl.BlockSpec((None, 1, length), (lambda b, h, j: (b, 0, j)) if blocked
                        else (lambda b, h, j: (b, 0, 0)), pipeline_mode=mode)


def per_head_row(leaf: jax.Array) -> pl.BlockSpec:  # [heads, 1, P] arrays
    return pl.BlockSpec((None, 1, leaf.shape[-1]), lambda b, h, i: (h, 0, 0))


def offsets(spec: Any, rows: tuple) -> list[pl.BlockSpec]:
    """The per-row query offset ([batch] int32, whole), if the call has one: scalars read
    from scalar memory on TPU."""
    if not spec.offset:
        return []
    batch = rows[-1].shape[0]
    if spec.compiler == "triton":
        return [pl.BlockSpec((batch,), lambda b, h, i: (0,))]
    return [pl.BlockSpec(memory_space=pltpu.SMEM)]


def row_stats(spec: Any) -> pl.BlockSpec:  # [b, heads, 1, len] per-query figures, by block
    return pl.BlockSpec((None, None, 1, spec.block_q), lambda b, h, i: (b, h, 0, i))
