"""Attention through `jax.nn.dot_product_attention`: implementation "xla" (any platform) and
"cudnn" (cuDNN flash attention, NVIDIA GPUs). Same values as the reference maths
(tfm.nn.attention), without attention dropout or returned weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from tfm.checks import ConfigError
from tfm.kernels.reference import check_inputs, default_scale

CUDNN_DTYPES = (jnp.bfloat16, jnp.float16)
CUDNN_MAX_HEAD_DIM = 256  # Hopper and later; jax itself refuses > 128 on older GPUs.


def check_cudnn(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    bias: jax.Array | None,  # [b|1, h|1, q_len, kv_len]
    kv_len: int,
    platform: str,
) -> None:
    """ConfigError when cuDNN flash attention cannot take these inputs."""
    if query.dtype not in CUDNN_DTYPES:
        raise ConfigError(
            f"attention_backend='cudnn' needs bfloat16 or float16 inputs (cuDNN flash attention), "
            f"got {query.dtype}; set dtype='bfloat16' or use attention_backend='xla'"
        )
    head_dim = query.shape[-1]
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        raise ConfigError(
            f"attention_backend='cudnn' needs head_dim a multiple of 8 and "
            f"<= {CUDNN_MAX_HEAD_DIM}, got {head_dim}; use attention_backend='xla'"
        )
    if bias is not None and tuple(bias.shape[2:]) != (query.shape[1], kv_len):
        raise ConfigError(
            f"attention_backend='cudnn' needs bias of shape [1|batch, 1|num_heads, q_len, kv_len] "
            f"(no broadcasting over lengths), got {tuple(bias.shape)}; use attention_backend='xla'"
        )
    if platform != "gpu":
        raise ConfigError(
            f"attention_backend='cudnn' needs a GPU, but the platform is {platform!r}; use "
            "attention_backend='auto', 'xla' or 'reference'"
        )


def attention(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim]
    value: jax.Array,  # like key
    *,
    bias: jax.Array | None = None,  # broadcastable to [batch, num_heads, q_len, kv_len]
    mask: jax.Array | None = None,  # bool, likewise
    scale: float | None = None,
    implementation: str = "xla",  # or "cudnn"
    is_causal: bool = False,  # query i attends keys <= i (q_len == kv_len), besides `mask`
) -> jax.Array:  # [batch, q_len, num_heads, head_dim]
    """softmax(Q K^T * scale + bias) V by `jax.nn.dot_product_attention`; a query whose keys are
    all masked gets a zero output, as in the reference."""
    query, key, value, bias, mask = check_inputs(query, key, value, bias, mask, 0.0, None)
    q_len, kv_len = query.shape[1], key.shape[1]
    if implementation == "cudnn":
        # jax folds the mask into a bias in the query dtype, and cuDNN wants full
        # [q_len, kv_len] bias dims. A bias gradient needs bias shape [1, num_heads, ...].
        if mask is not None:
            mask = jnp.broadcast_to(mask, mask.shape[:2] + (q_len, kv_len))
        if bias is not None:
            bias = bias.astype(query.dtype)
    scale = default_scale(query.shape[-1]) if scale is None else scale
    out = jax.nn.dot_product_attention(
        query, key, value, bias=bias, mask=mask, scale=scale, implementation=implementation,
        is_causal=is_causal,
    )
    if mask is None:
        return out
    attends = jnp.any(mask, axis=-1).transpose(0, 2, 1)[..., None]  # [batch, q_len, 1|h, 1]
    return jnp.where(attends, out, jnp.zeros((), out.dtype))
