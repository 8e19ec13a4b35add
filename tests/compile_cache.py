"""A persistent jax compilation cache for a test module whose runs share one model, so later
runs load the compiled steps of the first."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache


@contextlib.contextmanager
def persistent_compilation_cache(directory: Path) -> Iterator[None]:
    """jax's persistent compilation cache in `directory`, the previous settings restored."""
    previous = (
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_persistent_cache_min_compile_time_secs,
    )
    jax.config.update("jax_compilation_cache_dir", str(directory))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        yield
    finally:
        jax.config.update("jax_compilation_cache_dir", previous[0])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", previous[1])
        compilation_cache.reset_cache()
