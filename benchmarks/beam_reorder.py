"""Beam search's cache reorder on CPU: each beam's parent among its own source's beams (tfm's,
`tfm.nn.cache.take_beams`) against the parent by global row index (tfm's before 297ed70).

    python benchmarks/beam_reorder.py                 # about 2 minutes on 2 cores
    python benchmarks/beam_reorder.py --rounds 2 --calls 3

Under a mesh that splits the sources over devices the global-row gather made XLA all-gather
every layer's cache at every step (the compiled TPU and GPU beam loops of the paper's models:
docs/gpu-tpu.md, "Rechecked"); on one device both gather the same rows. This checks that the
per-source gather costs nothing there: beam-4 translation by `tfm.decode.generate.translate`
(a random-init encoder-decoder, 3 + 3 layers, d_model 256, 4 heads, d_ff 1,024, vocabulary
1,000, float32; 16 sources of 24 tokens, 32 new tokens, no EOS), one process, the two reorders
compiled in turn each round (compile excluded), the same tokens asserted; then each reorder by
itself, interleaved (on a shared host the whole translation varies by more than the reorder
costs: run it pinned, `taskset -c 1 python benchmarks/beam_reorder.py`). Writes
benchmarks/results/beam_reorder.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from tfm.decode import generate
from tfm.kernels import hardware
from tfm.nn import cache as cache_module
from tfm.nn.config import ModelConfig
from tfm.nn.models import EncoderDecoder

ROOT = Path(__file__).resolve().parents[1]


def by_global_row(
    rows: jax.Array,  # [batch * beam, ...]
    parents: jax.Array,  # [batch, beam] int, each beam's parent among its source's beams
) -> jax.Array:  # [batch * beam, ...]
    """The reorder before 297ed70: one gather by global row index."""
    batch, beams = parents.shape
    return rows[(jnp.arange(batch)[:, None] * beams + parents).reshape(-1)]


REORDERS = {"per source (now)": cache_module.take_beams, "global row (before)": by_global_row}


def reorder_alone(calls: int) -> list[dict]:
    """Each reorder by itself on one [64 rows, 64 slots, 4 heads, 64] float32 cache layer (16
    sources x 4 beams), the calls interleaved: min, 10th percentile and median in microseconds."""
    rows = jnp.asarray(np.random.default_rng(1).normal(size=(64, 64, 4, 64)), jnp.float32)
    parents = jnp.asarray(np.random.default_rng(2).integers(0, 4, size=(16, 4)), jnp.int32)
    jitted = {name: jax.jit(lambda x, p, take=take: take(x, p) + 1.0)
              for name, take in REORDERS.items()}
    first, second = (np.asarray(f(rows, parents)) for f in jitted.values())
    assert np.array_equal(first, second), "the two reorders moved different rows"
    micros = {name: [] for name in jitted}
    for _ in range(calls):
        for name, f in jitted.items():
            start = time.perf_counter()
            jax.block_until_ready(f(rows, parents))
            micros[name].append(1e6 * (time.perf_counter() - start))
    return [{"reorder": name, "min_us": min(times), "p10_us": float(np.percentile(times, 10)),
             "median_us": statistics.median(times)} for name, times in micros.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="compiles of each reorder")
    parser.add_argument("--calls", type=int, default=5, help="timed calls per compile")
    parser.add_argument("--alone_calls", type=int, default=400,
                        help="interleaved calls of each reorder by itself")
    args = parser.parse_args()
    info = hardware.cpu_features()
    print(json.dumps(info))
    config = ModelConfig(vocab_size=1000, num_encoder_layers=3, num_decoder_layers=3,
                         d_model=256, num_heads=4, d_ff=1024, max_len=128)
    source = np.random.default_rng(0).integers(3, 1000, size=(16, 24)).astype(np.int32)
    params = EncoderDecoder(config).init(jax.random.PRNGKey(0), source, source[:, :8])["params"]
    translate = lambda: jax.block_until_ready(generate.translate(
        params, config, source, max_new_tokens=32, eos_id=None, beam_size=4).tokens)
    seconds = {name: [] for name in REORDERS}
    tokens = {}
    for _ in range(args.rounds):
        for name, take in REORDERS.items():
            with mock.patch.object(cache_module, "take_beams", take):
                jax.clear_caches()
                tokens[name] = np.asarray(translate())  # compiles with this reorder
                for _ in range(args.calls):
                    start = time.perf_counter()
                    translate()
                    seconds[name].append(time.perf_counter() - start)
    first, second = tokens.values()
    assert np.array_equal(first, second), "the two reorders chose different beams"
    rows = [{"reorder": name, "median_ms": 1e3 * statistics.median(times),
             "all_ms": [round(1e3 * t, 1) for t in times]} for name, times in seconds.items()]
    base = rows[1]["median_ms"]
    cpus = sorted(os.sched_getaffinity(0))
    pinned = f"run on CPU {cpus}" if len(cpus) < (os.cpu_count() or 1) else "not pinned"
    lines = [
        "# Beam search's cache reorder on CPU", "",
        f"CPU: {info['model']}, {info['cores']} cores ({pinned}). Beam-4 translation, "
        f"16 x 24-token sources, 32 new tokens; medians of {args.rounds} x {args.calls} calls, "
        "the reorders compiled in turn.", "",
        "| reorder | median ms | against global row |", "|---|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['reorder']} | {row['median_ms']:.1f} | "
                     f"{base / row['median_ms']:.2f}x |")
        print(json.dumps(row), flush=True)
    alone = reorder_alone(args.alone_calls)
    lines += ["", f"The reorder by itself (one [64, 64, 4, 64] float32 layer, {args.alone_calls} "
              "interleaved calls):", "", "| reorder | min us | 10th percentile us | median us |",
              "|---|---:|---:|---:|"]
    for row in alone:
        lines.append(f"| {row['reorder']} | {row['min_us']:.0f} | {row['p10_us']:.0f} | "
                     f"{row['median_us']:.0f} |")
        print(json.dumps(row), flush=True)
    lines += ["", "Command: `python " + " ".join(["benchmarks/beam_reorder.py"] + sys.argv[1:])
              + "`"]
    out = ROOT / "benchmarks/results"
    out.mkdir(parents=True, exist_ok=True)
    report = {"cpu": info, "rows": rows, "alone": alone}
    (out / "beam_reorder.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "beam_reorder.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
