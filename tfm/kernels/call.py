"""What `tfm.kernels.attention` hands every attention implementation besides query, key and
value: one frozen value, so the options are written once."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax


@functools.partial(jax.tree_util.register_dataclass, meta_fields=("function", "learned", "dense"),
                   data_fields=("params", "query_positions", "key_positions"))
@dataclasses.dataclass(frozen=True)
class BlockBias:
    """A position scheme's logit bias by its parts, in the form a fused kernel evaluates per
    block (tfm.nn.positions.BlockBiasFn): bias[b, h, i, j] = function(params' row h,
    query_positions[b, i:i+1, None], key_positions[b, None, j:j+1]).

    params: pytree of [num_heads, P] float arrays; query_positions: [batch, q_len] int32;
    key_positions: [batch, kv_len] int32. learned: whether params take a gradient (T5's
    table; not ALiBi's fixed slopes). dense: the same values over whole rows,
    dense(params, query_positions, key_positions) -> [batch, heads, q_len, kv_len], for kernels
    that add a dense bias (None: `function` evaluated on whole rows, tfm.kernels.masks).
    """

    function: Callable[..., jax.Array]
    params: Any
    query_positions: jax.Array
    key_positions: jax.Array
    learned: bool = False
    dense: Callable[..., jax.Array] | None = None


@functools.partial(jax.tree_util.register_dataclass, meta_fields=("function",),
                   data_fields=("params", "query_positions", "key_positions"))
@dataclasses.dataclass(frozen=True)
class RelativeBias:
    """A logit bias computed from the queries (Shaw et al. 2018's relative keys), by its parts:
    bias = function(query [batch, q_len, heads, head_dim], params, query_positions
    [batch, q_len], key_positions [batch, kv_len], scale) -> [batch, heads, q_len, kv_len].
    Only kernels that write the bias out take it (Backend.biases "query")."""

    function: Callable[..., jax.Array]
    params: Any
    query_positions: jax.Array
    key_positions: jax.Array


@functools.partial(jax.tree_util.register_dataclass, meta_fields=("function",),
                   data_fields=("params", "query_positions", "key_positions"))
@dataclasses.dataclass(frozen=True)
class RelativeValue:
    """A term added to attention's output from its weights (Shaw et al. 2018's relative values),
    by its parts, so a context-parallel kernel can evaluate it on its own chunk's queries
    against the gathered keys: term = function(weights [batch, heads, q_len, kv_len], params,
    query_positions [batch, q_len], key_positions [batch, kv_len]) -> [batch, q_len, heads,
    head_dim]. Called with the weights, it evaluates on its own positions."""

    function: Callable[..., jax.Array]
    params: Any
    query_positions: jax.Array
    key_positions: jax.Array

    def __call__(self, weights: jax.Array) -> jax.Array:  # [batch, heads, q_len, kv_len]
        return self.function(weights, self.params, self.query_positions, self.key_positions)


@functools.partial(
    jax.tree_util.register_dataclass, meta_fields=("causal", "window", "segments_mark_padding"),
    data_fields=("query_segments", "key_segments", "bias", "key_valid", "query_offset",
                 "query_positions", "key_positions", "relative"))
@dataclasses.dataclass(frozen=True)
class AttentionStructure:
    """The attention mask, and the position scheme's logit bias, described by their parts: the
    one form in which the model hands them to `tfm.kernels.attention`. Fused kernels (splash,
    flex) build them per block; kernels that read a dense [batch, 1, q_len, kv_len] mask and
    [batch, heads, q_len, kv_len] bias make those from it (tfm.kernels.masks.dense_mask,
    dense_bias).

    Query i attends key j iff all of:
    - causal: j <= i + query_offset[b] (indices; query_offset: [batch] int32, the KV cache slot
      of the first query, None = 0);
    - window: |p_i - p_j| <= window, p = query_positions [batch, q_len] and key_positions
      [batch, kv_len] int32 (None: the indices, so the caller promises that positions advance
      by one per token within a segment);
    - key_valid[b, j] ([batch, kv_len] bool: padding, a KV cache's filled and valid slots;
      None: every key);
    - query_segments[b, i] == key_segments[b, j] ([batch, q_len], [batch, kv_len] int32;
      None: one segment).
    bias: the position scheme's logit bias (BlockBias), relative: a bias from the queries
    (RelativeBias); None: none. A pytree (arrays are its leaves; causal and window static), so
    it travels through nn.scan with the layers' shared inputs.

    segments_mark_padding: key_valid is key_segments > 0 and the query segments are the key
    segments (self-attention over packed rows, id 0 = padding). A blocked kernel may then
    compare the ids as they are: a padding key's segment 0 is shared only by padding queries,
    whose outputs no real query reads, so every real query's value is unchanged.
    """

    causal: bool = False
    window: int | None = None
    query_segments: jax.Array | None = None
    key_segments: jax.Array | None = None
    bias: BlockBias | None = None
    key_valid: jax.Array | None = None
    query_offset: jax.Array | None = None
    query_positions: jax.Array | None = None
    key_positions: jax.Array | None = None
    relative: RelativeBias | None = None
    segments_mark_padding: bool = False

    def replace(self, **changes: Any) -> AttentionStructure:
        return dataclasses.replace(self, **changes)

    @property
    def by_index(self) -> bool:
        """Whether the mask compares indices only (no offset, window positions or relative
        bias): the form a blocked kernel builds per block."""
        return (self.query_offset is None and self.query_positions is None
                and self.relative is None)


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """The options of one attention call (tfm.nn.attention.dot_product_attention's, plus hints
    for kernels).

    structure: the mask and logit bias by their parts (AttentionStructure), the form the model
    passes; a kernel that reads a dense mask or bias makes it from this (tfm.kernels.masks).
    bias (float) and mask (bool, True = attend): the dense forms, broadcastable to [batch,
    num_heads, q_len, kv_len], for callers that hold them (kernel tests, benchmarks); either
    one given replaces what the structure says of it in dense kernels. scale: None = 1 /
    sqrt(head_dim). dropout_rate > 0 needs dropout_rng. causal: the caller promises query i
    attends to no key after i (the mask still says so), so a kernel may skip that work (a
    structure that is causal by index says it too). cache_layout: key and value come in the
    backend's own KV cache layout (`Backend.cache`, the one `tfm.kernels.cache_layout(backend,
    "auto")` gives on its cache_platforms), not [batch, kv_len, kv_heads, head_dim].
    """

    bias: jax.Array | None = None
    mask: jax.Array | None = None
    scale: float | None = None
    dropout_rate: float = 0.0
    dropout_rng: jax.Array | None = None
    return_weights: bool = False
    causal: bool = False
    cache_layout: bool = False
    structure: AttentionStructure | None = None

    def spec_options(self) -> dict:
        """The keyword arguments of tfm.nn.attention.dot_product_attention (the reference)."""
        return dict(bias=self.bias, mask=self.mask, scale=self.scale,
                    dropout_rate=self.dropout_rate, dropout_rng=self.dropout_rng,
                    return_weights=self.return_weights)
