"""The KV cache: an explicit pytree passed into a model and returned updated, never hidden state.

Layout (every leaf has batch on axis 0, so decoding algorithms can reorder beams with
`jax.tree.map(lambda x: x[indices], cache)` without knowing the model):

- `keys`: per layer a [batch, num_kv_heads, head_dim, max_len] array, and `values`: per layer a
  [batch, num_kv_heads, max_len, head_dim] array, as tuples with one entry per layer. Slot i of
  row b holds the key/value of that row's token at position i (RoPE keys are stored already
  rotated). These are the layouts the decode step's two attention matmuls (q . K and weights . V)
  read as they are, and one buffer per layer means a layer reads its slots without a copy and
  writes its new tokens in place (`write_layer`): no step copies or transposes the cache.
  Two cases instead stack the layers into one array on axis 1, [batch, num_layers, ...], where
  a layer reads a copy of its slots (XLA materialises the slice) and writes in place:
  `scan_layers` (nn.scan indexes layers with a traced index) and batch size 1 (there XLA
  drops the unit batch axis before the attention matmul and then duplicates each per-layer
  write into that reader and the loop carry: four whole-layer copies per layer and step in
  the compiled decode loop, against one slice copy when stacked).
  `grow` appends empty slots: decoding starts from a cache with room for the prompt and grows
  it before each segment of its loop (tfm.decode.search, `cache_segments`).
- `lengths`: [batch] int32, how many slots of each row are filled = where the next token is written.
  Rows advance independently (prompts of different lengths, rows that stopped at EOS).
- `valid`: [batch, max_len] bool, which filled slots hold real tokens (False for left padding
  written by a prefill with an explicit valid mask); slots are attended to when filled and valid.
- `cross_keys`, `cross_values`: like keys and values with source_len slots, the
  encoder-decoder's cross-attention keys/values, projected once from the encoder output.
- `source_valid`: [batch, source_len] bool, which source positions are real tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from tfm.nn.config import ModelConfig

# One layer's slots per entry (a tuple), or all layers stacked on axis 1 (scan_layers).
LayerSlots = tuple[jax.Array, ...] | jax.Array


@struct.dataclass
class DecoderCache:
    keys: LayerSlots  # per layer [batch, num_kv_heads, head_dim, max_len]
    values: LayerSlots  # per layer [batch, num_kv_heads, max_len, head_dim]
    lengths: jax.Array  # [batch] int32
    valid: jax.Array | None = None  # [batch, max_len] bool; None = every filled slot is real
    cross_keys: LayerSlots | None = None  # per layer [batch, num_kv_heads, head_dim, source_len]
    cross_values: LayerSlots | None = None  # per layer [batch, num_kv_heads, source_len, head_dim]
    source_valid: jax.Array | None = None  # [batch, source_len] bool

    @property
    def max_len(self) -> int:
        return read_layer(self.keys, 0).shape[-1]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]


def init_cache(
    config: ModelConfig,
    batch_size: int,
    max_len: int,
    dtype: jnp.dtype | str | None = None,
    source_len: int | None = None,
) -> DecoderCache:
    """An empty cache for the decoder of `config` (with cross-attention slots if source_len)."""
    if batch_size < 1 or max_len < 1:
        raise ValueError(
            f"cache needs batch_size >= 1 and max_len >= 1; got {batch_size}, {max_len}"
        )
    if config.num_decoder_layers < 1:
        raise ValueError("the model config has num_decoder_layers=0: an encoder has no KV cache")
    dtype = jnp.dtype(dtype or config.dtype)
    layers = config.num_decoder_layers
    heads, head_dim = config.resolved_num_kv_heads, config.resolved_head_dim

    def empty(shape: tuple[int, ...]) -> LayerSlots:  # shape of one layer's slots
        if config.scan_layers or batch_size == 1:  # stacked: see the module docstring
            return jnp.zeros((shape[0], layers, *shape[1:]), dtype)
        return tuple(jnp.zeros(shape, dtype) for _ in range(layers))

    cross = {}
    if source_len is not None:
        cross = dict(
            cross_keys=empty((batch_size, heads, head_dim, source_len)),
            cross_values=empty((batch_size, heads, source_len, head_dim)),
            source_valid=jnp.zeros((batch_size, source_len), bool),
        )
    return DecoderCache(
        keys=empty((batch_size, heads, head_dim, max_len)),
        values=empty((batch_size, heads, max_len, head_dim)),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        valid=jnp.ones((batch_size, max_len), bool),
        **cross,
    )


def check_cache(cache: DecoderCache, config: ModelConfig, has_cross: bool) -> None:
    """Raises a readable error when `cache` was built for another model config."""
    expected = (
        config.num_decoder_layers,
        config.resolved_num_kv_heads,
        config.resolved_head_dim,
    )
    stacked = not isinstance(cache.keys, tuple | list)
    if stacked:
        got = tuple(cache.keys.shape[1:4]) if cache.keys.ndim == 5 else cache.keys.shape
    else:
        got = (len(cache.keys), *cache.keys[0].shape[1:3]) if cache.keys else (0,)
    if got != expected or (config.scan_layers and not stacked):
        form = "stacked" if stacked else "per-layer"
        raise ValueError(
            "cache was built for another model config: (num_decoder_layers, num_kv_heads, "
            f"head_dim) is {got} ({form} slots) in the cache but {expected} in the model "
            f"config (scan_layers={config.scan_layers}); build it with "
            "tfm.nn.cache.init_cache(config, ...)"
        )
    if has_cross and cache.cross_keys is None:
        raise ValueError(
            "the encoder-decoder needs a cache with cross-attention slots: "
            "init_cache(config, batch_size, max_len, source_len=...)"
        )


def check_room(cache: DecoderCache, new_len: int) -> None:
    """Raises when a row's `new_len` more tokens would not fit, if the lengths are known now
    (outside jit). Under jit the model returns NaN logits for such rows instead."""
    if isinstance(cache.lengths, jax.core.Tracer):
        return
    lengths = np.asarray(cache.lengths)
    if lengths.size and int(lengths.max()) + new_len > cache.max_len:
        rows = np.flatnonzero(lengths + new_len > cache.max_len).tolist()
        raise ValueError(
            f"{new_len} new token(s) do not fit the cache: rows {rows} already hold "
            f"{lengths[rows].tolist()} of max_len={cache.max_len} slots; build a larger cache "
            "with init_cache"
        )


def grow(cache: DecoderCache, extra_slots: int) -> DecoderCache:
    """`cache` with `extra_slots` more empty self-attention slots at the end of every row (keys,
    values and `valid`, which marks them real); filled slots, lengths and the cross-attention
    slots are unchanged. Decoding grows its cache as it goes (tfm.decode.search, `cache_segments`),
    so
    its early steps attend over fewer slots. One copy of the slots per call."""

    def pad(slots: LayerSlots, slot_axis: int) -> LayerSlots:
        def pad_one(array: jax.Array) -> jax.Array:
            widths = [(0, 0)] * array.ndim
            widths[slot_axis % array.ndim] = (0, extra_slots)
            return jnp.pad(array, widths)

        if isinstance(slots, tuple | list):
            return tuple(pad_one(array) for array in slots)
        return pad_one(slots)

    if extra_slots < 0:
        raise ValueError(f"extra_slots={extra_slots} must be >= 0")
    valid = cache.valid
    if valid is not None:
        valid = jnp.pad(valid, ((0, 0), (0, extra_slots)), constant_values=True)
    return cache.replace(keys=pad(cache.keys, -1), values=pad(cache.values, -2), valid=valid)


def reorder_beams(cache: DecoderCache, index: jax.Array) -> DecoderCache:
    """Row r of the result is row index[r] of `cache` ([batch * beam] int, beam search's parent
    of each beam): the self-attention slots, lengths and `valid` move; the cross-attention slots
    and `source_valid` stay, because beam search only moves a row among the beams of its own
    source, which hold the same cross-attention entries. Gathering those too (what a generic
    pytree gather does) copied the encoder's keys and values of every layer at every step."""
    take = lambda array: array[index]
    slots = lambda s: tuple(map(take, s)) if isinstance(s, tuple | list) else take(s)
    return cache.replace(
        keys=slots(cache.keys), values=slots(cache.values), lengths=take(cache.lengths),
        valid=None if cache.valid is None else take(cache.valid),
    )


def write_layer(
    slots: LayerSlots,  # keys: per layer [batch, kv_heads, head_dim, slots]; values [.., slots, hd]
    new: jax.Array,  # [batch, kv_heads, new_len, head_dim]
    layer: jax.Array | int,  # a Python int for per-layer slots; may be traced for stacked ones
    start: jax.Array,  # [batch] int32
    *,
    transposed: bool,  # slots hold keys (slot axis last)
) -> LayerSlots:
    """Writes `new` into layer `layer`, slots [start, start + new_len) of each row, in place
    (under jit, when `slots` is not used afterwards). The caller checks bounds: inside jit an
    out-of-range start would be clamped by dynamic_update_slice."""
    if transposed:
        new = new.swapaxes(-1, -2)
    stacked = not isinstance(slots, tuple | list)
    target = slots if stacked else slots[layer]

    def write_row(row_slots: jax.Array, row_new: jax.Array, row_start: jax.Array) -> jax.Array:
        zero = jnp.int32(0)
        index = (zero, row_start) if transposed else (row_start, zero)
        if stacked:
            index = (jnp.asarray(layer, jnp.int32), zero, *index)
            row_new = row_new[None]
        else:
            index = (zero, *index)
        return jax.lax.dynamic_update_slice(row_slots, row_new.astype(row_slots.dtype), index)

    if jnp.dtype(target.dtype).itemsize == 2 and jnp.issubdtype(target.dtype, jnp.floating):
        # Per-row starts make this a scatter, and XLA's CPU backend computes a bf16/f16 scatter
        # in float32: it converted each layer's whole cache to float32 and back every decoding
        # step. The same bits written as uint16 move no more data than they must.
        bits = jax.lax.bitcast_convert_type
        written = jax.vmap(write_row)(
            bits(target, jnp.uint16), bits(new.astype(target.dtype), jnp.uint16),
            start.astype(jnp.int32),
        )
        written = bits(written, target.dtype)
    else:
        written = jax.vmap(write_row)(target, new, start.astype(jnp.int32))
    if stacked:
        return written
    return (*slots[:layer], written, *slots[layer + 1 :])


def write_valid(
    valid: jax.Array,  # [batch, max_len] bool
    new: jax.Array,  # [batch, new_len] bool
    start: jax.Array,  # [batch] int32
) -> jax.Array:  # [batch, max_len] bool
    """Marks slots [start, start + new_len) of each row real or padding."""
    write_row = lambda row, row_new, row_start: jax.lax.dynamic_update_slice(
        row, row_new, (row_start,)
    )
    return jax.vmap(write_row)(valid, new.astype(bool), start.astype(jnp.int32))


def read_layer(slots: LayerSlots, layer: jax.Array | int) -> jax.Array:  # [batch, ...]
    """One layer's slots: its own buffer, or (stacked) a slice of the stacked array."""
    if isinstance(slots, tuple | list):
        return slots[layer]
    return jax.lax.dynamic_index_in_dim(slots, layer, axis=1, keepdims=False)
