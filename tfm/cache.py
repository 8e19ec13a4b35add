"""The KV cache: an explicit pytree passed into a model and returned updated, never hidden state.

Layout (every leaf has batch on axis 0, so decoding algorithms can reorder beams with
`jax.tree.map(lambda x: x[indices], cache)` without knowing the model):

- `keys`: [batch, num_layers, num_kv_heads, head_dim, max_len] and `values`: [batch, num_layers,
  num_kv_heads, max_len, head_dim]. Slot i of row b holds the key/value of that row's token at
  position i (RoPE keys are stored already rotated). These are the layouts the decode step's two
  attention matmuls (q . K and weights . V) read as they are, so no step transposes the cache.
  Each layer writes its new tokens in place (`write_layer`); no step copies the whole cache.
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

from tfm.config import ModelConfig


@struct.dataclass
class DecoderCache:
    keys: jax.Array  # [batch, num_layers, num_kv_heads, head_dim, max_len]
    values: jax.Array  # [batch, num_layers, num_kv_heads, max_len, head_dim]
    lengths: jax.Array  # [batch] int32
    valid: jax.Array | None = None  # [batch, max_len] bool; None = every filled slot is real
    cross_keys: jax.Array | None = None  # [batch, num_layers, num_kv_heads, head_dim, source_len]
    cross_values: jax.Array | None = None
    source_valid: jax.Array | None = None  # [batch, source_len] bool

    @property
    def max_len(self) -> int:
        return self.keys.shape[4]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[0]


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
    def shapes(slots: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        heads = (batch_size, config.num_decoder_layers, config.resolved_num_kv_heads)
        head_dim = config.resolved_head_dim
        return (*heads, head_dim, slots), (*heads, slots, head_dim)

    key_shape, value_shape = shapes(max_len)
    cross = {}
    if source_len is not None:
        cross_key_shape, cross_value_shape = shapes(source_len)
        cross = dict(
            cross_keys=jnp.zeros(cross_key_shape, dtype),
            cross_values=jnp.zeros(cross_value_shape, dtype),
            source_valid=jnp.zeros((batch_size, source_len), bool),
        )
    return DecoderCache(
        keys=jnp.zeros(key_shape, dtype),
        values=jnp.zeros(value_shape, dtype),
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
    got = (cache.keys.shape[1], cache.keys.shape[2], cache.keys.shape[3])
    if cache.keys.ndim != 5 or got != expected:
        raise ValueError(
            "cache was built for another model config: (num_decoder_layers, num_kv_heads, "
            f"head_dim) is {got} in the cache but {expected} in the model config; "
            "build it with tfm.cache.init_cache(config, ...)"
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


def write_layer(
    slots: jax.Array,  # keys [batch, layers, kv_heads, head_dim, slots] or values [.., slots, hd]
    new: jax.Array,  # [batch, kv_heads, new_len, head_dim]
    layer: jax.Array | int,
    start: jax.Array,  # [batch] int32
    *,
    transposed: bool,  # slots hold keys (slot axis last)
) -> jax.Array:
    """Writes `new` into layer `layer`, slots [start, start + new_len) of each row, in place
    (under jit, when `slots` is not used afterwards). The caller checks bounds: inside jit an
    out-of-range start would be clamped by dynamic_update_slice."""
    if transposed:
        new = new.swapaxes(-1, -2)

    def write_row(row_slots: jax.Array, row_new: jax.Array, row_start: jax.Array) -> jax.Array:
        zero = jnp.int32(0)
        index = (jnp.asarray(layer, jnp.int32), zero) + (
            (zero, row_start) if transposed else (row_start, zero)
        )
        return jax.lax.dynamic_update_slice(row_slots, row_new[None].astype(row_slots.dtype), index)

    return jax.vmap(write_row)(slots, new, start.astype(jnp.int32))


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


def read_layer(
    slots: jax.Array,  # [batch, num_layers, ...]
    layer: jax.Array | int,
) -> jax.Array:  # [batch, ...]
    """One layer's slots."""
    return jax.lax.dynamic_index_in_dim(slots, layer, axis=1, keepdims=False)
