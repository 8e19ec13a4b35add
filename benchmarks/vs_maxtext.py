"""Bytes per chip of GPT-2 train steps against MaxText's, compiled for the same TPU (issue
46): GPT-2 small (12 layers, d_model 768, 12 heads, d_ff 3,072) and medium (24 layers, d_model
1,024, 16 heads, d_ff 4,096), vocabulary 50,304, learned positions, bfloat16 compute with
float32 weights and AdamW, no dropout, 8 x 1,024 tokens per chip, `v5e-8`, deviceless (libtpu:
`pip install -e ".[tpu]"`).

    python benchmarks/wide_vocab_text.py /tmp/wide_vocab.txt --vocab 50304
    python benchmarks/vs_maxtext.py --text /tmp/wide_vocab.txt [--rows data8,medium_fsdp8] \\
        [--maxtext_dir ~/maxtext --maxtext_python ~/maxtext-venv/bin/python]

Each tfm row is one `./launch.sh compile configs/char_lm.py --target v5e-8 ... --json FILE
--breakdown` (printed before it runs; a few minutes each on a 2-core host), with XLA's
windowed einsums off as for MaxText (`--windowed_einsum` keeps them). MaxText rows are
compiled only when its checkout and a Python environment with its requirements are given
(MaxText at commit e591f30c wants Python >= 3.12; those of the shapes of the tfm rows asked
for): its `train_compile` with layers unrolled and windowed einsums off, since XLA's cost
analysis counts a loop body once. Writes
benchmarks/results/vs_maxtext.{json,md}.

MFU follows the issue's convention: model FLOPs 6 N + 12 L T d per token (N: matmul
parameters with the tied output layer, 123.6M small, 353.5M medium), over the roofline step
max(FLOPs / 197 TFLOP/s, bytes / 819 GB/s), FLOPs being XLA's cost analysis, which leaves
splash attention out (it declares no cost) for both systems. tfm's rows also print the MFU with
splash's FLOPs added (its compile report counts them: `kernel_flops_per_chip`), which is lower
where the recomputed forward pass of `remat=full` makes a step compute-bound.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"

PEAK_FLOPS, HBM_BANDWIDTH = 197e12, 819e9  # TPU v5e, per chip
VOCAB, SEQ_LEN, TOKENS_PER_CHIP = 50304, 1024, 8 * 1024


@dataclasses.dataclass(frozen=True)
class Shape:
    """A GPT-2 body (learned positions, tied output layer, head_dim 64)."""

    layers: int
    d_model: int
    heads: int
    d_ff: int

    @property
    def matmul_params(self) -> float:  # attention, FFN and the tied output layer
        return self.layers * (4 * self.d_model**2 + 2 * self.d_model * self.d_ff) \
            + VOCAB * self.d_model

    @property
    def model_flops_per_chip(self) -> float:  # the 6 N + 12 L T d per token
        return (6 * self.matmul_params
                + 12 * self.layers * SEQ_LEN * self.d_model) * TOKENS_PER_CHIP


SHAPES = {"small": Shape(12, 768, 12, 3072), "medium": Shape(24, 1024, 16, 4096)}


def tfm_shape(shape: Shape) -> list[str]:
    return [f"--config.model.d_model={shape.d_model}", f"--config.model.num_heads={shape.heads}",
            f"--config.model.d_ff={shape.d_ff}",
            f"--config.model.num_decoder_layers={shape.layers}",
            "--config.data.seq_len=1024", "--config.data.batch_size=64",
            "--config.model.dtype=bfloat16", "--config.model.dropout_rate=0.0",
            "--config.model.position_scheme=learned", "--config.model.max_len=1024"]


FSDP = ["--config.mesh.data=1", "--config.mesh.fsdp=8"]
REMAT_FULL = ["--config.model.remat=full"]

# name -> (shape, mesh, remat, extra flags)
TFM_ROWS = {
    "data8": ("small", "data=8", "none", []),
    "data8_full": ("small", "data=8", "full", REMAT_FULL),
    "fsdp8": ("small", "fsdp=8", "none", FSDP),
    "fsdp8_full": ("small", "fsdp=8", "full", FSDP + REMAT_FULL),
    "medium_fsdp8": ("medium", "fsdp=8", "none", FSDP),
    "medium_fsdp8_full": ("medium", "fsdp=8", "full", FSDP + REMAT_FULL),
}
# name -> (shape, remat policy)
MAXTEXT_ROWS = {
    "maxtext_fsdp8_minimal": ("small", "minimal_with_context"),
    "maxtext_fsdp8_full": ("small", "full"),
    "maxtext_medium_fsdp8_minimal": ("medium", "minimal_with_context"),
    "maxtext_medium_fsdp8_full": ("medium", "full"),
}


def maxtext_shape(shape: Shape) -> list[str]:
    return [f"base_num_decoder_layers={shape.layers}", f"base_emb_dim={shape.d_model}",
            f"base_num_query_heads={shape.heads}", f"base_num_kv_heads={shape.heads}",
            f"base_mlp_dim={shape.d_ff}"]


MAXTEXT_FLAGS = [
    "compile_topology=v5e-8", "compile_topology_num_slices=1",
    "head_dim=64", "vocab_size=50304", "max_target_length=1024", "per_device_batch_size=8",
    "dtype=bfloat16", "weight_dtype=float32", "dropout_rate=0.0", "enable_dropout=false",
    "dataset_type=synthetic", "decoder_block=gpt3", "trainable_position_size=1024",
    "mlp_activations=[gelu]", "logits_via_embedding=true", "normalize_embedding_logits=false",
    "use_iota_embed=false", "fused_qkv=true", "attention=flash", "scan_layers=false",
]
MAXTEXT_LIBTPU_ARGS = ("--xla_tpu_enable_windowed_einsum_for_all_gather=false "
                       "--xla_tpu_enable_windowed_einsum_for_reduce_scatter=false")


def roofline(bytes_per_chip: float, flops_per_chip: float, shape: Shape
             ) -> tuple[float, float]:
    """(roofline step seconds, MFU at most) by the issue's convention."""
    step = max(flops_per_chip / PEAK_FLOPS, bytes_per_chip / HBM_BANDWIDTH)
    return step, shape.model_flops_per_chip / (step * PEAK_FLOPS)


def tfm_row(name: str, text: str, workdir: Path, windowed_einsum: bool) -> dict:
    model, mesh, remat, extra = TFM_ROWS[name]
    out = workdir / f"{name}.json"
    command = ["./launch.sh", "compile", "configs/char_lm.py", "--target", "v5e-8",
               f"--config.data.path={text}", *tfm_shape(SHAPES[model]), *extra,
               "--json", str(out), "--breakdown", "--workdir", str(workdir / name)]
    print("$", shlex.join(command), flush=True)
    start = time.time()
    # Deviceless compiles use no chip: several may load libtpu at once.
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    if not windowed_einsum:  # as MaxText's rows are compiled
        env["LIBTPU_INIT_ARGS"] = MAXTEXT_LIBTPU_ARGS
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    if result.returncode != 0 and not out.exists():
        raise SystemExit(f"{name}: compile failed:\n{result.stderr[-3000:]}")
    report = json.loads(out.read_text())
    # XLA's own count, as MaxText's rows have it: the compile report adds splash's FLOPs
    xla_flops = report["compiled_flops_per_chip"] - report["kernel_flops_per_chip"]
    step, mfu = roofline(report["bytes_per_chip"], xla_flops, SHAPES[model])
    step_with_kernel, mfu_with_kernel = roofline(
        report["bytes_per_chip"], report["compiled_flops_per_chip"], SHAPES[model])
    groups = {group: figures["bytes"] for group, figures in
              report.get("breakdown", {}).get("groups", {}).items()}
    return {"row": name, "system": "tfm", "model": model, "mesh": mesh, "remat": remat,
            "windowed_einsum": windowed_einsum,
            "bytes_per_chip": report["bytes_per_chip"],
            "compiled_flops_per_chip": xla_flops,
            "kernel_flops_per_chip": report["kernel_flops_per_chip"],
            "roofline_ms": 1e3 * step, "mfu": mfu,
            "roofline_ms_with_kernel": 1e3 * step_with_kernel, "mfu_with_kernel": mfu_with_kernel,
            "needed_bytes": report["needed_bytes"],
            "bytes_by_group": groups, "command": shlex.join(command),
            "compile_seconds": round(time.time() - start, 1)}


def maxtext_row(name: str, maxtext_dir: Path, python: str) -> dict:
    model, remat = MAXTEXT_ROWS[name]
    command = [python, "-m", "maxtext.trainers.pre_train.train_compile", *MAXTEXT_FLAGS,
               *maxtext_shape(SHAPES[model]), f"remat_policy={remat}"]
    env = {**os.environ, "DECOUPLE_GCLOUD": "TRUE", "LIBTPU_INIT_ARGS": MAXTEXT_LIBTPU_ARGS,
           "PYTHONPATH": str(maxtext_dir / "src")}
    print("$", shlex.join(command), flush=True)
    result = subprocess.run(command, cwd=maxtext_dir, capture_output=True, text=True, env=env)
    output = result.stdout + result.stderr
    found = {key: re.search(rf"'{key}': ([0-9.e+]+)", output)
             for key in ("bytes accessed", "flops")}
    if result.returncode != 0 or not all(found.values()):
        raise SystemExit(f"{name}: MaxText's compile gave no cost analysis:\n{output[-3000:]}")
    bytes_per_chip, flops = (float(found[key].group(1)) for key in ("bytes accessed", "flops"))
    step, mfu = roofline(bytes_per_chip, flops, SHAPES[model])
    # memory_analysis(), as compile_report counts it: arguments + outputs - aliased + temporaries
    memory = {key: int(match.group(1)) for key in ("argument", "output", "alias", "temp")
              if (match := re.search(rf"{key}_size_in_bytes=(\d+)", output))}
    needed = (memory["argument"] + memory["output"] - memory["alias"] + memory["temp"]
              if len(memory) == 4 else None)
    return {"row": name, "system": "MaxText", "model": model, "mesh": "fsdp=8", "remat": remat,
            "bytes_per_chip": bytes_per_chip, "compiled_flops_per_chip": flops,
            "roofline_ms": 1e3 * step, "mfu": mfu, "needed_bytes": needed,
            "command": shlex.join(command)}


def _windowed(row: dict) -> str:
    return "on" if row.get("windowed_einsum") else "off"


def markdown(rows: list[dict]) -> str:
    lines = ["| step (per v5e chip) | GPT-2 | mesh | remat | windowed einsums | memory "
             "| bytes accessed | roofline step | MFU at most | with splash's FLOPs |",
             "|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        label = ("MaxText, splash, layers unrolled" if row["system"] == "MaxText"
                 else "tfm, splash, fused loss")
        memory = (f"{row['needed_bytes'] / 1e9:.2f} GB" if row.get("needed_bytes")
                  else "-")
        with_kernel = (f"{row['roofline_ms_with_kernel']:.1f} ms, "
                       f"{100 * row['mfu_with_kernel']:.1f}%" if "mfu_with_kernel" in row
                       else "-")
        lines.append(f"| {label} | {row.get('model', 'small')} | {row['mesh']} | "
                     f"`{row['remat']}` | {_windowed(row)} | {memory} | "
                     f"{row['bytes_per_chip'] / 1e9:.1f} GB | {row['roofline_ms']:.1f} ms | "
                     f"{100 * row['mfu']:.1f}% | {with_kernel} |")
    groups = sorted({group for row in rows for group in row.get("bytes_by_group", {})})
    if groups:
        lines += ["", "tfm's bytes by part of the step (`--breakdown`), GB per chip:", "",
                  "| row | windowed einsums | " + " | ".join(groups) + " |",
                  "|---|---|" + "---:|" * len(groups)]
        lines += [f"| {row['row']} | {_windowed(row)} | " + " | ".join(
            f"{row['bytes_by_group'].get(group, 0) / 1e9:.2f}" for group in groups) + " |"
                  for row in rows if row.get("bytes_by_group")]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", default="/tmp/wide_vocab.txt",
                        help="benchmarks/wide_vocab_text.py's output (--vocab 50304)")
    parser.add_argument("--rows", default=",".join(TFM_ROWS),
                        help=f"tfm rows, of: {', '.join(TFM_ROWS)}")
    parser.add_argument("--maxtext_dir", type=Path, help="a MaxText checkout (commit e591f30c)")
    parser.add_argument("--maxtext_python", help="a Python with MaxText's requirements")
    parser.add_argument("--windowed_einsum", action="store_true",
                        help="compile the tfm rows with XLA's windowed einsums (its default); "
                        "off by default, as MaxText's rows are compiled")
    parser.add_argument("--out", type=Path, default=RESULTS / "vs_maxtext")
    args = parser.parse_args()
    if not Path(args.text).exists():
        sys.exit(f"{args.text} is missing: python benchmarks/wide_vocab_text.py {args.text} "
                 "--vocab 50304")
    names = [name for name in args.rows.split(",") if name]
    unknown = [name for name in names if name not in TFM_ROWS]
    if unknown:
        sys.exit(f"--rows: {unknown[0]!r} is unknown; choose from {', '.join(TFM_ROWS)}")
    models = {TFM_ROWS[name][0] for name in names}
    rows = []
    if args.maxtext_dir and args.maxtext_python:
        rows += [maxtext_row(name, args.maxtext_dir, args.maxtext_python)
                 for name, (model, _) in MAXTEXT_ROWS.items() if model in models]
    with tempfile.TemporaryDirectory() as scratch:
        for name in names:
            rows.append(tfm_row(name, args.text, Path(scratch), args.windowed_einsum))
            print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(rows))
    print(markdown(rows))


if __name__ == "__main__":
    main()
