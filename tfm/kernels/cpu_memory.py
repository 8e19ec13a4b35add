"""Host memory on CPU: keep freed blocks in the process, so a train step does not fault its
memory in anew each step.

XLA CPU takes each step's temporaries as one block. glibc serves large blocks with a fresh
mmap and unmaps them when freed, so every step page-faults and zeroes its temporaries again.
`keep_freed_memory()` tells glibc to serve every block from one heap and not to give freed
memory back, so the next step reuses the same pages (benchmarks/README.md has the figures;
`benchmarks/vs_torch.py --malloc_defaults off` measures them again).

The cost is resident memory: freed blocks stay in the process until it exits. A training loop
reuses them, but a program that keeps large step outputs alive across calls can hold several
freed copies, so tfm sets it only in its training loop (`tfm.training.train.train_and_evaluate`
on CPU); call it yourself for your own loops. Left alone when TFM_MALLOC_DEFAULTS=0, when the
C library has no `mallopt` (not glibc), or when $GLIBC_TUNABLES already sets glibc.malloc
options (yours win).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

# glibc's malloc.h parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
# mallopt takes an int, and glibc stores the trim threshold as a size_t: -1 becomes SIZE_MAX, so
# freed memory at the top of the heap never goes back to the system. (The largest positive int,
# 2 GiB, let the 5.4 GB of temporaries of a batch-64 char-GPT step go back and fault in again
# every step: a million faults per step; benchmarks/README.md has the before and after.)
_NEVER_TRIM = -1


@functools.cache
def keep_freed_memory() -> bool:
    """Serves large blocks from the malloc heap and keeps freed memory (glibc `mallopt`), once per
    process. Returns whether the setting is in force."""
    if os.environ.get("TFM_MALLOC_DEFAULTS", "1") == "0":
        return False
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl without mallopt, Windows)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    kept = mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM) == 1
    no_mmap = mallopt(_M_MMAP_MAX, 0) == 1
    one_arena = mallopt(_M_ARENA_MAX, 1) == 1
    return kept and no_mmap and one_arena
