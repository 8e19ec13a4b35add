"""Platform-specific implementations behind one function per operation, chosen by registries.

The model (tfm/nn) makes three separate choices, each a ModelConfig field:
- `attention_backend` (BACKENDS): the attention core (`attention`);
- `matmul` (MATMULS): the implementation of every dense projection (`linear`, `projections`);
- `cache_layout` (CACHE_LAYOUTS): how the KV cache stores keys and values (`cache_layout`).
An attention backend belongs to a platform profile that names the matmul and cache layout
measured with it (Backend.matmul, Backend.cache): "auto" for `matmul` and `cache_layout` takes
those. The reference maths (tfm.kernels.reference: dot_product_attention, linear; the
model-layout cache) is the specification every other implementation is tested against. Other
platform choices live here too (`swap_halves`, `tied_output_kernel`, `ffn_activation_dtype`,
`loss_backend_for`). The Pallas kernels (splash, flex, the fused loss) are imported when first
used, so importing the model loads none.

The model hands attention its mask and position bias in one form, by their parts
(tfm.kernels.call.AttentionStructure); splash and flex build them per block, and the kernels
that read a dense mask or bias write it out from that (tfm.kernels.masks).

`model.attention_backend="auto"` (the default) resolves per platform (AUTO, in order of
preference): "cpu" on CPU (blocked causal attention, hand-written 16-bit backward passes; its
profile: the "cpu" matmul and cache layout); on TPU "splash" (Pallas splash attention), or
"flex" for position schemes with a logit bias (tfm.kernels.flex_attention: the bias computed
per block in the kernel); on GPU "cudnn" (cuDNN flash attention), or "flex" (Triton) for
those schemes; the reference when none of them can serve the model (a logit bias it does not
take, a dtype, dropout, weights), with the reason (`auto_choice`). A name picks a backend on
any platform it runs on.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from tfm.checks import ConfigError
from tfm.kernels import cpu_attention, cpu_dense, jax_attention, masks, per_device, reference
from tfm.kernels.cache_layouts import REFERENCE, CacheLayout
from tfm.kernels.call import AttentionCall
from tfm.kernels.cpu_cache import CPU_LAYOUT
from tfm.kernels.tpu_cache import TPU_LAYOUT

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
    matmul: the matmul implementation (a MATMULS name) of its platform profile, which
      model.matmul="auto" takes (None: its platform's, PLATFORM_MATMUL). cache: the KV cache
      layout its attention reads with cache_layout=True, which model.cache_layout="auto" takes
      on cache_platforms (None: everywhere; elsewhere the reference layout).
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
    matmul: str | None = None
    cache: CacheLayout = REFERENCE
    cache_platforms: tuple[str, ...] | None = None
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
    # Pads queries and keys to whole blocks of this many tokens (None: no padding); "auto"
    # takes the reference for rows that fit in one block (`within_one_block`).
    row_block: int | None = None


def _jax_nn(implementation: str) -> Callable[..., jax.Array]:
    def attention(query, key, value, call: AttentionCall) -> jax.Array:
        structure, is_causal = call.structure, False
        if (call.mask is None and masks.causal_by_index(structure, query.shape[1], key.shape[1])
                and structure.window is None and structure.key_valid is None
                and structure.query_segments is None):
            structure, is_causal = structure.replace(causal=False), True  # the kernel's own
        call = masks.dense_call(dataclasses.replace(call, structure=structure), query,
                                key.shape[1])
        return jax_attention.attention(query, key, value, bias=call.bias, mask=call.mask,
                                       scale=call.scale, implementation=implementation,
                                       is_causal=is_causal)

    return attention


BACKENDS: dict[str, Backend] = {
    backend.name: backend
    for backend in (
        Backend("reference", "the paper's maths in plain einsums (tfm.kernels.reference)",
                cache=TPU_LAYOUT, cache_platforms=("tpu",), weights=True, dropout=True),
        Backend("cpu", "query blocks, CPU layouts and 16-bit backward passes (tfm.kernels.cpu_*)",
                attention=cpu_attention.attention, matmul="cpu", cache=CPU_LAYOUT,
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
                cache=TPU_LAYOUT, cache_platforms=("tpu",), platforms=("tpu", "cpu"),
                biases=(), row_block=per_device.LANES),
        Backend("flex", "Pallas flash attention with the position scheme's bias and the mask "
                "computed per block (Mosaic on TPU, Triton on GPU; interpret mode on CPU, for "
                "tests)",
                attention=_pallas("flex_attention"), cache=TPU_LAYOUT, cache_platforms=("tpu",),
                platforms=("tpu", "gpu", "cpu"),
                biases=("fixed", "learned"), bias_by_blocks=True,
                row_block=per_device.LANES),
    )
}
# What "auto" means on each platform: the first of these that can serve the model.
AUTO = {"cpu": ("cpu",), "tpu": ("splash", "flex"), "gpu": ("cudnn", "flex")}
# Backends that run a Pallas kernel in interpret mode on CPU: correct, slow.
INTERPRETED_ON_CPU = ("splash", "flex")
CHOICES = ("auto", *BACKENDS)


@dataclasses.dataclass(frozen=True)
class Matmul:
    """One implementation of `linear` (every dense projection), like reference.linear.
    fuses_projections: several projections of one input (query, key, value) run as one matmul
    over their concatenated kernels (`projections`): faster on CPU, less memory on GPU.
    min_fused_rows: with fuses_projections, only inputs of at least this many rows (tokens) per
    input feature are joined (0: all). The join copies the kernels: a decoding step's few rows
    do not pay for it, and XLA hoists the copy out of the decoding loop, where it stays live.
    fuses_forward_only: joins them (as fuses_projections) only in forward-only calls (a
    prefill, an evaluation: `projections(forward_only=True)`), keeping one matmul per kernel
    where a backward pass follows.
    max_fused_len: only inputs whose rows (the axis before the contracted ones: a prompt's
    tokens) are at most this long are joined (0: any length)."""

    name: str
    description: str
    linear: Callable[..., jax.Array]
    fuses_projections: bool = False
    min_fused_rows: float = 0
    fuses_forward_only: bool = False
    max_fused_len: int = 0


MATMULS: dict[str, Matmul] = {
    matmul.name: matmul
    for matmul in (
        Matmul("reference", "one jax.lax.dot_general (tfm.kernels.reference.linear)",
               reference.linear),
        Matmul("cpu", "2-D matmuls with 16-bit backward passes (tfm.kernels.cpu_dense)",
               cpu_dense.linear, fuses_projections=True),
        Matmul("fused", "the reference's matmul, one per input: the query, key and value "
               "projections of one input as one matmul over their concatenated kernels",
               reference.linear, fuses_projections=True, min_fused_rows=1),
        Matmul("forward_fused", "the reference's matmul; the query, key and value projections "
               "of one input as one matmul in forward-only calls (prefill, evaluation) of rows "
               "up to 1,024 tokens, three in training and for longer rows", reference.linear,
               min_fused_rows=1, fuses_forward_only=True, max_fused_len=1024),
    )
}
# model.matmul: "auto" = the attention backend's platform profile's (Backend.matmul), or for a
# backend that names none, its platform's: on GPU one matmul per input's projections (GPT-2
# medium's compiled h100-8 step: 11.79 GB per GPU against 12.65 GB with three); on TPU joined
# only where no backward pass follows (in training three move fewer bytes for GPT-2: medium's
# v5e-8 step 112.96 GB against 118.92 GB joined) and for rows of at most 1,024 tokens (a
# joined prefill of 512-token prompts keeps less alive in the decoding loop: medium's v5p-8
# loop 4.50 GB against 5.15; of 4,096-token prompts more: RoPE 8k's 1.13 GB against 1.02),
# elsewhere the reference.
PLATFORM_MATMUL = {"gpu": "fused", "tpu": "forward_fused"}
MATMUL_CHOICES = ("auto", *MATMULS)
# model.cache_layout: "auto" = the layout the attention backend reads (Backend.cache); the
# reference layout is read by every backend, the others only by their own.
CACHE_LAYOUTS: dict[str, CacheLayout] = {
    "reference": REFERENCE, "cpu": CPU_LAYOUT, "tpu": TPU_LAYOUT}
CACHE_LAYOUT_CHOICES = ("auto", *CACHE_LAYOUTS)


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


def within_one_block(backend: Backend, q_len: int, kv_len: int) -> bool:
    """Whether queries and keys both fit in one of `backend`'s row blocks, where "auto" takes
    the reference maths instead: flash attention tiles rows so that no [q_len, kv_len] scores
    are written, and within one block there is nothing to tile, while the kernel pads the rows
    to the block (64-token rows to 128: twice the queries, keys, values and outputs) and the
    reference's scores are at most one block per head. The paper's base model, 64-token rows
    on v5e-8: 48.39 GB per chip per step against 54.11 GB by splash (docs/gpu-tpu.md)."""
    block = backend.row_block
    return block is not None and q_len <= block and kv_len <= block


def auto_choice(on_platform: str | None = None, longest_row: int | None = None,
                **needs: Any) -> tuple[Backend, str | None]:
    """(the backend "auto" picks, and why it is not AUTO[platform]'s first when it is not).
    `needs`: the fields of Needs. `on_platform` defaults to the platform being compiled for.
    longest_row: the longest row (tokens) the model attends over, when known: a kernel whose
    block holds it gives way to the reference (`within_one_block`)."""
    on_platform = on_platform or platform()
    preferred = [BACKENDS[name] for name in AUTO.get(on_platform, ("reference",))]
    if needs.get("bias") is None:
        preferred = [backend for backend in preferred if not backend.bias_by_blocks]
    else:  # a kernel that computes the bias per block before one that reads it written out
        preferred.sort(key=lambda backend: not backend.bias_by_blocks)
    reasons = []
    for backend in preferred:
        reason = Needs(**needs).unmet(backend)
        if reason is None and longest_row is not None and within_one_block(
                backend, longest_row, longest_row):
            return BACKENDS["reference"], (
                f"attention_backend='auto' uses 'reference' on {on_platform}, not "
                f"{backend.name!r}: rows of at most {longest_row} tokens fit in one of its "
                f"{backend.row_block}-token blocks, which it would pad them to")
        if reason is None:
            return backend, None
        reasons.append(f"{backend.name!r}: {reason}" if len(preferred) > 1 else reason)
    names = " or ".join(repr(backend.name) for backend in preferred)
    return BACKENDS["reference"], (
        f"attention_backend='auto' uses 'reference' on {on_platform}, not {names}: "
        f"{'; '.join(reasons)}"
    )


def setup_note(name: str, on_platform: str, longest_row: int | None = None,
               **needs: Any) -> str | None:
    """The line to log at setup about backend `name` on `on_platform`, or None: why "auto"
    falls back to the reference, or that a Pallas backend runs interpreted (slow) on CPU."""
    if name == "auto":
        backend, note = auto_choice(on_platform, longest_row, **needs)
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
    `options`: the fields of AttentionCall (the mask and bias by parts, `structure`, or dense;
    scale, dropout_rate, dropout_rng, return_weights, and the kernel hints causal and
    cache_layout)."""
    call = AttentionCall(**options)
    chosen = resolve(backend, needs_weights=call.return_weights,
                     needs_dropout=call.dropout_rate > 0, bias=_bias_kind(call),
                     dtype=jax.numpy.dtype(query.dtype).name, head_dim=query.shape[-1])
    if call.return_weights and not chosen.weights:
        raise ConfigError(f"attention_backend={backend!r} cannot return attention weights "
                          "(fused kernels never materialise them); use 'reference'")
    if call.dropout_rate > 0 and not chosen.dropout:
        raise ConfigError(f"attention_backend={backend!r} has no attention dropout "
                          f"(dropout_rate={call.dropout_rate}); use 'reference'")
    layout = chosen.cache  # of call.cache_layout's keys and values
    kv_len = key.shape[layout.slot_axis(True)] if call.cache_layout else key.shape[1]
    if backend == "auto" and within_one_block(chosen, query.shape[1], kv_len):
        chosen = BACKENDS["reference"]  # (which reads a row_block kernel's cache layout)
    chosen.check(query, call.bias, kv_len, platform())
    if chosen.platforms is not None and platform() not in chosen.platforms:
        raise ConfigError(f"attention_backend={backend!r} runs on {', '.join(chosen.platforms)}, "
                          f"not on {platform()!r}; use 'auto'")
    if masks.causal_by_index(call.structure, query.shape[1], kv_len):
        call = dataclasses.replace(call, causal=True)
    if chosen.attention is None:  # a cache read in the layout of the backend asked for
        return masks.reference_attention(query, key, value, call, layout)
    return chosen.attention(query, key, value, call)


def _bias_kind(call: AttentionCall) -> str | None:
    """The logit-bias kind (BIAS_KINDS) of a call, or None: "query" for a bias from the
    queries, else "learned" for any other (a dense one may carry a gradient)."""
    structure = call.structure
    if structure is not None and structure.relative is not None:
        return "query"
    has_bias = call.bias is not None or (structure is not None and structure.bias is not None)
    return "learned" if has_bias else None


def matmul(name: str) -> Matmul:
    """The matmul called `name` (one of MATMULS), or, for another attention backend's name
    (one of CHOICES), its platform profile's (`profile_matmul`)."""
    if name in MATMULS:
        return MATMULS[name]
    return profile_matmul(name)


def profile_matmul(attention_backend: str) -> Matmul:
    """The matmul attention backend `attention_backend` (one of CHOICES, "auto" resolved for
    the platform compiled for) was measured with: its Backend.matmul, or for a backend that
    names none (the reference among them), its platform's (PLATFORM_MATMUL)."""
    name = resolve(attention_backend).matmul or PLATFORM_MATMUL.get(platform(), "reference")
    return MATMULS[name]


def linear(
    x: jax.Array,  # [..., *in_dims]
    kernel: jax.Array,  # [*in_dims, *out_dims]
    *,
    backend: str = "reference",
    num_contracted: int = 1,
    compute_dtype: Any = None,
    out_dtype: Any = None,
) -> jax.Array:  # [..., *out_dims]
    """`reference.linear` by the matmul `backend` names (`matmul(backend)`), same values."""
    return matmul(backend).linear(x, kernel, num_contracted=num_contracted,
                                  compute_dtype=compute_dtype, out_dtype=out_dtype)


def cache_layout(backend: str, layout: str = "auto") -> CacheLayout:
    """The KV cache layout called `layout` (one of CACHE_LAYOUT_CHOICES; "auto": the one
    attention backend `backend` reads, on this platform). ConfigError for a layout that
    backend cannot read."""
    chosen = resolve(backend)
    if layout == "auto":
        where = chosen.cache_platforms
        return chosen.cache if where is None or platform() in where else REFERENCE
    if layout not in CACHE_LAYOUTS:
        raise ConfigError(f"cache_layout={layout!r} is unknown; choose one of: "
                          f"{', '.join(CACHE_LAYOUT_CHOICES)}")
    wanted = CACHE_LAYOUTS[layout]
    if wanted is not REFERENCE and wanted != chosen.cache:
        readers = [name for name, other in BACKENDS.items() if other.cache == wanted]
        raise ConfigError(f"cache_layout={layout!r} is read only by attention_backend="
                          f"{' or '.join(map(repr, readers))}, not by {chosen.name!r}; use "
                          "'auto' or 'reference'")
    return wanted


def projections(
    x: jax.Array,  # [..., *in_dims]
    kernels: list[jax.Array],  # each [*in_dims, *out_dims_i]
    biases: list[jax.Array] | None = None,  # each [*out_dims_i], or None: no bias
    *,
    backend: str = "reference",
    num_contracted: int = 1,
    compute_dtype: Any = None,
    out_dtype: Any = None,
    forward_only: bool = False,
) -> list[jax.Array]:  # each [..., *out_dims_i] in out_dtype (default compute_dtype)
    """x . kernel_i (+ bias_i) for several projections of one input (query, key and value),
    accumulated in float32, the bias added in float32, by the matmul `backend` names. The
    reference runs one `linear` per kernel; a Matmul with `fuses_projections` runs one matmul
    over the concatenated kernels and splits it (one wide matmul beats three narrow ones on
    CPU; on GPU XLA keeps less for the backward pass), with the same values. forward_only:
    no backward pass follows (the caller's hint), where `fuses_forward_only` joins them too."""
    shapes = [kernel.shape[num_contracted:] for kernel in kernels]  # each out_dims_i
    out_dtype = jax.numpy.dtype(out_dtype or compute_dtype or x.dtype)
    options = dict(backend=backend, num_contracted=num_contracted, compute_dtype=compute_dtype,
                   out_dtype=out_dtype if biases is None else jax.numpy.float32)
    chosen = matmul(backend)
    rows, features = math.prod(x.shape[:-num_contracted]), math.prod(x.shape[-num_contracted:])
    # as one [*in_dims, sum of widths] kernel
    joins = chosen.fuses_projections or (forward_only and chosen.fuses_forward_only)
    row_len = x.shape[-num_contracted - 1] if x.ndim > num_contracted else 1
    fused = (joins and rows >= chosen.min_fused_rows * features
             and not 0 < chosen.max_fused_len < row_len)
    if fused:
        kernels = [cpu_dense.concatenate_kernels(kernels, num_contracted)]
        biases = None if biases is None else [jax.numpy.concatenate(
            [bias.reshape(-1) for bias in biases])]
    outputs = [linear(x, kernel, **options) for kernel in kernels]
    if biases is not None:
        outputs = [(y + bias.astype(jax.numpy.float32)).astype(out_dtype)
                   for y, bias in zip(outputs, biases, strict=True)]
    return cpu_dense.split_outputs(outputs[0], shapes) if fused else outputs


def swap_halves(x: jax.Array) -> jax.Array:  # [..., 2 * half] -> [..., 2 * half] float32
    """(first half, second half) -> (second half, first half) on the last axis, in float32:
    RoPE's rotate_half partner. On TPU a matmul with a 0/1 permutation (one exact term per
    output, so bit for bit the halves; a minor dimension is padded to 128 lanes there, and
    slicing the halves of 64-wide heads cost more traffic: benchmarks/README.md); elsewhere
    the slices."""
    half = x.shape[-1] // 2
    if platform() != "tpu":
        return jax.numpy.concatenate([x[..., half:], x[..., :half]], axis=-1).astype("float32")
    swap = np.roll(np.eye(2 * half, dtype=np.float32), half, axis=1)  # x @ swap = roll(x)
    return jax.numpy.einsum("...h,hk->...k", x, jax.numpy.asarray(swap, x.dtype),
                            preferred_element_type=jax.numpy.float32,
                            precision=jax.lax.Precision.HIGHEST)


def ffn_activation_dtype(choice: str) -> str:
    """What ffn_activation_dtype="auto" means on the platform compiled for: "float32" on CPU
    (the activation on the first matmul's float32 accumulator: one fusion, measured faster),
    "compute" on TPU and GPU (the [tokens, d_ff] arrays kept for the backward pass at half the
    bytes). Other choices stay."""
    if choice != "auto":
        return choice
    return "float32" if platform() == "cpu" else "compute"


def tied_output_kernel(table: jax.Array, compute_dtype: Any) -> jax.Array | None:
    """A tied output projection's [d_model, vocab] kernel to make once before a decoding loop,
    from the embedding table [vocab, d_model]: on CPU the transposed copy, since XLA's CPU
    matmul reads a transposed table slowly at every step (benchmarks/translate_vs_hf.py);
    elsewhere None (the table is read as it is)."""
    if platform() != "cpu":
        return None
    return jax.numpy.asarray(table).T.astype(compute_dtype)


# The smallest vocabulary "auto" fuses on TPU: below it the logits are a small array XLA fuses
# well, and the kernel's per-token figures cost more than they save (benchmarks/README.md).
FUSED_LOSS_MIN_VOCAB = 2048


def loss_backend_for(platform: str, vocab_size: int) -> str:
    """What loss_backend="auto" means on `platform`: the fused kernel on TPU (Mosaic) for a
    vocabulary of at least FUSED_LOSS_MIN_VOCAB, else the reference (no GPU build of the
    kernel yet; on CPU it would run interpreted)."""
    fused = platform == "tpu" and vocab_size >= FUSED_LOSS_MIN_VOCAB
    return "fused" if fused else "reference"
