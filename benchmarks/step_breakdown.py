"""Where the char-GPT train step's time goes: the attention core against everything else.

    python benchmarks/step_breakdown.py                      # float32 and bfloat16, ~4 minutes
    python benchmarks/step_breakdown.py --dtypes float32 --repeats 7

The char-GPT step of benchmarks/vs_torch.py (benchmarks/char_gpt.py: 6 layers, d_model 384,
block 256, batch 64, dropout 0.2, `train.cpu_kernels="auto"`), tfm only, next to the same step
with the attention core (`kernels.attention`: softmax(q k^T) v with its mask and
dropout, forward and backward) replaced by `q + k + v`, which keeps the shapes and every other
op (projections, FFN, norms, dropout, loss, optimizer). Repeats interleave the two; medians;
freed host memory is kept, as in training (tfm/kernels/cpu_memory.py).
The core's share is the difference; the rest's MFU counts the step's model FLOPs less the
core's (tfm.training.flops.attention_core_flops: 12 * layers * block * d_attn per token) against
this
host's measured matmul peak (tfm.training.hardware.measure_matmul_flops, 2048^3, best of 10, in that
dtype). Writes benchmarks/results/step_breakdown.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import types
from pathlib import Path

import char_gpt
import jax.numpy as jnp

from tfm import kernels
from tfm.kernels import cpu_memory, hardware
from tfm.nn import layers
from tfm.training import flops

ROOT = Path(__file__).resolve().parents[1]

FULL, NO_CORE = "whole step", "attention core replaced by q + k + v"


class _KernelsWithoutCore:
    """tfm.kernels as the layers see it, with the attention core replaced by q + k + v."""

    def __getattr__(self, name):
        return getattr(kernels, name)

    @staticmethod
    def attention(query, key, value, **_):
        return query + key.astype(query.dtype) + value.astype(query.dtype)


def measure(dtype: str, args) -> dict:
    shape = types.SimpleNamespace(layers=6, heads=6, d_model=384, block=256, batch=args.batch,
                                  dropout=0.2)
    batch = char_gpt.random_batch(args.batch, shape.block)[0]
    runs = {}
    for variant in (FULL, NO_CORE):
        if variant == NO_CORE:
            layers.kernels = _KernelsWithoutCore()  # read when the step is traced
        try:
            runs[variant], config, _ = char_gpt.tfm_train_runner(shape, dtype, batch)
        finally:
            layers.kernels = kernels
    seconds = {variant: [] for variant in runs}
    for repeat in range(args.repeats):
        for variant in (list(runs) if repeat % 2 == 0 else list(runs)[::-1]):
            seconds[variant].append(runs[variant](1))
    median = {variant: statistics.median(times) for variant, times in seconds.items()}
    tokens = args.batch * shape.block
    per_token = flops.flops_per_token(config, shape.block)
    core_per_token = flops.attention_core_flops(config, shape.block, shape.layers)
    peak = hardware.measure_matmul_flops(jnp.dtype(dtype), repeats=10)
    return {
        "dtype": dtype, "batch": args.batch, "block": shape.block, "seconds": seconds,
        "median_s": median, "matmul_peak": peak,
        "core_s": median[FULL] - median[NO_CORE],
        "core_share": 1.0 - median[NO_CORE] / median[FULL],
        "step_mfu": tokens * per_token / median[FULL] / peak,
        "rest_mfu": tokens * (per_token - core_per_token) / median[NO_CORE] / peak,
        "core_flops_share": core_per_token / per_token,
    }


def report(info: dict, rows: list[dict], command: str) -> str:
    lines = [
        "# The char-GPT train step: the attention core against the rest",
        "",
        f"{hardware.cpu_line(info)}. Batch {rows[0]['batch']} x "
        f"{rows[0]['block']}; medians of interleaved repeats.",
        "",
        "| dtype | whole step s | without the core s | core's share of the time | core's share "
        "of the model FLOPs | step MFU | MFU of the rest | matmul peak GFLOP/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['dtype']} | {row['median_s'][FULL]:.2f} | {row['median_s'][NO_CORE]:.2f} | "
            f"{row['core_share']:.0%} | {row['core_flops_share']:.0%} | {row['step_mfu']:.0%} | "
            f"{row['rest_mfu']:.0%} | {row['matmul_peak'] / 1e9:.0f} |"
        )
    lines += ["", f"Command: `{command}`"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    info = hardware.cpu_features()
    print(json.dumps(info))
    cpu_memory.keep_freed_memory()  # as training on CPU does (tfm/kernels/cpu_memory.py)
    rows = [measure(dtype, args) for dtype in args.dtypes.split(",")]
    command = "python " + " ".join(
        [Path(sys.argv[0]).as_posix()] + [f"'{a}'" if " " in a else a for a in sys.argv[1:]]
    )
    text = report(info, rows, command)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step_breakdown.json").write_text(
        json.dumps({"cpu": info, "rows": rows, "command": command}, indent=1)
    )
    (out / "step_breakdown.md").write_text(text)


if __name__ == "__main__":
    main()
