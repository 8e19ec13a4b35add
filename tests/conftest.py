"""Test setup: 8 simulated CPU devices (so sharding tests run anywhere) and float32 matmuls."""

import os

# Must happen before jax is imported anywhere in the test process. LLVM optimisation level 0
# compiles CPU programs 2-4x faster; it changes code generation only, not XLA's passes.
os.environ.setdefault(
    "XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# Exact float32 matmuls on every backend, so naive-vs-fast comparisons at 1e-5 are meaningful.
jax.config.update("jax_default_matmul_precision", "highest")
# Start the backend now, with the flags above: tests that edit XLA_FLAGS (test_compile_options)
# must not be the first to start it, or their worker would run every later test on 1 device.
jax.devices()
