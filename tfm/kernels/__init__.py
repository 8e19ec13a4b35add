"""Platform-specific implementations behind one function per operation, chosen by a registry.

The model (tfm/nn) calls three operations through this module: `attention` (the attention core),
`linear` (every dense projection) and `cache_layout` (how the KV cache stores keys and values).
Each registered backend says which implementation serves each one; None means the reference
maths in tfm/nn (attention.dot_product_attention, dense.linear, the model-layout cache), which
is the specification every other implementation is tested against.

`model.attention_backend="auto"` (the default) resolves per platform: "cpu" on CPU (blocked
causal attention, hand-written 16-bit backward passes, CPU cache layout), "reference" on GPU
and TPU. A name picks a backend on any platform it runs on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from tfm.checks import ConfigError
from tfm.kernels import cpu_attention, cpu_dense, jax_attention
from tfm.kernels.cache_layouts import REFERENCE, CacheLayout
from tfm.kernels.call import AttentionCall
from tfm.kernels.cpu_cache import CPU_LAYOUT
from tfm.nn import attention as reference_attention
from tfm.nn import dense

PLATFORMS = ("cpu", "gpu", "tpu")


def _no_check(query: jax.Array, bias: jax.Array | None, kv_len: int, platform: str) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Backend:
    """One attention backend and the implementations it brings.

    attention(query, key, value, call: AttentionCall) -> out (| (out, weights)), the
      reference's values; None = the reference.
    linear: like tfm.nn.dense.linear; None = the reference.
    cache: the KV cache layout its attention reads with cache_layout=True.
    platforms: where it runs (None: everywhere). weights / dropout: whether its attention can
    return the weights / drop them. check(query, bias, kv_len, platform) raises ConfigError for
    inputs it cannot take.
    """

    name: str
    description: str
    attention: Callable[..., Any] | None = None
    linear: Callable[..., jax.Array] | None = None
    cache: CacheLayout = REFERENCE
    platforms: tuple[str, ...] | None = None
    weights: bool = False
    dropout: bool = False
    check: Callable[[jax.Array, jax.Array | None, int, str], None] = _no_check


def _jax_nn(implementation: str) -> Callable[..., jax.Array]:
    def attention(query, key, value, call: AttentionCall) -> jax.Array:
        return jax_attention.attention(query, key, value, bias=call.bias, mask=call.mask,
                                       scale=call.scale, implementation=implementation)

    return attention


BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        Backend("reference", "the paper's maths in plain einsums (tfm.nn.attention)",
                weights=True, dropout=True),
        Backend("cpu", "query blocks, CPU layouts and 16-bit backward passes (tfm.kernels.cpu_*)",
                attention=cpu_attention.attention, linear=cpu_dense.linear, cache=CPU_LAYOUT,
                platforms=("cpu",), weights=True, dropout=True),
        Backend("xla", "jax.nn.dot_product_attention(implementation='xla')",
                attention=_jax_nn("xla")),
        Backend("cudnn", "cuDNN flash attention through jax.nn.dot_product_attention",
                attention=_jax_nn("cudnn"), platforms=("gpu",),
                check=jax_attention.check_cudnn),
    )
}
# What "auto" means on each platform (others: "reference").
AUTO = {"cpu": "cpu"}
CHOICES = ("auto", *BACKENDS)


def platform() -> str:
    """The platform jax runs on by default: "cpu", "gpu" or "tpu"."""
    return jax.default_backend()


def resolve(
    name: str,
    on_platform: str | None = None,
    *,
    needs_weights: bool = False,
    needs_dropout: bool = False,
) -> Backend:
    """The backend called `name` (one of CHOICES). "auto" picks AUTO[platform], or the reference
    when that one cannot return weights or apply dropout as asked. `on_platform` defaults to
    jax's default backend; pass the target's when compiling for another one."""
    if name not in CHOICES:
        raise ConfigError(
            f"attention_backend={name!r} is unknown; choose one of: {', '.join(CHOICES)}"
        )
    if name != "auto":
        return BACKENDS[name]
    backend = BACKENDS[AUTO.get(on_platform or platform(), "reference")]
    if (needs_weights and not backend.weights) or (needs_dropout and not backend.dropout):
        return BACKENDS["reference"]
    return backend


def check_config(name: str, *, needs_weights: bool, needs_dropout: bool) -> None:
    """ConfigError when a model config asks backend `name` for what it cannot do ("auto" always
    finds one). Starts no jax backend: configs are checked before jax.distributed starts."""
    if name == "auto":
        return
    backend = resolve(name)
    if needs_dropout and not backend.dropout:
        raise ConfigError(
            f"attention_dropout_rate > 0 needs attention_backend='auto', 'reference' or 'cpu' "
            f"(attention_backend={name!r} fuses the weights away: no dropout on them)"
        )
    if needs_weights and not backend.weights:
        raise ConfigError(
            f"position_scheme='relative' with relative_values=True needs the attention weights "
            f"(Shaw et al.'s value term), which attention_backend={name!r} never materialises: "
            "use 'auto', 'reference' or 'cpu', or set relative_values=False"
        )


def attention(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim], or the backend's cache layout
    value: jax.Array,  # likewise
    *,
    backend: str = "reference",
    **options: Any,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`tfm.nn.attention.dot_product_attention` by `backend` (one of CHOICES), same values.
    `options`: the fields of AttentionCall (bias, mask, scale, dropout_rate, dropout_rng,
    return_weights, and the kernel hints causal and cache_layout)."""
    call = AttentionCall(**options)
    chosen = resolve(backend, needs_weights=call.return_weights,
                     needs_dropout=call.dropout_rate > 0)
    if call.return_weights and not chosen.weights:
        raise ConfigError(f"attention_backend={backend!r} cannot return attention weights "
                          "(fused kernels never materialise them); use 'reference'")
    if call.dropout_rate > 0 and not chosen.dropout:
        raise ConfigError(f"attention_backend={backend!r} has no attention dropout "
                          f"(dropout_rate={call.dropout_rate}); use 'reference'")
    kv_len = key.shape[chosen.cache.slot_axis(True)] if call.cache_layout else key.shape[1]
    chosen.check(query, call.bias, kv_len, platform())
    if chosen.platforms is not None and platform() not in chosen.platforms:
        raise ConfigError(f"attention_backend={backend!r} runs on {', '.join(chosen.platforms)}, "
                          f"not on {platform()!r}; use 'auto'")
    if chosen.attention is None:
        return reference_attention.dot_product_attention(
            query, key, value, **call.spec_options())
    return chosen.attention(query, key, value, call)


def linear(
    x: jax.Array,  # [..., *in_dims]
    kernel: jax.Array,  # [*in_dims, *out_dims]
    *,
    backend: str = "reference",
    num_contracted: int = 1,
    compute_dtype: Any = None,
    out_dtype: Any = None,
) -> jax.Array:  # [..., *out_dims]
    """`tfm.nn.dense.linear` by `backend` (one of CHOICES), same values."""
    implementation = resolve(backend).linear or dense.linear
    return implementation(x, kernel, num_contracted=num_contracted,
                          compute_dtype=compute_dtype, out_dtype=out_dtype)


def cache_layout(backend: str) -> CacheLayout:
    """The KV cache layout of `backend` (one of CHOICES) on this platform."""
    return resolve(backend).cache
