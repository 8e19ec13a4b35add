"""What dropout costs in tfm's training step, per mask generator, against no dropout.

    python benchmarks/dropout_cost.py                 # about 6 minutes on 2 cores
    python benchmarks/dropout_cost.py --batch 16 --repeats 3

The char-GPT step of benchmarks/vs_torch.py (benchmarks/char_gpt.py: 6 layers, d_model 384,
block 256, dropout 0.2 on the embeddings and both residual branches), tfm only, in one
process: `train.dropout_rng` threefry (tfm.training.prng's fused hash), threefry2x32 (the same masks
through jax's own lowering) and rbg, next to the same step with dropout 0. Repeats interleave
the variants; medians of wall and process CPU time. Writes
benchmarks/results/dropout_cost.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import char_gpt

from tfm.kernels import hardware

ROOT = Path(__file__).resolve().parents[1]

NO_DROPOUT = "no dropout"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--variants", default=f"threefry,threefry2x32,rbg,{NO_DROPOUT}")
    args = parser.parse_args()
    info = hardware.cpu_features()
    print(json.dumps(info))
    shape = types.SimpleNamespace(layers=6, heads=6, d_model=384, block=256, batch=args.batch,
                                  dropout=0.2)
    batch = char_gpt.random_batch(args.batch, shape.block)[0]
    runs = {}
    for variant in args.variants.split(","):
        config = types.SimpleNamespace(**vars(shape))
        if variant == NO_DROPOUT:
            config.dropout = 0.0
        impl = "threefry" if variant == NO_DROPOUT else variant
        runs[variant] = char_gpt.tfm_train_runner(config, "float32", batch, impl)[0]
    wall = {v: [] for v in runs}
    cpu = {v: [] for v in runs}
    for _ in range(args.repeats):
        for variant, run in runs.items():
            start = time.process_time()
            wall[variant].append(run(1))
            cpu[variant].append(time.process_time() - start)
    rows = [{"variant": v, "wall_s": statistics.median(wall[v]), "cpu_s": statistics.median(cpu[v]),
             "wall_s_all": wall[v], "cpu_s_all": cpu[v]} for v in runs]
    base = next((r for r in rows if r["variant"] == NO_DROPOUT), None)
    lines = [
        "# Dropout's cost in the char-GPT train step", "",
        f"CPU: {info['model']}, {info['cores']} cores. Batch {args.batch} x {shape.block}, "
        f"dropout 0.2, float32; medians of {args.repeats} interleaved steps.", "",
        "| dropout masks | step wall s | step CPU s | wall s over no dropout |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        over = f"{r['wall_s'] - base['wall_s']:+.2f}" if base and r is not base else ""
        lines.append(f"| {r['variant']} | {r['wall_s']:.2f} | {r['cpu_s']:.2f} | {over} |")
        print(json.dumps(r), flush=True)
    lines += ["", "Command: `python " + " ".join(["benchmarks/dropout_cost.py"] + sys.argv[1:])
              + "`"]
    out = ROOT / "benchmarks/results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "dropout_cost.json").write_text(json.dumps({"cpu": info, "rows": rows}, indent=1) + "\n")
    (out / "dropout_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
