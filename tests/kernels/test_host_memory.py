"""tfm.kernels.cpu_memory: after keep_freed_memory, a freed large block is reused without page
faults.

Each check runs in a fresh interpreter: the malloc setting is the whole process's.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")

# Allocates and touches a 64 MiB block three times (freeing it in between) with libc's own
# malloc, and prints the page faults of the third round: glibc's defaults map a block that large
# afresh each time (16,384 faults of 4 KiB pages); kept freed memory is reused.
_MALLOC_ROUNDS = textwrap.dedent("""
    import ctypes, resource, sys
    from tfm.kernels import cpu_memory
    print(cpu_memory.keep_freed_memory())
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 << 20
    for round in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = libc.malloc(size)
        ctypes.memset(block, 1, size)
        libc.free(block)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    print(faults)
""")

# A jitted step with a 48 MiB temporary (running sums of 8), as in a train step; the faults of
# each of the last 20 of 40 calls, once the heap has mostly settled (XLA asks for 64-byte-aligned
# blocks, so a freed block serves the next call only once it has merged with a free neighbour:
# the first calls grow the heap, and a later one now and then still does). Locally the first
# 1-9 calls after the first faulted; a CI run where calls 10-19 still mostly did failed a
# 20-call version of this check.
_JIT_ROUNDS = textwrap.dedent("""
    import resource
    import jax, jax.numpy as jnp
    from tfm.kernels import cpu_memory
    cpu_memory.keep_freed_memory()
    step = jax.jit(lambda x: jnp.cumsum(x.reshape(-1, 8), axis=1)[::512].sum())
    x = jnp.ones((12 << 20,), jnp.float32)
    for round in range(40):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        step(x).block_until_ready()
        if round >= 20:
            print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""")


def _run(code: str, **env: str) -> list[str]:
    # Not the tests' XLA_FLAGS: LLVM at -O0 compiles faster but runs the jitted step's 40 calls
    # ~10x slower (26 s against 3 s), and the faults do not depend on it.
    environment = {key: value for key, value in os.environ.items()
                   if key not in ("TFM_MALLOC_DEFAULTS", "GLIBC_TUNABLES", "XLA_FLAGS")}
    environment.update(env, JAX_PLATFORMS="cpu")
    result = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True,
                            text=True, check=True, timeout=120)
    return result.stdout.split()


# A 2.5 GiB block, one byte touched per MiB (2,560 pages, so the test needs little memory), freed
# and taken again three times: the pages stay only if glibc never trims the heap (with the
# largest positive threshold, 2 GiB, they would be given back and fault in again).
_HUGE_ROUNDS = _MALLOC_ROUNDS.replace("size = 64 << 20", "size = 5 << 29").replace(
    "ctypes.memset(block, 1, size)",
    "[ctypes.memset(block + offset, 1, 1) for offset in range(0, size, 1 << 20)]")


def test_freed_block_is_reused_without_faults():
    applied, faults = _run(_MALLOC_ROUNDS)
    assert applied == "True"
    assert int(faults) < 1_000  # 64 MiB is 16,384 pages


def test_blocks_past_two_gib_are_kept_too():
    applied, faults = _run(_HUGE_ROUNDS)
    assert applied == "True"
    assert int(faults) < 256  # 2,560 touched pages
    _, default_faults = _run(_HUGE_ROUNDS, TFM_MALLOC_DEFAULTS="0")
    assert int(default_faults) >= 2_560


def test_glibc_defaults_fault_again_when_turned_off():
    applied, faults = _run(_MALLOC_ROUNDS, TFM_MALLOC_DEFAULTS="0")
    assert applied == "False"
    assert int(faults) > 10_000


def test_user_glibc_tunables_win():
    applied, _ = _run(_MALLOC_ROUNDS, GLIBC_TUNABLES="glibc.malloc.mmap_max=4")
    assert applied == "False"


def test_step_temporaries_are_reused():
    kept = sorted(int(faults) for faults in _run(_JIT_ROUNDS))
    default = sorted(int(faults) for faults in _run(_JIT_ROUNDS, TFM_MALLOC_DEFAULTS="0"))
    assert kept[len(kept) // 2] < 1_000  # most calls reuse the pages
    assert default[0] > 10_000  # every call faults its 48 MiB (12,288 pages) in again
