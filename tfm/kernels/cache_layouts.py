"""How a KV cache (tfm/nn/cache.py) stores each layer's keys and values, and how a layer writes
and reads them. The reference layout is the model's own, [batch, slots, kv_heads, head_dim];
a platform may choose another (tfm/kernels/cpu_cache.py, tpu_cache.py) that its attention
kernel reads. The reference einsums read any of them as stored (reference.dot_product_attention's
key_axes and value_axes).

Axis names: b (batch, always first, so beam search can reorder rows of any layout), s (slots),
n (kv heads), h (head_dim).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from tfm.kernels.reference import MODEL_AXES

# One layer's slots per entry (a tuple), or all layers stacked on axis 1.
LayerSlots = tuple[jax.Array, ...] | jax.Array


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Key and value axis orders (permutations of "bsnh"), three storage choices and one for
    the prefill:
    stack_single_row: a batch-1 cache stacks its layers on axis 1 (as `scan_layers` always does);
    write_16bit_as_uint16: 16-bit floats are written through a uint16 view;
    pin_order: every cache array is stored in its axis order, row-major (`pinned`);
    prefill_reads_back: a prefill that fills the cache attends to its keys and values read back
    from it (`in_model_order`), not to its own copies, which then die at the write (tfm.nn.layers):
    for layouts whose stored order the kernels read as it is, so the read costs no copy."""

    name: str
    key_axes: str = MODEL_AXES
    value_axes: str = MODEL_AXES
    stack_single_row: bool = False
    write_16bit_as_uint16: bool = False
    pin_order: bool = False
    prefill_reads_back: bool = False

    def axes(self, is_key: bool) -> str:
        return self.key_axes if is_key else self.value_axes

    def slot_axis(self, is_key: bool) -> int:
        """The slots' axis in one layer's [batch, ...] array (stacked arrays: one more)."""
        return self.axes(is_key).index("s")

    def layer_shape(
        self, is_key: bool, batch: int, slots: int, heads: int, head_dim: int
    ) -> tuple[int, ...]:
        sizes = dict(b=batch, s=slots, n=heads, h=head_dim)
        return tuple(sizes[axis] for axis in self.axes(is_key))

    def stacked(self, scan_layers: bool, batch: int) -> bool:
        """Whether the layers' slots are one array [batch, layers, ...] instead of a tuple:
        always under nn.scan (it indexes layers with a traced index)."""
        return scan_layers or (self.stack_single_row and batch == 1)

    def write(
        self,
        slots: LayerSlots,
        new: jax.Array,  # [batch, new_len, kv_heads, head_dim]
        layer: jax.Array | int,  # a Python int for per-layer slots; may be traced when stacked
        start: jax.Array,  # [batch] int32
        is_key: bool,
    ) -> LayerSlots:
        """`slots` with `new` in layer `layer`, slots [start, start + new_len) of each row (in
        place under jit when `slots` is not used afterwards). The caller checks bounds: inside
        jit an out-of-range start would be clamped by dynamic_update_slice."""
        axes = self.axes(is_key)
        # The new tokens in the cache's order, stored as the cache is: else XLA may copy the
        # whole cache into the new tokens' order to write them (every decoding step).
        new = self.pinned(jnp.transpose(new, [MODEL_AXES.index(axis) for axis in axes]))
        stacked = not isinstance(slots, tuple | list)
        target = slots if stacked else slots[layer]
        row_axes = axes[1:]  # a row's own axes, without the batch

        def write_row(row_slots: jax.Array, row_new: jax.Array, row_start: jax.Array):
            zero = jnp.int32(0)
            index = tuple(row_start if axis == "s" else zero for axis in row_axes)
            if stacked:
                index = (jnp.asarray(layer, jnp.int32), *index)
                row_new = row_new[None]
            return jax.lax.dynamic_update_slice(row_slots, row_new.astype(row_slots.dtype), index)

        start = start.astype(jnp.int32)
        dtype = jnp.dtype(target.dtype)
        as_bits = self.write_16bit_as_uint16 and dtype.itemsize == 2
        if as_bits and jnp.issubdtype(dtype, jnp.floating):
            bits = jax.lax.bitcast_convert_type
            written = jax.vmap(write_row)(
                bits(target, jnp.uint16), bits(new.astype(target.dtype), jnp.uint16), start
            )
            written = bits(written, target.dtype)
        else:
            written = jax.vmap(write_row)(target, new, start)
        written = self.pinned(written)
        if stacked:
            return written
        return (*slots[:layer], written, *slots[layer + 1 :])

    def pinned(self, array: jax.Array) -> jax.Array:
        """`array` (a layer's slots, or all layers' stacked) stored in its axis order, when
        this layout pins it (pin_order): else XLA may store a value in another order."""
        if not self.pin_order:
            return array
        from jax.experimental.layout import Layout, with_layout_constraint
        return with_layout_constraint(array, Layout(major_to_minor=tuple(range(array.ndim))))

    def in_model_order(self, array: jax.Array, is_key: bool) -> jax.Array:
        """One layer's keys (or values) [batch, ...] in this layout as the model's
        [batch, slots, kv_heads, head_dim] (a transpose: a copy where XLA materialises it)."""
        axes = self.axes(is_key)
        if axes == MODEL_AXES:
            return array
        return jnp.transpose(array, [axes.index(axis) for axis in MODEL_AXES])

    def read(self, slots: LayerSlots, layer: jax.Array | int) -> jax.Array:
        """One layer's slots [batch, ...] in this layout: its own buffer, or (stacked) a slice."""
        if isinstance(slots, tuple | list):
            return slots[layer]
        return jax.lax.dynamic_index_in_dim(slots, layer, axis=1, keepdims=False)


REFERENCE = CacheLayout("reference", prefill_reads_back=True)
