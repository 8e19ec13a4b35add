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


def query_block(spec: Any, head_dim: int) -> pl.BlockSpec:
    return pl.BlockSpec((None, None, spec.block_q, head_dim), lambda b, h, i: (b, h, i, 0))


def whole_head(length: int, head_dim: int, groups: int = 1,
                mode: pl.Buffered | None = None) -> pl.BlockSpec:
    return pl.BlockSpec((None, None, length, head_dim),
                        lambda b, h, i: (b, jax.lax.div(h, groups), 0, 0), pipeline_mode=mode)


def key_block(spec: Any, head_dim: int, groups: int = 1) -> pl.BlockSpec:
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
