"""What `tfm.kernels.attention` hands every attention implementation besides query, key and
value: one frozen value, so the options are written once."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax


@functools.partial(jax.tree_util.register_dataclass, meta_fields=("function", "learned"),
                   data_fields=("params", "query_positions", "key_positions"))
@dataclasses.dataclass(frozen=True)
class BlockBias:
    """A position scheme's logit bias in the form a fused kernel evaluates per block
    (tfm.nn.positions.BlockBiasFn): bias[b, h, i, j] = function(params' row h,
    query_positions[b, i:i+1, None], key_positions[b, None, j:j+1]).

    params: pytree of [num_heads, P] float arrays; query_positions: [batch, q_len] int32;
    key_positions: [batch, kv_len] int32. learned: whether params take a gradient (T5's
    table; not ALiBi's fixed slopes).
    """

    function: Callable[..., jax.Array]
    params: Any
    query_positions: jax.Array
    key_positions: jax.Array
    learned: bool = False


@functools.partial(jax.tree_util.register_dataclass, meta_fields=("causal", "window"),
                   data_fields=("query_segments", "key_segments", "bias"))
@dataclasses.dataclass(frozen=True)
class AttentionStructure:
    """The attention mask, and a position scheme's logit bias, described by their parts, for
    kernels that build them per block instead of reading a dense [batch, 1, q_len, kv_len] mask
    or [batch, heads, q_len, kv_len] bias (splash and flex attention, cuDNN).

    Query i attends key j iff query_segments[b, i] == key_segments[b, j], and j <= i when
    causal, and |i - j| <= window when window is set (indices, so the caller promises that
    positions advance by one per token within a segment). None segments: one segment.
    The description must equal the dense mask at every real query; outputs at padding queries
    (those that share a segment id with padding keys) are unspecified, as no loss reads them.

    query_segments: [batch, q_len] int32; key_segments: [batch, kv_len] int32. bias: the same
    values as the call's dense bias, by blocks (None: no bias, or only the dense one). A pytree
    (arrays are its leaves), so it travels through nn.scan with the layers' shared inputs.
    """

    causal: bool = False
    window: int | None = None
    query_segments: jax.Array | None = None
    key_segments: jax.Array | None = None
    bias: BlockBias | None = None


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """The options of one attention call (tfm.nn.attention.dot_product_attention's, plus hints
    for kernels).

    bias (float) and mask (bool, True = attend): broadcastable to [batch, num_heads, q_len,
    kv_len]. scale: None = 1 / sqrt(head_dim). dropout_rate > 0 needs dropout_rng.
    causal: the caller promises query i attends to no key after i (the mask still says so), so
    a kernel may skip that work. cache_layout: key and value come in the backend's KV cache
    layout (`tfm.kernels.cache_layout(backend)`), not [batch, kv_len, kv_heads, head_dim].
    structure: the mask's parts (AttentionStructure), or None when only the dense mask says it.
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
