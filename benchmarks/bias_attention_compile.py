"""One attention layer's forward and backward with a position bias (ALiBi or T5 buckets),
compiled for one chip of a target this machine does not have (`launch.sh compile`'s targets),
three ways side by side:

- reference: tfm.nn.attention with the bias and causal mask written out ([batch, heads, T, T]);
- materialised: a flash kernel fed the written-out bias (on TPU jax's Pallas flash attention
  with `ab`; on GPU cuDNN through jax.nn.dot_product_attention, ALiBi only: cuDNN's bias
  gradient is not trusted for T5, jax-ml/jax#27184);
- flex: tfm.kernels.flex_attention, the bias computed per block in the kernel (TPU only).

Prints and saves (JSON + markdown) per length: temporaries, whether the layer fits the chip,
compiled FLOPs and bytes, and the roofline time. Compiled, not measured, figures.

    python benchmarks/bias_attention_compile.py --target v5e-8 --scheme t5_bias \\
        --lengths 1024,8192,32768 --out benchmarks/results/compile_targets/bias_attention_v5e
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tfm import kernels
from tfm.kernels.call import AttentionStructure, BlockBias
from tfm.kernels.hardware import CHIPS
from tfm.nn import attention as reference
from tfm.nn import positions as P
from tfm.training import compile_report

HEADS, HEAD_DIM, BUCKETS, MAX_DISTANCE = 12, 64, 32, 128


def _bias_parts(scheme: str):
    """(block function, parameters [heads, P], learned) of the scheme."""
    if scheme == "alibi":
        return P.alibi_block_bias, (jnp.asarray(P.alibi_slopes(HEADS))[:, None],), False
    function = functools.partial(P.t5_block_bias, bidirectional=False, num_buckets=BUCKETS,
                                 max_distance=MAX_DISTANCE)
    return function, (jnp.zeros((HEADS, BUCKETS), jnp.float32),), True


def _loss(way: str, scheme: str, query, key, value, params):
    """sum(attention * probe-like weights) for one layer; grads w.r.t. q, k, v and params."""
    batch, length = query.shape[:2]
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    function, _, learned = _bias_parts(scheme)
    if way == "flex":
        structure = AttentionStructure(True, None, None, None, BlockBias(
            function, params, positions, positions, learned=learned))
        out = kernels.attention(query, key, value, backend="flex", structure=structure)
        return jnp.sum(out.astype(jnp.float32) ** 2)
    bias = P.dense_from_blocks(function, params, positions, positions)  # [B, N, T, T]
    if way == "reference":
        mask = reference.causal_mask(positions, positions)
        out = reference.dot_product_attention(query, key, value, bias=bias, mask=mask)
    elif jax.sharding.get_abstract_mesh().abstract_device.platform == "tpu":
        from jax.experimental.pallas.ops.tpu.flash_attention import flash_attention

        heads_major = lambda x: x.transpose(0, 2, 1, 3)
        out = heads_major(flash_attention(
            heads_major(query), heads_major(key), heads_major(value), ab=bias.astype(query.dtype),
            causal=True, sm_scale=HEAD_DIM**-0.5))
    else:
        out = jax.nn.dot_product_attention(query, key, value, bias=bias.astype(query.dtype),
                                           is_causal=True, implementation="cudnn")
    return jnp.sum(out.astype(jnp.float32) ** 2)


def compile_one(way: str, scheme: str, length: int, batch: int, target: str) -> dict:
    spec, devices = compile_report.target_devices(target)
    mesh = jax.sharding.Mesh(np.asarray(devices[:1]), ("chip",))
    where = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    array = lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=where)
    qkv = [array((batch, length, HEADS, HEAD_DIM)) for _ in "qkv"]
    _, params, learned = _bias_parts(scheme)
    params = jax.tree.map(lambda p: array(p.shape, p.dtype), params)
    arguments = (0, 1, 2, 3) if learned else (0, 1, 2)
    step = jax.jit(jax.grad(functools.partial(_loss, way, scheme), arguments))
    row = {"way": way, "scheme": scheme, "tokens": length, "batch": batch, "target": target}
    try:
        with jax.set_mesh(mesh), jax.default_matmul_precision("default"):
            compiled = step.lower(*qkv, params).compile()
    except Exception as error:  # noqa: BLE001 - the compiler's out-of-memory verdict
        text = str(error)
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        row.update(fits=False, note=next(line for line in text.splitlines()
                                         if "RESOURCE_EXHAUSTED" in line).strip()[:200])
        return row
    memory = compiled.memory_analysis()
    chip = CHIPS[spec.chip]
    row.update(temp_bytes=memory.temp_size_in_bytes, fits=memory.temp_size_in_bytes
               + memory.argument_size_in_bytes + memory.output_size_in_bytes <= chip.hbm_bytes)
    cost = compile_report._cost(compiled)
    if cost:
        row.update(flops=cost["flops"], bytes=cost["bytes accessed"],
                   roofline_ms=1e3 * max(cost["flops"] / chip.peak_flops,
                                         cost["bytes accessed"] / chip.hbm_bandwidth))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="v5e-8")
    parser.add_argument("--scheme", default="alibi", choices=("alibi", "t5_bias"))
    parser.add_argument("--lengths", default="1024,8192,32768")
    parser.add_argument("--tokens_per_chip", type=int, default=8192)
    parser.add_argument("--ways", default="reference,materialised,flex")
    parser.add_argument("--out", default=None, help="path stem for .json and .md")
    args = parser.parse_args()
    rows = []
    for length in (int(n) for n in args.lengths.split(",")):
        batch = max(1, args.tokens_per_chip // length)
        for way in args.ways.split(","):
            row = compile_one(way, args.scheme, length, batch, args.target)
            rows.append(row)
            print(json.dumps(row), flush=True)
    lines = [f"{args.scheme}, one attention layer fwd+bwd, {HEADS} heads x {HEAD_DIM}, bf16, "
             f"one chip of {args.target} (compiled, not measured)", "",
             "| tokens | batch | way | temporaries | fits | traffic | roofline |",
             "|---:|---:|---|---:|---|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['tokens']:,} | {row['batch']} | {row['way']} | "
            + (f"{row['temp_bytes'] / 1e9:.2f} GB" if "temp_bytes" in row else "-")
            + f" | {'yes' if row['fits'] else 'no'} | "
            + (f"{row['bytes'] / 1e9:.2f} GB | {row['roofline_ms']:.2f} ms |" if "bytes" in row
               else "- | - |"))
    print("\n".join(lines))
    if args.out:
        Path(args.out).with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
        Path(args.out).with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
