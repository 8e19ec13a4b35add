"""XLA compile options for tfm's jitted steps on CPU, and `jit`: jax.jit with them.

- By default XLA (jaxlib 0.10) hands a CPU program's dots and reductions to the YNNPACK
  library; tfm compiles its train, eval and decode steps without it
  (xla_cpu_experimental_ynn_fusion_type=""), with the same numbers to float32 rounding.
- A step may ask for other kernels (`cpu_kernels`, the `train.cpu_kernels` field): "ynnpack"
  (XLA's defaults), "ynnpack_dots" (YNNPACK takes only the dots: the only CPU path that runs
  bfloat16 matmuls in bf16; XLA's own kernels and oneDNN upcast them to float32) or "onednn"
  (every dot to the oneDNN library; x86-64 only). "auto" takes "ynnpack_dots" for a bf16
  model on a CPU with bf16 units, else "xla"; decoding loops choose by their rows
  (`decode_kernels`). Which is faster depends on the model and the CPU: benchmarks/README.md
  has the side-by-side runs (benchmarks/xla_options.py, vs_torch.py, attention_core.py).
- Parameter initialisation, a program that runs once, compiles with LLVM at -O1 too
  (`run_once_options`): faster to compile, the same parameters bit for bit.
Left alone when the backend is not a CPU, when $XLA_FLAGS already sets an option (yours wins),
when TFM_XLA_DEFAULTS=0, or when this jaxlib does not know an option.

`use_compilation_cache(directory)` turns on jax's persistent compilation cache, so later
processes load compiled steps instead of compiling them again (`train.compilation_cache_dir`).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import platform
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from tfm.kernels import hardware

YNN_FUSION = "xla_cpu_experimental_ynn_fusion_type"
LLVM_LEVEL = "xla_backend_optimization_level"
CPU_OPTIONS: dict[str, Any] = {YNN_FUSION: ""}
RUN_ONCE_OPTIONS: dict[str, Any] = {**CPU_OPTIONS, LLVM_LEVEL: 1}
ONEDNN_OPTIONS: dict[str, Any] = {
    **CPU_OPTIONS,
    "xla_cpu_use_onednn": True,
    # Only single dots: oneDNN's dot + element-wise fusions ("LIBRARY_FUSION_TYPE_DOT") aborted
    # the process at run time in jaxlib 0.10.2 ("partition compile failed").
    "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
}
YNNPACK_DOTS_OPTIONS: dict[str, Any] = {YNN_FUSION: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}
# What a step's dots and reductions compile to on CPU: "xla" = tfm's options above (XLA's own
# loops and Eigen), "ynnpack" = XLA's defaults (the YNNPACK library takes them),
# "ynnpack_dots" = YNNPACK takes only the dots, "onednn" = the dots go to the oneDNN library;
# the rest as "xla". A config field may also say "auto" (see `resolve_cpu_kernels`).
CPU_KERNELS = ("xla", "ynnpack", "ynnpack_dots", "onednn")
CPU_KERNEL_CHOICES = ("auto", *CPU_KERNELS)
_UNSET = object()
_forced: Any = _UNSET  # set by `using`


@contextlib.contextmanager
def using(options: dict[str, Any] | None) -> Iterator[None]:
    """Calls of `jit`-wrapped steps inside this block run programs compiled with `options`
    (None: XLA's defaults); outside it, with tfm's. For side-by-side measurements
    (benchmarks/xla_options.py); each setting compiles once per step."""
    global _forced
    previous, _forced = _forced, None if options is None else tuple(sorted(options.items()))
    try:
        yield
    finally:
        _forced = previous


@functools.cache
def compiler_options() -> dict[str, Any] | None:
    """The options tfm compiles its steps with on this backend (None: XLA's defaults).
    Starts the backend on first call: call it after jax.distributed.initialize."""
    return _usable(CPU_OPTIONS)


@functools.cache
def run_once_options() -> dict[str, Any] | None:
    """The options for a program that runs once per process (parameter initialisation, ~10,000
    ops of threefry and normal sampling for a small model): the steps' plus LLVM at -O1."""
    return _usable(RUN_ONCE_OPTIONS)


@functools.cache
def onednn_options() -> dict[str, Any] | None:
    """The options for cpu_kernels="onednn": tfm's plus oneDNN dots on an x86-64 CPU; tfm's
    own elsewhere, or where this jaxlib lacks the oneDNN options."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return compiler_options()
    options = _usable(ONEDNN_OPTIONS)
    if options is None or "xla_cpu_use_onednn" not in options:  # $XLA_FLAGS says otherwise
        return compiler_options()
    return options


@functools.cache
def ynnpack_dots_options() -> dict[str, Any] | None:
    """The options for cpu_kernels="ynnpack_dots": YNNPACK takes the dots only."""
    return _usable(YNNPACK_DOTS_OPTIONS)


def jit_once(fun: Callable, **jit_kwargs: Any) -> Callable:
    """jax.jit for a program that runs once per process (e.g. parameter initialisation), with
    `run_once_options` on CPU."""
    return jax.jit(fun, compiler_options=run_once_options(), **jit_kwargs)


def kernel_options(cpu_kernels: str) -> dict[str, Any] | None:
    """The compile options a step asking for `cpu_kernels` (one of CPU_KERNELS) gets here."""
    if cpu_kernels not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels={cpu_kernels!r} must be one of {CPU_KERNELS}")
    if cpu_kernels == "ynnpack":
        return None
    if cpu_kernels == "ynnpack_dots":
        return ynnpack_dots_options()
    return onednn_options() if cpu_kernels == "onednn" else compiler_options()


def resolve_cpu_kernels(cpu_kernels: str, compute_dtype: Any) -> str:
    """A config's cpu_kernels (one of CPU_KERNEL_CHOICES) as one of CPU_KERNELS. "auto" is
    "ynnpack_dots" for a bfloat16 model on a CPU with bf16 units (AMX or AVX512-BF16), whose
    YNNPACK bf16 matmuls ran at twice float32's FLOP/s (benchmarks/README.md; XLA's own kernels
    compute bf16 matmuls in float32), and "xla" otherwise."""
    if cpu_kernels not in CPU_KERNEL_CHOICES:
        raise ValueError(f"cpu_kernels={cpu_kernels!r} must be one of {CPU_KERNEL_CHOICES}")
    if cpu_kernels != "auto":
        return cpu_kernels
    if jnp.dtype(compute_dtype) == jnp.bfloat16 and hardware.cpu_features()["bf16_native"]:
        return "ynnpack_dots"
    return "xla"


def _usable(wanted: dict[str, Any]) -> dict[str, Any] | None:
    """`wanted` less what $XLA_FLAGS sets, on a CPU backend, unless TFM_XLA_DEFAULTS=0 or this
    jaxlib does not compile with them (None: XLA's defaults)."""
    if os.environ.get("TFM_XLA_DEFAULTS", "1") == "0" or jax.default_backend() != "cpu":
        return None
    user_flags = os.environ.get("XLA_FLAGS", "")
    options = {key: value for key, value in wanted.items() if key not in user_flags}
    if not options:
        return None
    try:  # an older or newer jaxlib may not know an option: then compile without them
        jax.jit(jnp.negative, compiler_options=options).lower(1.0).compile()
    except Exception:  # noqa: BLE001 - XLA reports an unknown option as a runtime error
        return None
    return options


def jit(
    fun: Callable | None = None,
    /,
    *,
    cpu_kernels: str | Callable[[dict[str, Any]], str] = "xla",
    platform: str | None = None,
    **jit_kwargs: Any,
) -> Callable:
    """jax.jit(fun, compiler_options=compiler_options(), **jit_kwargs), usable as a decorator
    (`@functools.partial(jit, static_argnames=...)`). cpu_kernels="ynnpack" compiles with XLA's
    own defaults instead, "onednn" with oneDNN dots (see CPU_KERNELS, kernel_options). The
    jitted function is built on the first call, so importing tfm starts no backend. Called with
    tracers (inside another jit) it is a plain jax.jit: the outer function's options apply.
    Has `.lower(*args)` like jax.jit's.

    cpu_kernels may also be a function of the call's arguments (a dict of name -> value, as
    `fun`'s signature binds them) returning one of CPU_KERNELS, e.g. to choose by batch size;
    each choice compiles once per shape. `platform`: what the program compiles for (default:
    this host's backend); CPU options apply only to "cpu" (e.g. not when compiling for a TPU
    mesh on a CPU host)."""
    if not callable(cpu_kernels) and cpu_kernels not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels={cpu_kernels!r} must be one of {CPU_KERNELS}")
    if fun is None:
        return functools.partial(jit, cpu_kernels=cpu_kernels, platform=platform, **jit_kwargs)

    @functools.cache
    def jitted(top_level: bool, forced: Any, kind: str) -> Callable:
        if not top_level or platform not in (None, "cpu"):
            options = None
        elif forced is _UNSET:
            options = kernel_options(kind)
        else:
            options = None if forced is None else dict(forced)
        return jax.jit(fun, compiler_options=options, **jit_kwargs)

    def top_level(args: tuple, kwargs: dict) -> bool:
        leaves = jax.tree.leaves((args, kwargs))
        return not any(isinstance(leaf, jax.core.Tracer) for leaf in leaves)

    signature = inspect.signature(fun) if callable(cpu_kernels) else None

    def kind_for(args: tuple, kwargs: dict) -> str:
        if signature is None:
            return cpu_kernels
        kind = cpu_kernels(signature.bind(*args, **kwargs).arguments)
        if kind not in CPU_KERNELS:
            raise ValueError(f"cpu_kernels chose {kind!r}; it must be one of {CPU_KERNELS}")
        return kind

    def for_call(args: tuple, kwargs: dict) -> Callable:
        return jitted(top_level(args, kwargs), _forced, kind_for(args, kwargs))

    @functools.wraps(fun)
    def call(*args: Any, **kwargs: Any) -> Any:
        return for_call(args, kwargs)(*args, **kwargs)

    call.lower = lambda *args, **kwargs: for_call(args, kwargs).lower(*args, **kwargs)
    return call


def use_compilation_cache(directory: str | Path, min_compile_seconds: float = 1.0) -> Path:
    """Turns on jax's persistent compilation cache in `directory` (created if missing) for this
    process: programs that took at least `min_compile_seconds` to compile are written there, and
    a later process compiling the same program with the same options and jax version loads it
    instead (XLA:CPU checks the host's CPU features on load and compiles again on a mismatch).
    Returns the directory."""
    from jax.experimental.compilation_cache import compilation_cache

    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    compilation_cache.reset_cache()  # a process that compiled before this reads the new setting
    return path


# tfm.decode.generate.lm_generate's loops over at least this many rows (batch x beams) compile
# their dots with a library: oneDNN on x86-64 CPUs without AVX-512, YNNPACK on those with it;
# fewer rows keep XLA's kernels, and translate keeps them at every size. benchmarks/README.md
# ("Decoding") has the side-by-side runs behind each choice.
ONEDNN_MIN_ROWS = 8


@functools.cache
def _has_avx512() -> bool:  # /proc/cpuinfo, read once
    return "avx512f" in hardware.cpu_features()["isa"]


def decode_kernels(rows: int) -> str:
    """What a decoding loop over `rows` rows compiles its dots to on CPU (one of CPU_KERNELS)."""
    if rows < ONEDNN_MIN_ROWS:
        return "xla"
    return "ynnpack_dots" if _has_avx512() else "onednn"
