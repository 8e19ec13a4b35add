"""The static description of one flex kernel call (tfm.kernels.flex_attention): block sizes,
real lengths, the mask by parts and the bias function, and from them which key blocks a query
block can reach (and which query blocks a key block), so the kernels loop over those only and
the cost estimate counts them.

A query's index among the keys may be shifted by a per-row query offset (`KernelSpec.offset`):
context parallelism runs a device's queries against another device's keys with it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl


def _maximum(a: Any, b: int) -> Any:  # on Python ints (cost estimates) or traced block ids
    return max(a, b) if isinstance(a, int) else jnp.maximum(a, b)


def _minimum(a: Any, b: int) -> Any:
    return min(a, b) if isinstance(a, int) else jnp.minimum(a, b)


def _divide(a: Any, b: int) -> Any:  # a >= 0: truncating division is floor division (and
    return a // b if isinstance(a, int) else jax.lax.div(a, jnp.int32(b))  # lowers on any TPU)


@dataclasses.dataclass(frozen=True)
class KernelSpec:
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
    vmem_budget: int | None = None  # on-chip bytes a call may use (flex_vmem.budget)
    seq_minor: bool = False  # q, k, v read as [.., head_dim, T] (flex_operands)

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
