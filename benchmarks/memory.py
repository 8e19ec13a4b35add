"""Per-device memory of the paper's base model train step, on one device and sharded over 8.

The train step is the one `./launch.sh train` runs (tfm.training.train.state_shardings + jit_steps:
explicit in/out shardings, donated state), lowered with abstract inputs (jax.ShapeDtypeStruct
carrying the shardings) and compiled; nothing of the ~65M-parameter state is allocated.
Figures are XLA's `compiled.memory_analysis()` for one device's SPMD program:

  arguments  train state + batch shard held by a device (the input buffers)
  outputs    new state + metrics; the donated state is reused in place (aliased)
  temp       activations, gradients and workspace XLA allocates during the step
  peak       arguments + outputs - aliased + temp (an upper bound of live memory)

Model: tfm.nn.config.paper_base(37000) EncoderDecoder (6+6 layers, d_model 512, d_ff 2048, 8 heads,
shared 37k embeddings, dropout 0.1), Adam (the paper's, mu and nu in float32), label smoothing
0.1, float32 everywhere; batch 8 x 64 source and 64 target tokens by default.

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/memory.py
    python benchmarks/memory.py --meshes one,fsdp8 --batch 8 --seq_len 64

Writes benchmarks/results/memory.{json,md}. Simulated CPU devices stand in for accelerators:
the partitioning (who holds what) is the same XLA SPMD result; absolute temp sizes on a GPU/TPU
differ with fusion and layout choices.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402

from tfm.data.pipeline import feature_lengths  # noqa: E402
from tfm.nn.config import paper_base  # noqa: E402
from tfm.parallel import sharding  # noqa: E402
from tfm.training import optim, train  # noqa: E402
from tfm.training.experiment import (  # noqa: E402
    EvalConfig,
    Experiment,
    GenerateConfig,
    TrainConfig,
    state_shardings,
)

REPO = Path(__file__).resolve().parents[1]

MESHES = {
    "one": {"data": 1, "fsdp": 1, "tensor": 1},
    "data8": {"data": 8, "fsdp": 1, "tensor": 1},
    "fsdp8": {"data": 1, "fsdp": 8, "tensor": 1},
    "2x2x2": {"data": 2, "fsdp": 2, "tensor": 2},
    "tensor8": {"data": 1, "fsdp": 1, "tensor": 8},
}
MIB = 2**20


def experiment(mesh_name: str, batch: int, seq_len: int, scan_layers: bool) -> Experiment:
    """An Experiment for the paper-base model without a data pipeline: the memory of a step
    depends only on batch shapes, so a stand-in gives the train lengths and batch size."""
    model_config = paper_base(37000).replace(scan_layers=scan_layers)
    devices = jax.devices()[:1] if mesh_name == "one" else jax.devices()[:8]
    mesh = sharding.make_mesh(MESHES[mesh_name], devices)
    rules = sharding.resolve_rules()
    sharding.check_divisibility(model_config, mesh, batch, rules)
    config = ml_collections.ConfigDict({"optimizer": {"name": "adam_paper"}})
    optimizer_config = optim.OptimizerConfig.from_config(config.optimizer)
    optimizer, schedule = optim.make_optimizer(optimizer_config, d_model=model_config.d_model)
    data = types.SimpleNamespace(
        train_lengths=feature_lengths(seq_len, seq_len),
        config=types.SimpleNamespace(batch_size=batch, seq_len=seq_len),
    )
    return Experiment(
        config=config,
        workdir=Path("/nonexistent"),
        model_config=model_config,
        mode="seq2seq",
        data=data,  # type: ignore[arg-type]
        train=TrainConfig(label_smoothing=0.1),
        eval=EvalConfig(),
        generate=GenerateConfig(),
        optimizer_config=optimizer_config,
        optimizer=optimizer,
        schedule=schedule,
        mesh=mesh,
        rules=rules,
    )


def abstract_batch(exp: Experiment, batch: int, seq_len: int) -> dict:
    """The training batch as ShapeDtypeStructs split over the batch axes (as shard_batch does)."""
    spec = sharding.batch_sharding(exp.mesh, exp.rules)
    keys = ("source", "source_positions", "source_segment_ids", "inputs", "targets", "positions",
            "segment_ids")
    out = {key: jax.ShapeDtypeStruct((batch, seq_len), jnp.int32, sharding=spec) for key in keys}
    out["weights"] = jax.ShapeDtypeStruct((batch, seq_len), jnp.float32, sharding=spec)
    return out


def shard_bytes(tree: dict) -> tuple[int, int]:
    """(total bytes, bytes of one device's shards) of a tree of sharded ShapeDtypeStructs."""
    total = per_device = 0
    for leaf in jax.tree.leaves(tree):
        size = jnp.dtype(leaf.dtype).itemsize
        total += math.prod(leaf.shape) * size
        per_device += math.prod(leaf.sharding.shard_shape(leaf.shape)) * size
    return total, per_device


def measure(mesh_name: str, batch: int, seq_len: int, scan_layers: bool) -> dict:
    exp = experiment(mesh_name, batch, seq_len, scan_layers)
    abstract, shardings = state_shardings(exp)
    train_step, _ = train.jit_steps(exp, shardings)
    start = time.perf_counter()
    compiled = train_step.lower(abstract, abstract_batch(exp, batch, seq_len)).compile()
    compile_s = time.perf_counter() - start
    stats = compiled.memory_analysis()
    params_total, params_device = shard_bytes(abstract.params)
    state_total, state_device = shard_bytes(abstract)
    row = {
        "mesh": mesh_name,
        "mesh_shape": dict(exp.mesh.shape),
        "devices": exp.mesh.size,
        "num_params": sum(math.prod(x.shape) for x in jax.tree.leaves(abstract.params)),
        "params_mib_total": params_total / MIB,
        "params_mib_per_device": params_device / MIB,
        "state_mib_per_device": state_device / MIB,
        "state_mib_total": state_total / MIB,
        "argument_mib": stats.argument_size_in_bytes / MIB,
        "output_mib": stats.output_size_in_bytes / MIB,
        "alias_mib": stats.alias_size_in_bytes / MIB,
        "temp_mib": stats.temp_size_in_bytes / MIB,
        "code_mib": stats.generated_code_size_in_bytes / MIB,
        "compile_s": compile_s,
        "query_kernel_spec": str(
            shardings.params["encoder"]["stack"]["layer_0" if not scan_layers else "layers"][
                "self_attention"]["query"]["kernel"].spec
        ),
    }
    row["peak_mib"] = row["argument_mib"] + row["output_mib"] - row["alias_mib"] + row["temp_mib"]
    return row


def markdown(rows: list[dict], args: argparse.Namespace) -> str:
    base = next((r for r in rows if r["mesh"] == "one"), None)
    lines = [
        "# Per-device memory of the paper-base train step (compiled memory analysis)",
        "",
        f"Model: paper_base(37000) EncoderDecoder, {rows[0]['num_params'] / 1e6:.1f}M "
        f"parameters ({rows[0]['params_mib_total']:.0f} MiB float32), Adam (mu, nu float32), "
        f"label smoothing 0.1, dropout 0.1; batch {args.batch} x {args.seq_len} source + "
        f"{args.seq_len} target tokens; scan_layers={args.scan_layers}. "
        f"Simulated CPU devices (jax {jax.__version__}, {platform.machine()}).",
        "",
        "| mesh (data x fsdp x tensor) | devices | params / device | state / device | "
        "arguments | outputs | aliased | temp | peak | peak vs 1 device | query kernel spec |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        shape = " x ".join(str(r["mesh_shape"][a]) for a in sharding.MESH_AXES)
        ratio = f"{r['peak_mib'] / base['peak_mib']:.2f}" if base else "-"
        lines.append(
            f"| {r['mesh']} ({shape}) | {r['devices']} | {r['params_mib_per_device']:.1f} | "
            f"{r['state_mib_per_device']:.1f} | {r['argument_mib']:.1f} | {r['output_mib']:.1f} | "
            f"{r['alias_mib']:.1f} | {r['temp_mib']:.1f} | {r['peak_mib']:.1f} | {ratio} | "
            f"`{r['query_kernel_spec']}` |"
        )
    lines += [
        "",
        "MiB per device. state = params + Adam mu/nu + step + rng (from the shardings); "
        "arguments = state + batch shard as XLA sees them; outputs alias the donated state; "
        "peak = arguments + outputs - aliased + temp.",
        "",
        "Command: `XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/memory.py"
        + (f" --meshes {args.meshes}" if args.meshes != DEFAULT_MESHES else "")
        + (f" --batch {args.batch}" if args.batch != 8 else "")
        + (f" --seq_len {args.seq_len}" if args.seq_len != 64 else "")
        + (" --scan_layers" if args.scan_layers else "")
        + "`",
        "",
    ]
    return "\n".join(lines)


DEFAULT_MESHES = "one,data8,fsdp8"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--meshes", default=DEFAULT_MESHES,
                        help=f"comma-separated, from: {', '.join(MESHES)}")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--scan_layers", action="store_true")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    names = [name for name in args.meshes.split(",") if name]
    unknown = [name for name in names if name not in MESHES]
    if unknown:
        parser.error(f"--meshes: {unknown[0]!r} is unknown; choose from {', '.join(MESHES)}")
    if jax.device_count() < 8 and any(name != "one" for name in names):
        parser.error(f"{jax.device_count()} device(s); run with "
                     "XLA_FLAGS=--xla_force_host_platform_device_count=8")
    rows = []
    for name in names:
        rows.append(measure(name, args.batch, args.seq_len, args.scan_layers))
        r = rows[-1]
        print(f"{name}: peak {r['peak_mib']:.1f} MiB/device (args {r['argument_mib']:.1f}, "
              f"temp {r['temp_mib']:.1f}), compiled in {r['compile_s']:.0f} s", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(rows, indent=2))
    (out / "memory.md").write_text(markdown(rows, args))
    print(markdown(rows, args))


if __name__ == "__main__":
    main()
