"""tfm's causal attention core against torch's fused CPU attention, side by side in one process.

    pip install -e ".[bench]"    # torch, only for this benchmark
    python benchmarks/attention_core.py                    # batch 2 and 64 (about 3 minutes)
    python benchmarks/attention_core.py --batches 8,64 --repeats 9
    python benchmarks/attention_core.py --onednn    # tfm also with XLA's oneDNN dots

The attention of the char-GPT training step (vs_torch.py: 6 heads of 64, 256 tokens, causal,
float32): tfm's `kernels.attention(q, k, v, mask=causal, backend="cpu", causal=True)` (the
reference backend, the path training takes; head-major matmuls that skip the key blocks after
each 64-query block) against `torch.nn.functional.scaled_dot_product_attention(is_causal=True)`
(its fused flash-attention kernel on CPU). Forward alone and forward + backward (the gradients
of q, k and v for a fixed output gradient), each jitted for tfm; torch in eager mode with q, k, v
already head-major (what nanoGPT's model hands it). Repeats interleave the two; medians are
reported, with the GFLOP/s of the causal matmuls (half of the full ones) and the largest
difference between the two frameworks' outputs and gradients.

--onednn adds tfm compiled with `cpu_kernels="onednn"` (tfm/kernels/cpu_compile.py: XLA hands every
dot to the oneDNN library; what `train.cpu_kernels="onednn"` asks for, see benchmarks/README.md).
One training step of the 6-layer model runs this 6 times, so 6 x the forward + backward column
is the attention core's share of vs_torch.py's step. Writes benchmarks/results/attention_core.
{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tfm import kernels
from tfm.kernels import cpu_compile, cpu_memory, hardware
from tfm.nn import attention

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - the benchmark says what to install
    sys.exit('attention_core.py needs torch: pip install -e ".[bench]"')

from vs_torch import cpu_info

ROOT = Path(__file__).resolve().parents[1]


def tfm_runs(q, k, v, grad_out, cpu_kernels: str = "xla"):
    """(forward, forward_backward) jitted with `cpu_kernels` (cpu_compile.CPU_KERNELS):
    q, k, v, grad_out [batch, len, heads, head_dim]."""
    length = q.shape[1]
    positions = jnp.arange(length)[None]
    mask = attention.causal_mask(positions, positions)  # [1, 1, len, len]

    def forward(q, k, v):
        return kernels.attention(q, k, v, mask=mask, backend="cpu", causal=True)

    def forward_backward(q, k, v, grad_out):
        out, pullback = jax.vjp(forward, q, k, v)
        return out, pullback(grad_out)

    forward_jit = cpu_compile.jit(forward, cpu_kernels=cpu_kernels)
    both_jit = cpu_compile.jit(forward_backward, cpu_kernels=cpu_kernels)
    return (lambda: jax.block_until_ready(forward_jit(q, k, v)),
            lambda: jax.block_until_ready(both_jit(q, k, v, grad_out)))


def torch_runs(q, k, v, grad_out):
    """The same for torch; arguments head-major [batch, heads, len, head_dim]."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))

    def forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward_backward():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out, torch.autograd.grad(out, (q, k, v), grad_out)

    return forward, forward_backward


def max_difference(tfm_result, torch_result) -> float:
    """Largest |tfm - torch| over the output and the three gradients."""
    out, grads = tfm_result
    torch_out, torch_grads = torch_result
    pairs = [(out, torch_out), *zip(grads, torch_grads, strict=True)]
    return max(float(np.max(np.abs(np.asarray(a) - b.detach().numpy().transpose(0, 2, 1, 3))))
               for a, b in pairs)


def bench(batch: int, heads: int, length: int, head_dim: int, repeats: int,
          onednn: bool = False) -> dict:
    rng = np.random.default_rng(batch)
    q, k, v, grad_out = (rng.standard_normal((batch, length, heads, head_dim), np.float32)
                         for _ in range(4))
    tfm_forward, tfm_both = tfm_runs(*(jnp.asarray(x) for x in (q, k, v, grad_out)))
    torch_forward, torch_both = torch_runs(
        *(torch.from_numpy(x.transpose(0, 2, 1, 3).copy()) for x in (q, k, v, grad_out)))
    runs = {"tfm_forward": tfm_forward, "torch_forward": torch_forward,
            "tfm_forward_backward": tfm_both, "torch_forward_backward": torch_both}
    if onednn:
        runs["tfm_onednn_forward"], runs["tfm_onednn_forward_backward"] = tfm_runs(
            *(jnp.asarray(x) for x in (q, k, v, grad_out)), cpu_kernels="onednn")
    results = {name: run() for name, run in runs.items()}  # compile and warm up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    # Causal QK^T and PV: half of 2 * 2 * len^2 * head_dim per head; backward is twice forward.
    forward_flops = 2 * batch * heads * length * length * head_dim
    row = {"batch": batch, "heads": heads, "length": length, "head_dim": head_dim,
           **{f"{name}_ms": 1e3 * seconds for name, seconds in medians.items()},
           "max_abs_difference": max_difference(results["tfm_forward_backward"],
                                                results["torch_forward_backward"])}
    for side in ("tfm", "torch"):
        row[f"{side}_forward_gflops"] = forward_flops / medians[f"{side}_forward"] / 1e9
        row[f"{side}_forward_backward_gflops"] = (
            3 * forward_flops / medians[f"{side}_forward_backward"] / 1e9)
    row["forward_ratio"] = medians["torch_forward"] / medians["tfm_forward"]
    row["forward_backward_ratio"] = (medians["torch_forward_backward"]
                                     / medians["tfm_forward_backward"])
    if onednn:
        row["onednn_max_abs_difference"] = max_difference(
            results["tfm_onednn_forward_backward"], results["torch_forward_backward"])
        row["onednn_forward_backward_ratio"] = (medians["torch_forward_backward"]
                                                / medians["tfm_onednn_forward_backward"])
    return row


def report(info: dict, rows: list[dict], command: str) -> str:
    lines = [
        "# Causal attention core: tfm vs torch's fused CPU attention",
        "",
        f"{hardware.cpu_line(info)} (this benchmark is float32); jax {info['jax']}, "
        f"torch {info['torch']}; tfm's XLA options: "
        f"{info['tfm_compiler_options'] or 'XLA defaults'}.",
        "Speed ratio = torch time / tfm time (above 1: tfm faster). GFLOP/s of the causal matmuls.",
        "",
        "| batch x heads x len x head_dim | tfm fwd ms | torch fwd ms | fwd ratio | "
        "tfm fwd+bwd ms | torch fwd+bwd ms | fwd+bwd ratio | tfm / torch fwd+bwd GFLOP/s | "
        "max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['batch']} x {r['heads']} x {r['length']} x {r['head_dim']} | "
            f"{r['tfm_forward_ms']:.1f} | {r['torch_forward_ms']:.1f} | "
            f"**{r['forward_ratio']:.2f}** | {r['tfm_forward_backward_ms']:.1f} | "
            f"{r['torch_forward_backward_ms']:.1f} | **{r['forward_backward_ratio']:.2f}** | "
            f"{r['tfm_forward_backward_gflops']:.0f} / {r['torch_forward_backward_gflops']:.0f} | "
            f"{r['max_abs_difference']:.1e} |")
    onednn_rows = [r for r in rows if "tfm_onednn_forward_backward_ms" in r]
    if onednn_rows:
        lines += ["", "tfm with XLA's oneDNN dots (`--onednn`; the same programs, every dot handed "
                  "to oneDNN):", "",
                  "| batch x heads x len x head_dim | tfm oneDNN fwd ms | tfm oneDNN fwd+bwd ms | "
                  "vs tfm's options | fwd+bwd ratio to torch | max abs diff |",
                  "|---|---:|---:|---:|---:|---:|"]
        for r in onednn_rows:
            lines.append(
                f"| {r['batch']} x {r['heads']} x {r['length']} x {r['head_dim']} | "
                f"{r['tfm_onednn_forward_ms']:.1f} | {r['tfm_onednn_forward_backward_ms']:.1f} | "
                f"**{r['tfm_forward_backward_ms'] / r['tfm_onednn_forward_backward_ms']:.2f}x** | "
                f"**{r['onednn_forward_backward_ratio']:.2f}** | "
                f"{r['onednn_max_abs_difference']:.1e} |")
    lines += ["", f"Command: `{command}`"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="2,64")
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--head_dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--onednn", action="store_true",
                        help="also time tfm with oneDNN dots (cpu_kernels=\"onednn\")")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    cpu_memory.keep_freed_memory()  # as vs_torch.py and tfm's training loop
    torch.manual_seed(0)
    info = cpu_info()
    print(json.dumps(info), flush=True)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        rows.append(bench(batch, args.heads, args.length, args.head_dim, args.repeats,
                          onednn=args.onednn))
        print(json.dumps(rows[-1]), flush=True)
    command = ("python benchmarks/attention_core.py " + " ".join(sys.argv[1:])).strip()
    text = report(info, rows, command)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"cpu": info, "rows": rows, "command": command}
    (out / "attention_core.json").write_text(json.dumps(payload, indent=1))
    (out / "attention_core.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
