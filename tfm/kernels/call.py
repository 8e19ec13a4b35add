"""What `tfm.kernels.attention` hands every attention implementation besides query, key and
value: one frozen value, so the options are written once."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class AttentionCall:
    """The options of one attention call (tfm.nn.attention.dot_product_attention's, plus two
    hints for kernels).

    bias (float) and mask (bool, True = attend): broadcastable to [batch, num_heads, q_len,
    kv_len]. scale: None = 1 / sqrt(head_dim). dropout_rate > 0 needs dropout_rng.
    causal: the caller promises query i attends to no key after i (the mask still says so), so
    a kernel may skip that work. cache_layout: key and value come in the backend's KV cache
    layout (`tfm.kernels.cache_layout(backend)`), not [batch, kv_len, kv_heads, head_dim].
    """

    bias: jax.Array | None = None
    mask: jax.Array | None = None
    scale: float | None = None
    dropout_rate: float = 0.0
    dropout_rng: jax.Array | None = None
    return_weights: bool = False
    causal: bool = False
    cache_layout: bool = False

    def spec_options(self) -> dict:
        """The keyword arguments of tfm.nn.attention.dot_product_attention (the reference)."""
        return dict(bias=self.bias, mask=self.mask, scale=self.scale,
                    dropout_rate=self.dropout_rate, dropout_rng=self.dropout_rng,
                    return_weights=self.return_weights)
