"""How fast a decode step can read its weights on this CPU: matmuls with 1 and 8 rows.

    python benchmarks/matmul_rows.py            # about a minute; torch columns if installed

A decode step multiplies each weight matrix by one row per sequence (batch 1: a matrix-vector
product; batch 8: 8 rows), so its speed is how fast the matmul streams the weights from memory.
This measures that rate directly: a chain of five 1536 x 1536 float32 kernels (47 MB, more than
the L3 cache) applied inside one jitted loop, as `x @ W` with W stored [in, out] (tfm's layout)
and with W stored transposed, [out, in] (made by a separate jit, so it is a real array the loop
reads), next to the memory bandwidth of a plain reduction (jax, all cores; numpy, one core) and,
when torch is installed, the same chain in torch (what Hugging Face `generate` runs).

Repeats interleave the variants; figures are medians. Writes
benchmarks/results/matmul_rows.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tfm.kernels import hardware

ROOT = Path(__file__).resolve().parents[1]

SIZE, KERNELS, STEPS = 1536, 5, 20


def jax_chain(rows: int, transposed: bool):
    """A function that runs STEPS passes of x -> tanh(x W) over the chain; returns it with its
    inputs."""
    kernels = [
        jax.random.normal(jax.random.PRNGKey(i), (SIZE, SIZE), jnp.float32) * 0.02
        for i in range(KERNELS)
    ]
    if transposed:
        kernels = jax.jit(lambda ks: [k.T for k in ks])(kernels)
    spec = "mk,nk->mn" if transposed else "mk,kn->mn"

    @jax.jit
    def run(x, kernels):
        def step(_, x):
            for kernel in kernels:
                x = jnp.tanh(jnp.einsum(spec, x, kernel))
            return x

        return jax.lax.fori_loop(0, STEPS, step, x)

    x = jnp.ones((rows, SIZE), jnp.float32) * 0.01
    return lambda: run(x, kernels).block_until_ready()


def torch_chain(rows: int):
    import torch

    kernels = [torch.randn(SIZE, SIZE) * 0.02 for _ in range(KERNELS)]
    x0 = torch.full((rows, SIZE), 0.01)

    def run():
        with torch.no_grad():
            x = x0
            for _ in range(STEPS):
                for kernel in kernels:
                    x = torch.tanh(x @ kernel)
        return x

    return run


def bandwidths() -> dict:
    data = np.ones((128 * 1024 * 1024,), np.float32)  # 512 MiB
    on_jax = jnp.asarray(data)
    total = jax.jit(jnp.sum)
    total(on_jax).block_until_ready()
    timed = {"jax_sum_all_cores": lambda: total(on_jax).block_until_ready(),
             "numpy_sum_one_core": data.sum}
    out = {}
    for name, fn in timed.items():
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        out[name] = data.nbytes / min(times) / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    try:
        import torch  # noqa: F401

        has_torch = True
    except ImportError:
        has_torch = False
    info = hardware.cpu_features()
    print(json.dumps(info))
    bandwidth = bandwidths()
    print(json.dumps(bandwidth))
    variants = {}
    for rows in (1, 8):
        variants[f"tfm layout [in, out], {rows} row(s)"] = (rows, jax_chain(rows, False))
        variants[f"transposed [out, in], {rows} row(s)"] = (rows, jax_chain(rows, True))
        if has_torch:
            variants[f"torch x @ W, {rows} row(s)"] = (rows, torch_chain(rows))
    times = {name: [] for name in variants}
    for _, fn in variants.values():
        fn()  # compile / warm up
    for _ in range(args.repeats):
        for name, (_, fn) in variants.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    weight_bytes = KERNELS * SIZE * SIZE * 4
    rows_out = []
    for name, (rows, _) in variants.items():
        seconds = statistics.median(times[name]) / STEPS  # one pass over the chain
        row = {"variant": name, "rows": rows, "ms_per_pass": seconds * 1e3,
               "weight_GB_per_s": weight_bytes / seconds / 1e9,
               "GFLOP_per_s": 2 * rows * SIZE * SIZE * KERNELS / seconds / 1e9}
        rows_out.append(row)
        print(json.dumps(row), flush=True)
    lines = [
        "# Weight-read rate of 1- and 8-row matmuls (a decode step's matmuls)", "",
        f"{hardware.cpu_line(info)}; jax {jax.__version__}.",
        f"Memory bandwidth (512 MiB sum): {bandwidth['jax_sum_all_cores']:.1f} GB/s jax (all "
        f"cores), {bandwidth['numpy_sum_one_core']:.1f} GB/s numpy (one core).",
        f"Chain: {KERNELS} float32 kernels of {SIZE} x {SIZE} ({weight_bytes / 1e6:.0f} MB), "
        f"median of {args.repeats} interleaved repeats of {STEPS} passes.", "",
        "| variant | ms per pass | weights read GB/s | GFLOP/s |", "|---|---:|---:|---:|",
    ]
    lines += [f"| {r['variant']} | {r['ms_per_pass']:.2f} | {r['weight_GB_per_s']:.1f} | "
              f"{r['GFLOP_per_s']:.1f} |" for r in rows_out]
    lines += ["", "Command: `python benchmarks/matmul_rows.py`"]
    out = ROOT / "benchmarks/results"
    out.mkdir(parents=True, exist_ok=True)
    (out / "matmul_rows.json").write_text(json.dumps(
        {"cpu": info, "bandwidth_GB_per_s": bandwidth, "rows": rows_out}, indent=1) + "\n")
    (out / "matmul_rows.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
