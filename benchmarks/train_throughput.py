"""Training throughput (tokens/s) and MFU of a config, float32 vs bfloat16 compute, side by side.

    python benchmarks/train_throughput.py                       # char-LM config on this machine
    python benchmarks/train_throughput.py --config configs/char_lm.py:runlocal --steps 20

Each dtype runs in the same process on the same batches: compile and warm up, then time
`--steps` train steps `--repeats` times and keep the median. MFU uses the config's FLOPs per
token (tfm.training.flops) against the device peak (on CPU: a matmul micro-benchmark, measured once
per dtype and cached). Writes benchmarks/results/train_throughput.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from tfm.kernels import cpu_memory, hardware
from tfm.parallel import sharding
from tfm.sweeps.sweep import load_config
from tfm.training import flops, train
from tfm.training.experiment import init_state, setup, state_shardings

ROOT = Path(__file__).resolve().parents[1]


def measure(config, dtype: str, steps: int, repeats: int, workdir: Path) -> dict:
    config = config.copy_and_resolve_references()
    config.model.dtype = dtype
    experiment = setup(config, workdir)
    _, shardings = state_shardings(experiment)
    state = init_state(experiment, shardings)
    step_fn, _ = train.jit_steps(experiment, shardings)  # what train_and_evaluate runs
    cpu_memory.keep_freed_memory()  # as train_and_evaluate does on CPU
    iterator = experiment.data.train_iterator()
    batches = [
        sharding.shard_batch(next(iterator), experiment.mesh, rules=experiment.rules)
        for _ in range(steps)
    ]
    state, _ = step_fn(state, batches[0])  # compile
    jax.block_until_ready(state)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for batch in batches:
            state, out = step_fn(state, batch)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / steps)
    step_time = statistics.median(times)
    data_config = experiment.data.config
    tokens = data_config.batch_size * data_config.seq_len
    per_token = flops.flops_per_token(experiment.model_config, data_config.seq_len,
                                      experiment.mode)
    peak = hardware.device_peak_flops(jax.devices()[0], jnp.dtype(dtype))
    result = {
        "dtype": dtype,
        "step_time_s": step_time,
        "tokens_per_second": tokens / step_time,
        "flops_per_token": per_token,
        "peak_flops_per_device": peak,
        "device": jax.devices()[0].device_kind,
        "num_devices": jax.device_count(),
    }
    if peak:
        result["mfu"] = flops.mfu(tokens / step_time, per_token, jax.device_count(), peak)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/char_lm.py")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--workdir", default="/tmp/tfm_bench_train")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    config = load_config(args.config)
    results = [measure(config, dtype, args.steps, args.repeats, Path(args.workdir))
               for dtype in args.dtypes.split(",")]
    baseline = results[0]["tokens_per_second"]
    lines = [
        f"# Training throughput: {args.config} on {results[0]['device']} "
        f"({results[0]['num_devices']} device(s))",
        "",
        "| compute dtype | step time (ms) | tokens/s | vs first | MFU |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else "n/a"
        lines.append(f"| {r['dtype']} | {1000 * r['step_time_s']:.1f} | "
                     f"{r['tokens_per_second']:,.0f} | {r['tokens_per_second'] / baseline:.2f}x | "
                     f"{mfu} |")
    lines.append("")
    lines.append(f"Command: python benchmarks/train_throughput.py --config {args.config} "
                 f"--steps {args.steps} --repeats {args.repeats}")
    report = "\n".join(lines)
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_throughput.json").write_text(json.dumps(results, indent=1))
    (out / "train_throughput.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
