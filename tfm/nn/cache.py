"""The KV cache: an explicit pytree passed into a model and returned updated, never hidden state.

Every leaf has batch on axis 0, so decoding algorithms can reorder beams with
`jax.tree.map(lambda x: take_beams(x, parents), cache)` without knowing the model.

- `keys`, `values`: per layer one array of slots, as a tuple with one entry per layer (or all
  layers stacked on axis 1: under `scan_layers`, where nn.scan indexes layers with a traced
  index, and where the layout asks for it). Slot i of row b holds the key/value of that row's
  token at position i (RoPE keys are stored already rotated). `layout` (static) says how a
  layer's slots are ordered: the model's own [batch, slots, kv_heads, head_dim] by default, or
  the one the platform's attention kernel reads without copies (tfm/kernels/cpu_cache.py), as
  `tfm.kernels.cache_layout(config.attention_backend, config.cache_layout)` chooses.
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

from tfm import kernels
from tfm.kernels.cache_layouts import REFERENCE, CacheLayout, LayerSlots
from tfm.nn.config import ModelConfig


@struct.dataclass
class DecoderCache:
    keys: LayerSlots  # per layer [batch, ...] in `layout`'s key order, max_len slots
    values: LayerSlots  # per layer, in `layout`'s value order
    lengths: jax.Array  # [batch] int32
    valid: jax.Array | None = None  # [batch, max_len] bool; None = every filled slot is real
    cross_keys: LayerSlots | None = None  # like keys, source_len slots
    cross_values: LayerSlots | None = None  # like values, source_len slots
    source_valid: jax.Array | None = None  # [batch, source_len] bool
    layout: CacheLayout = struct.field(pytree_node=False, default=REFERENCE)

    @property
    def max_len(self) -> int:
        return self.layout.read(self.keys, 0).shape[self.layout.slot_axis(True)]

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def filled_by(self, new_len: int) -> bool:
        """Whether new_len new tokens fill every slot (static): then the cache was empty and
        new token i is slot i, or the call overflows it (NaN logits, tfm.nn.models)."""
        return new_len == self.max_len



@struct.dataclass
class CacheSlot:
    """One attention layer's place in the KV cache: the cache of every layer, which layer's
    slots are its own (`layer`: a python int unrolled, traced under nn.scan) and where its new
    self-attention keys go (`write_index`: [batch] int32; None for cross-attention, written
    from slot 0)."""

    cache: DecoderCache
    layer: jax.Array | int = struct.field(pytree_node=True, default=0)
    write_index: jax.Array | None = None


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
    layout = kernels.cache_layout(config.attention_backend, config.cache_layout)
    stacked = layout.stacked(config.scan_layers, batch_size)

    def empty(is_key: bool, slots: int) -> LayerSlots:
        shape = layout.layer_shape(is_key, batch_size, slots, heads, head_dim)
        if stacked:
            return layout.pinned(jnp.zeros((shape[0], layers, *shape[1:]), dtype))
        return tuple(layout.pinned(jnp.zeros(shape, dtype)) for _ in range(layers))

    cross = {}
    if source_len is not None:
        cross = dict(
            cross_keys=empty(True, source_len),
            cross_values=empty(False, source_len),
            source_valid=jnp.zeros((batch_size, source_len), bool),
        )
    return DecoderCache(
        keys=empty(True, max_len),
        values=empty(False, max_len),
        lengths=jnp.zeros((batch_size,), jnp.int32),
        valid=jnp.ones((batch_size, max_len), bool),
        layout=layout,
        **cross,
    )


def check_cache(
    cache: DecoderCache, config: ModelConfig, has_cross: bool, batch_size: int | None = None
) -> None:
    """Raises a readable error when `cache` was built for another model config, or for another
    batch than `batch_size` rows (the tokens' batch), or its leaves disagree on their sizes."""
    check_rows(cache, batch_size)
    layout = kernels.cache_layout(config.attention_backend, config.cache_layout)
    if cache.layout != layout:
        raise ValueError(
            f"cache has the {cache.layout.name!r} layout but the model (attention_backend="
            f"{config.attention_backend!r}, cache_layout={config.cache_layout!r}) reads the "
            f"{layout.name!r} one here; build it with "
            "tfm.nn.cache.init_cache(config, ...)"
        )
    expected = (
        config.num_decoder_layers,
        config.resolved_num_kv_heads,
        config.resolved_head_dim,
    )
    stacked = not isinstance(cache.keys, tuple | list)
    if stacked and cache.keys.ndim == 5:
        layer_shape = (cache.keys.shape[0], *cache.keys.shape[2:])
        sizes = dict(zip(layout.key_axes, layer_shape, strict=True))
        got = (cache.keys.shape[1], sizes["n"], sizes["h"])
    elif stacked:
        got = cache.keys.shape
    else:
        sizes = dict(zip(layout.key_axes, cache.keys[0].shape, strict=True)) if cache.keys else {}
        got = (len(cache.keys), sizes["n"], sizes["h"]) if cache.keys else (0,)
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


def check_rows(cache: DecoderCache, batch_size: int | None = None) -> None:
    """Raises a readable error when a leaf of `cache` does not hold `batch_size` rows (None:
    cache.batch_size, the lengths' rows) on axis 0, or `valid` not one flag per slot."""
    rows = cache.batch_size if batch_size is None else batch_size
    for path, leaf in jax.tree_util.tree_leaves_with_path(cache):
        if leaf.shape[:1] != (rows,):
            raise ValueError(
                f"cache{jax.tree_util.keystr(path)} has shape {tuple(leaf.shape)}: the cache "
                f"holds {leaf.shape[0] if leaf.ndim else 0} rows but the tokens have {rows}; "
                f"build it for this batch with tfm.nn.cache.init_cache(config, batch_size="
                f"{rows}, max_len=...)"
            )
    if cache.valid is not None and cache.valid.shape[1] != cache.max_len:
        raise ValueError(
            f"cache.valid has shape {tuple(cache.valid.shape)} but the keys hold "
            f"{cache.max_len} slots per row; build the cache with tfm.nn.cache.init_cache "
            "and change its size with tfm.nn.cache.grow"
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
            widths[slot_axis] = (0, extra_slots)
            return cache.layout.pinned(jnp.pad(array, widths))

        if isinstance(slots, tuple | list):
            return tuple(pad_one(array) for array in slots)
        return pad_one(slots)

    if extra_slots < 0:
        raise ValueError(f"extra_slots={extra_slots} must be >= 0")
    valid = cache.valid
    if valid is not None:
        valid = jnp.pad(valid, ((0, 0), (0, extra_slots)), constant_values=True)
    key_axis, value_axis = cache.layout.slot_axis(True), cache.layout.slot_axis(False)
    stacked = not isinstance(cache.keys, tuple | list)
    return cache.replace(  # stacked arrays have the layer axis at 1
        keys=pad(cache.keys, key_axis + (stacked and key_axis > 0)),
        values=pad(cache.values, value_axis + (stacked and value_axis > 0)),
        valid=valid,
    )


def take_beams(
    rows: jax.Array,  # [batch * beam, ...], the beams of each source next to each other
    parents: jax.Array,  # [batch, beam] int, each beam's parent among its source's beams
) -> jax.Array:  # [batch * beam, ...]: row b * beam + j is row b * beam + parents[b, j]
    """Beam search's reorder of one array: each beam takes its parent's row. The parent is
    indexed within its own source's beams (a gather batched over sources), so under a mesh
    that splits the sources over devices each device gathers its own rows; a gather by global
    row index could read any row, and XLA all-gathered the whole array to serve it (every
    layer's cache at every step of a sharded beam search)."""
    batch, beams = parents.shape
    grouped = rows.reshape(batch, beams, *rows.shape[1:])
    taken = jax.vmap(lambda source_rows, picks: source_rows[picks])(grouped, parents)
    return taken.reshape(rows.shape)


def reorder_beams(
    cache: DecoderCache,
    parents: jax.Array,  # [batch, beam] int, each beam's parent among its source's beams
) -> DecoderCache:  # leaves [batch * beam, ...]
    """Each beam's row takes its parent's (`take_beams`): the self-attention slots, lengths and
    `valid` move; the cross-attention slots and `source_valid` stay, because beam search only
    moves a row among the beams of its own source, which hold the same cross-attention entries.
    Gathering those too (what a generic pytree gather does) copied the encoder's keys and
    values of every layer at every step."""
    take = lambda array: take_beams(array, parents)
    take_slots = lambda array: cache.layout.pinned(take(array))  # stored as the writes store it
    slots = lambda s: tuple(map(take_slots, s)) if isinstance(s, tuple | list) else take_slots(s)
    return cache.replace(
        keys=slots(cache.keys), values=slots(cache.values), lengths=take(cache.lengths),
        valid=None if cache.valid is None else take(cache.valid),
    )


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
