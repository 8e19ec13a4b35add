"""Test setup: 8 simulated CPU devices (so sharding tests run anywhere) and float32 matmuls."""

import os
import shutil
import subprocess
import sys
import tempfile

from child_flags import OLDER_EMITTERS


def _xla_takes(flag: str) -> bool:
    """Whether this jaxlib's XLA knows `flag`: it aborts a process whose XLA_FLAGS name one it
    does not, so a child process is asked, before this one starts its backend."""
    child = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"],
                           env={**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"},
                           capture_output=True, check=False)
    return child.returncode == 0


# Must happen before jax is imported anywhere in the test process (pytest-xdist's workers
# inherit it from the first process). LLVM optimisation level 0 compiles CPU programs 2-4x
# faster; XLA's older fusion emitters, where this jaxlib still has them, compile a small program
# in half the time (a one-op jit: 15 -> 8 ms; the tests compile thousands, tests/nn's summed
# time 379 -> 252 s). Both change code generation only, not XLA's passes.
if "XLA_FLAGS" not in os.environ:
    fast = "--xla_backend_optimization_level=0"
    if _xla_takes(OLDER_EMITTERS):
        fast += " " + OLDER_EMITTERS
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count=8 {fast}"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Exact float32 matmuls on every backend, so naive-vs-fast comparisons at 1e-5 are meaningful.
jax.config.update("jax_default_matmul_precision", "highest")
# Start the backend now, with the flags above: tests that edit XLA_FLAGS (test_compile_options)
# must not be the first to start it, or their worker would run every later test on 1 device.
jax.devices()

# One persistent compilation cache for the whole test run, shared by the pytest-xdist workers:
# tests build the same small programs over and over, each in a new jit (a tiny model's
# one-device reference, model init's ops, the checks' eager ops), and a hit loads the compiled
# program instead of compiling it again. The cache key holds the program, the compile options
# and XLA_FLAGS, so a hit is the program that would have been compiled. A new folder per run
# (never a stale one), removed when the run ends. Set in jax.config, not
# JAX_COMPILATION_CACHE_DIR: the tests' subprocesses choose their own.
CACHE_ENV = "TESTS_JAX_CACHE_DIR"


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the controller (or the only process): make it
        os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="tfm-test-jax-cache-")
    jax.config.update("jax_compilation_cache_dir", os.environ[CACHE_ENV])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # A program XLA cannot serialise (a oneDNN fusion) is compiled each time, as without a cache.
    config.addinivalue_line(
        "filterwarnings", "ignore:Error writing persistent compilation cache entry:UserWarning")


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(CACHE_ENV, ""), ignore_errors=True)
