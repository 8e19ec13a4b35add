"""How the flex kernel (tfm.kernels.flex_attention) holds the arrays it reads block by block
(a head's keys and values, or its queries and output gradients, with their position and
segment rows): whole in on-chip memory (VMEM) when they fit the chip's budget, else streamed
from HBM one block at a time, each block's copy overlapping the previous block's work (as
splash attention streams its key blocks).

The budget comes from the chip the kernel is compiled for (the mesh's device kind while
tracing, else jax's first device): 3/4 of its VMEM (tfm.kernels.hardware.VMEM_BYTES), as the
first flex kernel asked of the v5e's 128 MiB, the rest left to Mosaic's own scratch. Interpret
mode and Triton have no budget (None): arrays stay whole unless a caller passes one."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tfm.kernels import flex_blocks, hardware, per_device

HEADROOM = 8 * 2**20  # VMEM a grid step needs besides the whole-head arrays (its blocks, tiles)
SMALLEST_LIMIT = 32 * 2**20  # the least a call asks for, where the chip has it
RESIDENCIES = ("double", "single", "stream")
_HBM = pl.BlockSpec(memory_space=pl.ANY)  # a whole array left in HBM, copied by the kernel


def budget(compiler: str, kind: str | None = None) -> int | None:
    """VMEM bytes a kernel call may use on the chip `kind` (None: the one traced for,
    per_device.device_kind): 3/4 of the chip's VMEM under Mosaic; None (no limit) otherwise."""
    if compiler != "mosaic":
        return None
    return hardware.vmem_bytes(per_device.device_kind() if kind is None else kind) * 3 // 4


def residency(vmem_budget: int | None, length: int, head_dim: int, dtype: Any,
              count: int = 2) -> str:
    """How `count` whole-head [length, head_dim] arrays and their rows are held (RESIDENCIES):
    "double" (the next head's copy loads while this one is used) if two copies fit the budget,
    else "single" (each head waits for its load) if one copy and HEADROOM fit, else "stream"
    (block by block from HBM, `block_loop`). At 131,072 keys of 64 lanes in bf16 one copy is
    80 MiB: single on a v5e (96 MiB), streamed on a v5p (48 MiB)."""
    if vmem_budget is None:
        return "double"
    if per_device.resident_bytes(length, head_dim, dtype, count, 2) <= vmem_budget:
        return "double"
    if per_device.resident_bytes(length, head_dim, dtype, count, 1) + HEADROOM <= vmem_budget:
        return "single"
    return "stream"


def buffering(held: str) -> pl.Buffered | None:
    """The pipeline mode of a whole-head block spec held `held` (not "stream")."""
    return pl.Buffered(1) if held == "single" else None


def call_limit(vmem_budget: int | None, resident: int) -> int:
    """vmem_limit_bytes of a call whose whole-head arrays take `resident` bytes: twice that
    and HEADROOM, at least SMALLEST_LIMIT, at most the budget (SMALLEST_LIMIT without one)."""
    most = SMALLEST_LIMIT if vmem_budget is None else vmem_budget
    return int(min(max(2 * resident + HEADROOM, SMALLEST_LIMIT), most))


def streamed_scratch(blocks: Sequence[tuple[tuple[int, ...], Any]]) -> list:
    """Scratch for `block_loop` streaming arrays whose blocks have these (shape, dtype): two
    VMEM buffers each, and a DMA semaphore per buffer."""
    return [*(pltpu.VMEM((2, *shape), dtype) for shape, dtype in blocks),
            pltpu.SemaphoreType.DMA((len(blocks), 2))]


def split_scratch(refs: tuple, streamed: int) -> tuple[tuple, Any]:
    """A kernel's refs without, and the scratch of, `streamed` streamed arrays (None: held)."""
    if not streamed:
        return refs, None
    return refs[:-streamed - 1], refs[-streamed - 1:]


class Reads(NamedTuple):
    """How a pass reads the whole-head arrays it loops over in blocks (and their rows)."""

    streamed: int  # arrays streamed from HBM (0: held whole on chip)
    head: pl.BlockSpec  # of each [length, head_dim] array
    operand: pl.BlockSpec  # of each query, key or value, as the kernel reads it (seq_minor)
    row: pl.BlockSpec  # of each [batch, 1, length] row
    head_row: pl.BlockSpec | None  # of each [batch, heads, 1, length] row (dk/dv's)
    scratch: tuple  # the streaming buffers and semaphores
    on_chip: int  # VMEM bytes of the held arrays or the buffers
    extra_bytes: int  # HBM bytes the streaming reads besides each array once


def key_inputs(spec: Any, heads: int, length: int, head_dim: int, dtype: Any) -> Reads:
    """Reads of the forward and dq passes: a kv head's `length` keys and values of `head_dim`
    lanes in `dtype` and their position and segment rows, by `heads` (batch x query heads)
    grid rows, as `residency` decides on spec.vmem_budget; streamed, each query block reads its
    visible key blocks (spec.visible_pairs)."""
    held = residency(spec.vmem_budget, length, head_dim, dtype)
    if held != "stream":
        mode = buffering(held)
        keys = flex_blocks.whole_head(length, head_dim, spec.groups, mode, spec.seq_minor)
        return Reads(0, keys, keys, flex_blocks.row(length, False, mode), None, (),
                     per_device.resident_bytes(length, head_dim, dtype, 2, 1 if mode else 2), 0)
    blocks = [(_block(spec.block_k, head_dim, spec.seq_minor), dtype)] * 2 + [
        ((1, spec.block_k), jnp.int32)] * 2
    key_rows = heads * spec.visible_pairs() // spec.block_q
    return Reads(4, _HBM, _HBM, _HBM, None, tuple(streamed_scratch(blocks)),
                 per_device.resident_bytes(spec.block_k, head_dim, dtype, 2),
                 key_rows * (2 * head_dim * jnp.dtype(dtype).itemsize + 2 * 4))


def query_inputs(spec: Any, heads: int, length: int, head_dim: int, dtype: Any) -> Reads:
    """Reads of the dk/dv pass: a query head's `length` queries and output gradients and their
    log-sum-exp, delta, position and segment rows; streamed, each key block reads its visible
    query blocks."""
    held = residency(spec.vmem_budget, length, head_dim, dtype)
    if held != "stream":
        mode = buffering(held)
        head_row = pl.BlockSpec((None, None, 1, length), lambda b, h, j: (b, h, 0, 0),
                                pipeline_mode=mode)
        return Reads(0, flex_blocks.whole_head(length, head_dim, 1, mode),
                     flex_blocks.whole_head(length, head_dim, 1, mode, spec.seq_minor),
                     flex_blocks.row(length, False, mode), head_row, (),
                     per_device.resident_bytes(length, head_dim, dtype, 2, 1 if mode else 2), 0)
    float32, int32 = jnp.float32, jnp.int32
    blocks = [(_block(spec.block_q, head_dim, spec.seq_minor), dtype),
              ((spec.block_q, head_dim), dtype)] + [((1, spec.block_q), float32)] * 2 + [
        ((1, spec.block_q), int32)] * 2
    query_rows = heads * spec.visible_pairs() // spec.block_k
    return Reads(6, _HBM, _HBM, _HBM, _HBM, tuple(streamed_scratch(blocks)),
                 per_device.resident_bytes(spec.block_q, head_dim, dtype, 2),
                 query_rows * (2 * head_dim * jnp.dtype(dtype).itemsize + 4 * 4))


def _block(size: int, head_dim: int, seq_minor: bool) -> tuple[int, int]:
    """The shape of one streamed block of a query, key or value as the kernel reads it."""
    return (head_dim, size) if seq_minor else (size, head_dim)


def _window(axis: int, start: Any, size: int) -> tuple:
    """Block `start // size` of a 2-D [length, d] (axis 0), or [d, length] or [1, length]
    (axis 1) array."""
    return (pl.ds(start, size), slice(None)) if axis == 0 else (slice(None), pl.ds(start, size))


def block_loop(refs: Sequence[Any], axes: Sequence[int], size: int, first: Any, end: Any,
               visit: Callable[..., Any], init: Any, leads: Sequence[tuple] = (),
               scratch: Sequence[Any] | None = None) -> Any:
    """fori_loop over blocks [first, end) of `size` rows: visit(index, views, carry), `views`
    the block of each array as a VMEM ref ([size, d] or [1, size]). Held whole (scratch None):
    refs are the 2-D whole-head arrays, blocks run along `axes`. Streamed (scratch from
    `streamed_scratch`): refs are whole arrays in HBM, `leads` the indices before their last two
    axes (batch, head); block i + 1 is copied into one buffer while block i is read from the
    other."""
    if scratch is None:
        def held(index: Any, carry: Any) -> Any:
            start = pl.multiple_of(index * size, size)
            return visit(index, [ref.at[_window(axis, start, size)]
                                 for ref, axis in zip(refs, axes, strict=True)], carry)

        return jax.lax.fori_loop(first, end, held, init)
    *buffers, semaphores = scratch

    def copies(index: Any, slot: Any) -> list:
        start = pl.multiple_of(index * size, size)
        return [pltpu.make_async_copy(ref.at[(*lead, *_window(axis, start, size))],
                                      buffer.at[slot], semaphores.at[number, slot])
                for number, (ref, lead, axis, buffer)
                in enumerate(zip(refs, leads, axes, buffers, strict=True))]

    @pl.when(first < end)
    def _() -> None:
        for copy in copies(first, 0):
            copy.start()

    def streamed(index: Any, carry: Any) -> Any:
        slot = jax.lax.rem(index - first, 2)
        for copy in copies(index, slot):
            copy.wait()

        @pl.when(index + 1 < end)
        def _() -> None:
            for copy in copies(index + 1, 1 - slot):
                copy.start()

        return visit(index, [buffer.at[slot] for buffer in buffers], carry)

    return jax.lax.fori_loop(first, end, streamed, init)
