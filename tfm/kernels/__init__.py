"""Platform-specific implementations behind one function per operation, chosen by a registry.

The model (tfm/nn) calls three operations through this module: `attention` (the attention core),
`linear` (every dense projection) and `cache_layout` (how the KV cache stores keys and values).
Each registered backend says which implementation serves each one; None means the reference
maths (tfm.kernels.reference: dot_product_attention, linear; the model-layout cache), which is
the specification every other implementation is tested against. The Pallas kernels (splash,
flex, the fused loss) are imported when first used, so importing the model loads none.

`model.attention_backend="auto"` (the default) resolves per platform (AUTO, in order of
preference): "cpu" on CPU (blocked causal attention, hand-written 16-bit backward passes, CPU
cache layout); on TPU "splash" (Pallas splash attention), or "flex" for position schemes with a
logit bias (tfm.kernels.flex_attention: the bias computed per block in the kernel); on GPU
"cudnn" (cuDNN flash attention), or "flex" (Triton) for those schemes; the reference when none
of them can serve the model (a logit bias it does not take, a dtype, dropout, weights), with
the reason (`auto_choice`). A name picks a backend on any platform it runs on.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import jax

from tfm.checks import ConfigError
from tfm.kernels import cpu_attention, cpu_dense, jax_attention, reference
from tfm.kernels.cache_layouts import REFERENCE, CacheLayout
from tfm.kernels.call import AttentionCall
from tfm.kernels.cpu_cache import CPU_LAYOUT

# Modules that import jax.experimental.pallas: loaded on first use (`_pallas`, `__getattr__`).
PALLAS_MODULES = ("flex_attention", "tpu_attention", "fused_cross_entropy")


def __getattr__(name: str) -> Any:
    """`tfm.kernels.flex_attention` and the other Pallas modules, imported when first named."""
    if name in PALLAS_MODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _pallas(module: str) -> Callable[..., Any]:
    """The `attention` of Pallas module `module`, imported at its first call."""

    def attention(*args: Any) -> Any:
        return importlib.import_module(f"{__name__}.{module}").attention(*args)

    attention.__qualname__ = f"{module}.attention"
    return attention

PLATFORMS = ("cpu", "gpu", "tpu")
# Logit biases of position schemes (tfm.nn.positions.PositionScheme.logit_bias_kind): "fixed"
# (ALiBi: no gradient), "learned" (T5 buckets: their gradient flows through it) or "query"
# (Shaw: computed from the queries and a learned table).
BIAS_KINDS = ("fixed", "learned", "query")


def _no_check(query: jax.Array, bias: jax.Array | None, kv_len: int, platform: str) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class Backend:
    """One attention backend and the implementations it brings.

    attention(query, key, value, call: AttentionCall) -> out (| (out, weights)), the
      reference's values; None = the reference.
    linear: like tfm.kernels.reference.linear; None = the reference.
    cache: the KV cache layout its attention reads with cache_layout=True.
    platforms: where it runs (None: everywhere). weights / dropout: whether its attention can
    return the weights / drop them. biases: the logit-bias kinds (BIAS_KINDS) it takes
    (written out whole, unless bias_by_blocks).
    dtypes: the compute dtypes it takes (None: any). head_dim_multiple / max_head_dim: the
    head sizes it takes. check(query, bias, kv_len, platform) raises ConfigError for inputs it
    cannot take.
    """

    name: str
    description: str
    attention: Callable[..., Any] | None = None
    linear: Callable[..., jax.Array] | None = None
    cache: CacheLayout = REFERENCE
    platforms: tuple[str, ...] | None = None
    weights: bool = False
    dropout: bool = False
    biases: tuple[str, ...] = BIAS_KINDS
    dtypes: tuple[str, ...] | None = None
    head_dim_multiple: int = 1
    max_head_dim: int | None = None
    check: Callable[[jax.Array, jax.Array | None, int, str], None] = _no_check
    # Computes a position scheme's bias per block (no [batch, heads, T, T] bias array): "auto"
    # prefers it for bias schemes, and takes it only for them.
    bias_by_blocks: bool = False


def _jax_nn(implementation: str) -> Callable[..., jax.Array]:
    def attention(query, key, value, call: AttentionCall) -> jax.Array:
        structure, mask, is_causal = call.structure, call.mask, False
        if (structure is not None and structure.causal and structure.window is None
                and structure.query_segments is None and query.shape[1] == key.shape[1]):
            mask, is_causal = None, True  # the kernel's own causal mask, no [T, T] input
        return jax_attention.attention(query, key, value, bias=call.bias, mask=mask,
                                       scale=call.scale, implementation=implementation,
                                       is_causal=is_causal)

    return attention


BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        Backend("reference", "the paper's maths in plain einsums (tfm.kernels.reference)",
                weights=True, dropout=True),
        Backend("cpu", "query blocks, CPU layouts and 16-bit backward passes (tfm.kernels.cpu_*)",
                attention=cpu_attention.attention, linear=cpu_dense.linear, cache=CPU_LAYOUT,
                platforms=("cpu",), weights=True, dropout=True),
        Backend("xla", "jax.nn.dot_product_attention(implementation='xla')",
                attention=_jax_nn("xla")),
        # jax-ml/jax#27184 and #30593: the cuDNN path's bias gradient is missing or batch-1
        # only, so no learned bias goes there until a GPU check shows it right.
        Backend("cudnn", "cuDNN flash attention through jax.nn.dot_product_attention",
                attention=_jax_nn("cudnn"), platforms=("gpu",), biases=("fixed",),
                dtypes=("bfloat16", "float16"), head_dim_multiple=8,
                max_head_dim=jax_attention.CUDNN_MAX_HEAD_DIM, check=jax_attention.check_cudnn),
        Backend("splash", "Pallas splash attention: masks built per block (TPU; interpret mode "
                "on CPU, for tests)", attention=_pallas("tpu_attention"),
                platforms=("tpu", "cpu"), biases=()),
        Backend("flex", "Pallas flash attention with the position scheme's bias and the mask "
                "computed per block (Mosaic on TPU, Triton on GPU; interpret mode on CPU, for "
                "tests)",
                attention=_pallas("flex_attention"), platforms=("tpu", "gpu", "cpu"),
                biases=("fixed", "learned"), bias_by_blocks=True),
    )
}
# What "auto" means on each platform: the first of these that can serve the model.
AUTO = {"cpu": ("cpu",), "tpu": ("splash", "flex"), "gpu": ("cudnn", "flex")}
# Backends that run a Pallas kernel in interpret mode on CPU: correct, slow.
INTERPRETED_ON_CPU = ("splash", "flex")
CHOICES = ("auto", *BACKENDS)


def platform() -> str:
    """The platform being compiled for: that of the mesh set by jax.set_mesh (which need not
    be this host's, when compiling for an accelerator target), else jax's default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    return jax.default_backend() if mesh.empty else mesh.abstract_device.platform


@dataclasses.dataclass(frozen=True)
class Needs:
    """What a model asks of its attention backend (ModelConfig.attention_needs): the weights
    returned (Shaw's value term), dropout on them, a logit bias (None, "fixed" or "learned":
    BIAS_KINDS), a compute dtype and head size (None: any)."""

    needs_weights: bool = False
    needs_dropout: bool = False
    bias: str | None = None
    dtype: str | None = None
    head_dim: int | None = None

    def unmet(self, backend: Backend) -> str | None:
        """Why `backend` cannot serve them, or None."""
        if self.needs_weights and not backend.weights:
            return ("relative_values=True needs the attention weights (Shaw et al.'s value "
                    "term), which it never materialises (or set relative_values=False)")
        if self.needs_dropout and not backend.dropout:
            return "attention_dropout_rate > 0 drops attention weights, which it fuses away"
        if self.bias is not None and self.bias not in backend.biases:
            taken = " or ".join(backend.biases) or "no"
            return f"the position scheme adds a {self.bias} logit bias, and it takes {taken} bias"
        if (self.dtype is not None and backend.dtypes is not None
                and self.dtype not in backend.dtypes):
            return f"dtype={self.dtype!r}, and it takes {' or '.join(backend.dtypes)}"
        head_dim = self.head_dim
        if head_dim is not None and (head_dim % backend.head_dim_multiple or (
                backend.max_head_dim is not None and head_dim > backend.max_head_dim)):
            return (f"head_dim={head_dim}, and it takes multiples of "
                    f"{backend.head_dim_multiple} up to {backend.max_head_dim}")
        return None


def auto_choice(on_platform: str | None = None, **needs: Any) -> tuple[Backend, str | None]:
    """(the backend "auto" picks, and why it is not AUTO[platform]'s first when it is not).
    `needs`: the fields of Needs. `on_platform` defaults to the platform being compiled for."""
    on_platform = on_platform or platform()
    preferred = [BACKENDS[name] for name in AUTO.get(on_platform, ("reference",))]
    if needs.get("bias") is None:
        preferred = [backend for backend in preferred if not backend.bias_by_blocks]
    else:  # a kernel that computes the bias per block before one that reads it written out
        preferred.sort(key=lambda backend: not backend.bias_by_blocks)
    reasons = []
    for backend in preferred:
        reason = Needs(**needs).unmet(backend)
        if reason is None:
            return backend, None
        reasons.append(f"{backend.name!r}: {reason}" if len(preferred) > 1 else reason)
    names = " or ".join(repr(backend.name) for backend in preferred)
    return BACKENDS["reference"], (
        f"attention_backend='auto' uses 'reference' on {on_platform}, not {names}: "
        f"{'; '.join(reasons)}"
    )


def setup_note(name: str, on_platform: str, **needs: Any) -> str | None:
    """The line to log at setup about backend `name` on `on_platform`, or None: why "auto"
    falls back to the reference, or that a Pallas backend runs interpreted (slow) on CPU."""
    if name == "auto":
        backend, note = auto_choice(on_platform, **needs)
        if note is not None:
            return note
        name = backend.name
    if on_platform == "cpu" and name in INTERPRETED_ON_CPU:
        return (f"attention_backend={name!r} runs its Pallas kernel in interpret mode on cpu: "
                "exact but slow, for tests and debugging")
    return None


def resolve(name: str, on_platform: str | None = None, **needs: Any) -> Backend:
    """The backend called `name` (one of CHOICES); "auto" as `auto_choice` says."""
    if name not in CHOICES:
        raise ConfigError(
            f"attention_backend={name!r} is unknown; choose one of: {', '.join(CHOICES)}"
        )
    if name != "auto":
        return BACKENDS[name]
    return auto_choice(on_platform, **needs)[0]


def check_config(name: str, **needs: Any) -> None:
    """ConfigError when a model config asks backend `name` for what it cannot do (`needs`: the
    fields of Needs; "auto" always finds one). Starts no jax backend: configs are checked
    before jax.distributed starts."""
    if name == "auto":
        return
    reason = Needs(**needs).unmet(resolve(name))
    if reason is not None:
        raise ConfigError(f"attention_backend={name!r} cannot serve this model: {reason}; use "
                          "'auto' or 'reference'")


def attention(
    query: jax.Array,  # [batch, q_len, num_heads, head_dim]
    key: jax.Array,  # [batch, kv_len, num_kv_heads, head_dim], or the backend's cache layout
    value: jax.Array,  # likewise
    *,
    backend: str = "reference",
    **options: Any,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`reference.dot_product_attention` by `backend` (one of CHOICES), same values.
    `options`: the fields of AttentionCall (bias, mask, scale, dropout_rate, dropout_rng,
    return_weights, and the kernel hints causal, cache_layout and structure)."""
    call = AttentionCall(**options)
    chosen = resolve(backend, needs_weights=call.return_weights,
                     needs_dropout=call.dropout_rate > 0,
                     bias=None if call.bias is None else "learned",
                     dtype=jax.numpy.dtype(query.dtype).name, head_dim=query.shape[-1])
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
        return reference.dot_product_attention(
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
    """`reference.linear` by `backend` (one of CHOICES), same values."""
    implementation = resolve(backend).linear or reference.linear
    return implementation(x, kernel, num_contracted=num_contracted,
                          compute_dtype=compute_dtype, out_dtype=out_dtype)


def cache_layout(backend: str) -> CacheLayout:
    """The KV cache layout of `backend` (one of CHOICES) on this platform."""
    return resolve(backend).cache
