#!/usr/bin/env bash
# The speed issue's GPU checks as one prepared run (cuDNN vs xla attention, cuDNN's learned-bias
# gradient, the flex kernel (Triton) against the reference and cuDNN, GPT-2-small training
# MFU, batch-1 decode vs the HBM bound). On the lent GPU machine (jax, flax, optax preinstalled):
#   bash benchmarks/gpu.sh            # results in $OUT/gpu.json (or benchmarks/results/gpu.json)
# If a package is missing there, carry wheels in .whl/ (see the device notes) and they are
# installed first.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
timeout 480 python3 benchmarks/gpu_bench.py
