"""Decode attention over the whole cache against attention over only its filled blocks.

    python benchmarks/decode_attention.py [--batch 8] [--max_len 1032] [--block 256]

One decode step's attention core for every layer (a [batch, heads, 1, head_dim] query against
per-layer key/value buffers in tfm/nn/cache.py's layout), timed two ways at several fill levels:
- full: one matmul pair over all max_len slots (empty ones masked), what tfm does;
- blockwise: a fori_loop over ceil(filled / block) slot blocks with an online softmax, which
  reads only the filled part of the cache but slices each block out of the buffer.
On XLA CPU the block slices are materialised (copied) before each matmul, so blockwise reads
the filled part twice; this script measures whether that still wins. Prints the CPU, the times
and their ratio; writes benchmarks/results/decode_attention.json.
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


def attend_full(query, keys, values, filled):
    # query: [batch, heads, 1, head_dim]; keys: [batch, heads, head_dim, slots];
    # values: [batch, heads, slots, head_dim]; filled: [] int32
    scores = jnp.einsum("bhqd,bhds->bhqs", query, keys)
    scores = jnp.where(jnp.arange(keys.shape[-1]) < filled, scores, -jnp.inf)
    return jnp.einsum("bhqs,bhsd->bhqd", jax.nn.softmax(scores, -1), values)


def attend_blockwise(query, keys, values, filled, block):
    def step(index, carry):
        running_max, total, out = carry
        start = index * block
        key_block = jax.lax.dynamic_slice_in_dim(keys, start, block, 3)
        value_block = jax.lax.dynamic_slice_in_dim(values, start, block, 2)
        scores = jnp.einsum("bhqd,bhds->bhqs", query, key_block)
        scores = jnp.where(start + jnp.arange(block) < filled, scores, -jnp.inf)
        new_max = jnp.maximum(running_max, scores.max(-1, keepdims=True))
        weights = jnp.exp(scores - new_max)
        correction = jnp.exp(running_max - new_max)
        return (
            new_max,
            total * correction + weights.sum(-1, keepdims=True),
            out * correction + jnp.einsum("bhqs,bhsd->bhqd", weights, value_block),
        )

    shape = query.shape[:3]
    init = (jnp.full((*shape, 1), -jnp.inf), jnp.zeros((*shape, 1)), jnp.zeros(query.shape))
    _, total, out = jax.lax.fori_loop(0, (filled + block - 1) // block, step, init)
    return out / total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--max_len", type=int, default=1032)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    if args.max_len % args.block:
        args.max_len += args.block - args.max_len % args.block  # whole blocks only
    print(hardware.cpu_features())
    rng = jax.random.PRNGKey(0)
    shape = (args.batch, args.heads)
    keys = [jax.random.normal(jax.random.fold_in(rng, i), (*shape, args.head_dim, args.max_len))
            for i in range(args.layers)]
    values = [jax.random.normal(jax.random.fold_in(rng, 100 + i),
                                (*shape, args.max_len, args.head_dim)) for i in range(args.layers)]
    query = jax.random.normal(rng, (*shape, 1, args.head_dim)) * args.head_dim**-0.5

    def every_layer(attend):
        def run(query, keys, values, filled):
            for layer_keys, layer_values in zip(keys, values, strict=True):
                query = attend(query, layer_keys, layer_values, filled)
            return query
        return jax.jit(run)

    full = every_layer(attend_full)
    blockwise = every_layer(lambda *a: attend_blockwise(*a, args.block))
    rows = []
    for fraction in (0.125, 0.25, 0.5, 0.75, 1.0):
        filled = jnp.int32(max(1, round(fraction * args.max_len)))
        np.testing.assert_allclose(full(query, keys, values, filled),
                                   blockwise(query, keys, values, filled), rtol=1e-4, atol=1e-4)
        times = {"full": [], "blockwise": []}
        for _ in range(args.repeats):  # interleaved, medians: the machine may be shared
            for name, fn in (("full", full), ("blockwise", blockwise)):
                start = time.perf_counter()
                fn(query, keys, values, filled).block_until_ready()
                times[name].append(time.perf_counter() - start)
        row = {"filled": int(filled), **{k: statistics.median(v) * 1e3 for k, v in times.items()}}
        row["blockwise_over_full"] = row["blockwise"] / row["full"]
        rows.append(row)
        print(f"filled {row['filled']:5d}/{args.max_len}: full {row['full']:.2f} ms, "
              f"blockwise {row['blockwise']:.2f} ms, ratio {row['blockwise_over_full']:.2f}")
    mean = statistics.mean(r["blockwise_over_full"] for r in rows)
    print(f"mean ratio over the fill levels (a generation sweeps them all): {mean:.2f}")
    out = ROOT / "benchmarks/results/decode_attention.json"
    out.write_text(json.dumps({"cpu": hardware.cpu_features(), "args": vars(args), "rows": rows,
                               "mean_blockwise_over_full": mean}, indent=1))
    print("wrote", out.relative_to(ROOT))


if __name__ == "__main__":
    main()
