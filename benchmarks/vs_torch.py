"""tfm against PyTorch on the same CPU, side by side in one process: training and decoding.

    pip install -e ".[bench]"    # torch + transformers, only for this benchmark
    python benchmarks/vs_torch.py                         # the full run (about 25 minutes)
    python benchmarks/vs_torch.py --quick                 # batch 16, fewer repeats (5 minutes)
    python benchmarks/vs_torch.py --only train --dtypes float32
    python benchmarks/vs_torch.py --only train --dtypes float32 --dropout_rng threefry,threefry2x32
    python benchmarks/vs_torch.py --only train --dtypes float32 --microbatches 1,8,32
    python benchmarks/vs_torch.py --only train --dtypes float32 --microbatches 32 --cpu_devices 1,2
    python benchmarks/vs_torch.py --only train --cpu_kernels auto,xla,onednn
    python benchmarks/vs_torch.py --xla_defaults off      # tfm without tfm/kernels/cpu_compile.py
    python benchmarks/vs_torch.py --malloc_defaults off   # glibc's, not tfm/kernels/cpu_memory.py's

Training: a char GPT (6 layers, 6 heads, d_model 384, block 256, batch 64, dropout 0.2, learned
positions, pre-LN, GELU, no biases, tied output, AdamW), as tfm's real `train.train_step` and as
an equivalent PyTorch module defined here (nanoGPT's shape, same dropout sites: embeddings and
the two residual branches; eager mode, `F.scaled_dot_product_attention`). bfloat16 is tfm's
`dtype=bfloat16` (float32 params and accumulation) against torch autocast.
Decoding: greedy, 8-token prompts, batch 1 and 8, 256 and 1,024 new tokens, tfm's
`lm_generate` (while loops over a KV cache grown before each, `DecodeConfig.cache_segments`;
beside it one loop over a full-size cache, `cache_segments=1`) against Hugging Face `generate`
(KV cache) on a GPT-2 of the same size. Also the batch-1 weight-bandwidth bound: weight bytes per
token over the measured memory bandwidth.

--cpu_kernels auto,xla,onednn times tfm's train step with each `train.cpu_kernels` (see
tfm/kernels/cpu_compile.py): auto is tfm's default (YNNPACK dots for bfloat16 on a CPU with bf16
units, else xla), onednn oneDNN dots, ynnpack XLA's CPU defaults, ynnpack_dots YNNPACK dots.

--cpu_devices 1,2 also times tfm training data-parallel over 2 CPU devices of this host (what
`./launch.sh train ... --devices_per_process 2` runs): each device runs its half of the batch on
its own thread, so small ops on the two halves overlap instead of leaving a core idle.

The run keeps freed host memory as tfm's training loop does (`tfm/kernels/cpu_memory.py`; the
setting is the process's, so torch runs under it too); `--malloc_defaults off` leaves glibc's
defaults.

Repeats interleave the two frameworks, and medians are reported, because the machine is shared.
MFU is against the best measured matmul peak of either framework in that dtype. Writes
benchmarks/results/vs_torch.{json,md}.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from char_gpt import VOCAB, init_params, model_config, random_batch, tfm_train_runner

from tfm.decode import search
from tfm.decode.generate import lm_generate
from tfm.decode.search import DecodeConfig
from tfm.kernels import cpu_compile, cpu_memory, hardware
from tfm.training import flops

ROOT = Path(__file__).resolve().parents[1]

KERNEL_LABELS = {"xla": "XLA's kernels", "ynnpack": "XLA's defaults (YNNPACK)",
                 "ynnpack_dots": "YNNPACK dots", "onednn": "oneDNN dots"}


def kernels_label(kind: str, dtype: str) -> str:
    """How a train row's cpu_kernels shows in the table; tfm's default ("auto") says what it
    chose for this dtype on this CPU."""
    label = KERNEL_LABELS[cpu_compile.resolve_cpu_kernels(kind, dtype)]
    return f"tfm's default ({label})" if kind == "auto" else label

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError:  # pragma: no cover - the benchmark says what to install
    sys.exit('vs_torch.py needs torch and transformers: pip install -e ".[bench]"')



def cpu_info() -> dict:
    return {**hardware.cpu_features(), "jax": jax.__version__, "torch": torch.__version__,
            "tfm_compiler_options": cpu_compile.compiler_options(),
            "keeps_freed_memory": cpu_memory.keep_freed_memory()}


def best_time(fn, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def page_faults() -> int:
    """Minor page faults of this process so far (memory touched for the first time)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def matmul_peaks(dtypes: list[str], size: int = 2048) -> dict:
    """Best FLOP/s of a size^3 matmul, jax and torch, in each of `dtypes` (bfloat16: f32
    accumulation in jax; torch bf16 output). Only the dtypes benchmarked: an emulated bf16
    matmul takes minutes."""
    peaks = {}
    for dtype in dtypes:
        a = jnp.ones((size, size), dtype)
        dot = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))
        jax_time = best_time(lambda dot=dot, a=a: dot(a, a).block_until_ready())
        ta = torch.ones(size, size, dtype=getattr(torch, dtype))
        torch_time = best_time(lambda ta=ta: torch.mm(ta, ta))
        peaks[dtype] = {"jax": 2 * size**3 / jax_time, "torch": 2 * size**3 / torch_time}
    return peaks


def memory_bandwidth() -> float:
    """Bytes/s of reading a 512 MiB float32 array (a sum), best of 5 runs and of jax, torch and
    numpy (whichever reads fastest is closest to what the memory system can give)."""
    data = np.ones((128 * 1024 * 1024,), np.float32)
    on_jax, on_torch = jnp.asarray(data), torch.from_numpy(data)
    total = jax.jit(jnp.sum)
    times = [
        best_time(lambda: total(on_jax).block_until_ready()),
        best_time(lambda: on_torch.sum()),
        best_time(lambda: data.sum()),
    ]
    return data.nbytes / min(times)


# ---------------------------------------------------------------------------------------------
# The PyTorch anchor


class TorchBlock(nn.Module):
    def __init__(self, d_model: int, num_heads: int, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.fc = nn.Linear(d_model, 4 * d_model, bias=False)
        self.fc_out = nn.Linear(4 * d_model, d_model, bias=False)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):  # x: [batch, len, d_model]
        batch, length, d_model = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d_model, dim=2)
        q, k, v = (
            t.view(batch, length, self.num_heads, -1).transpose(1, 2) for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(batch, length, d_model)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln_2(x)))))


class TorchGPT(nn.Module):
    def __init__(self, layers: int, d_model: int, num_heads: int, block: int, dropout: float):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, d_model), nn.Embedding(block, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(TorchBlock(d_model, num_heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, inputs, targets):
        x = self.drop(self.tokens(inputs) + self.positions(torch.arange(inputs.shape[1])))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x)).float()
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))


# ---------------------------------------------------------------------------------------------
# Training


def torch_train_runner(args, dtype: str, inputs: np.ndarray, targets: np.ndarray,
                       microbatches: int = 1):
    """One AdamW step per call; with microbatches = k the batch's k chunks are run forward and
    backward one after another, their gradients accumulated (tfm's train.microbatches)."""
    torch.manual_seed(0)
    model = TorchGPT(args.layers, args.d_model, args.heads, args.block, args.dropout)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99),
                                  weight_decay=0.1)
    x, y = torch.from_numpy(inputs).long(), torch.from_numpy(targets).long()

    def one_step():
        optimizer.zero_grad(set_to_none=True)
        for x_chunk, y_chunk in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bfloat16"):
                loss = model(x_chunk, y_chunk) / microbatches
            loss.backward()
        optimizer.step()

    def run(steps: int) -> float:
        begin = time.perf_counter()
        for _ in range(steps):
            one_step()
        return time.perf_counter() - begin

    run(1)
    return run


def bench_train(args, peaks: dict) -> list[dict]:
    """Every tfm variant of every dtype and torch at each microbatch count and dtype, timed in
    turn within each repeat, so the dtypes' ratios are side by side too."""
    batch, inputs, targets = random_batch(args.batch, args.block)
    tokens = args.batch * args.block
    rows = []
    impls = args.dropout_rng.split(",")
    splits = [int(k) for k in args.microbatches.split(",")]
    devices = [int(n) for n in args.cpu_devices.split(",")]
    kernels = args.cpu_kernels.split(",")
    dtypes = args.dtypes.split(",")
    tfm_runs = {(dtype, impl, k, n, kind): tfm_train_runner(args, dtype, batch, impl, k, n, kind)
                for dtype in dtypes for k in splits for impl in impls for n in devices
                for kind in kernels}
    torch_runs = {(dtype, k): torch_train_runner(args, dtype, inputs, targets, k)
                  for dtype in dtypes for k in splits}
    times: dict[tuple, list[float]] = {key: [] for key in [*tfm_runs, *torch_runs]}
    faults = dict.fromkeys(times, 0)  # minor page faults while timed
    runs = {**{key: run for key, (run, _, _) in tfm_runs.items()}, **torch_runs}
    for _ in range(args.repeats):  # interleaved
        for key, run in runs.items():
            before = page_faults()
            times[key].append(run(args.steps) / args.steps)
            faults[key] += page_faults() - before
    timed_steps = args.repeats * args.steps
    for (dtype, impl, k, n, kind), (_, config, compile_s) in tfm_runs.items():
        torch_tps = {j: tokens / statistics.median(times[dtype, j]) for j in splits}
        peak = max(peaks[dtype].values())
        per_token = flops.flops_per_token(config, args.block, "lm")
        key = (dtype, impl, k, n, kind)
        tfm_tps = tokens / statistics.median(times[key])
        rows.append({
            "work": "train", "dtype": dtype, "dropout_rng": impl, "microbatches": k,
            "cpu_devices": n, "cpu_kernels": kind,
            "cpu_kernels_chosen": cpu_compile.resolve_cpu_kernels(kind, dtype),
            "batch": args.batch, "block": args.block, "tfm_tokens_per_s": tfm_tps,
            "torch_tokens_per_s": torch_tps[k], "ratio": tfm_tps / torch_tps[k],
            # against torch taking the batch at once, the anchor of issue 9
            "ratio_to_whole_batch_torch": tfm_tps / torch_tps[1] if 1 in torch_tps else None,
            "tfm_mfu": tfm_tps * per_token / peak, "torch_mfu": torch_tps[k] * per_token / peak,
            "tfm_step_s": sorted(times[key]), "torch_step_s": sorted(times[dtype, k]),
            "tfm_compile_s": compile_s, "flops_per_token": per_token,
            "tfm_page_faults_per_step": faults[key] / timed_steps,
            "torch_page_faults_per_step": faults[dtype, k] / timed_steps,
        })
        print(json.dumps(rows[-1]), flush=True)
    return rows


def dtype_ratios(train_rows: list[dict]) -> list[str]:
    """tfm's bfloat16 tokens/s over its float32 ones, variant by variant, and torch's: from the
    same interleaved repeats."""
    def variant(r):
        return (r["dropout_rng"], r["microbatches"], r["cpu_devices"], r["cpu_kernels"])

    f32 = {variant(r): r for r in train_rows if r["dtype"] == "float32"}
    lines = []
    for r in train_rows:
        if r["dtype"] == "bfloat16" and (base := f32.get(variant(r))):
            lines.append(
                f"- bfloat16 / float32, {kernels_label(r['cpu_kernels'], 'bfloat16')} vs "
                f"{kernels_label(r['cpu_kernels'], 'float32')}: tfm "
                f"**{r['tfm_tokens_per_s'] / base['tfm_tokens_per_s']:.2f}x**, torch "
                f"{r['torch_tokens_per_s'] / base['torch_tokens_per_s']:.2f}x"
            )
    best = {d: max((r for r in train_rows if r["dtype"] == d),
                   key=lambda r: r["tfm_tokens_per_s"], default=None)
            for d in ("float32", "bfloat16")}
    if best["float32"] and best["bfloat16"]:
        fast16, fast32 = best["bfloat16"], best["float32"]
        lines.append(
            f"- tfm's fastest bfloat16 ({kernels_label(fast16['cpu_kernels'], 'bfloat16')}) / "
            f"its fastest float32 ({kernels_label(fast32['cpu_kernels'], 'float32')}): "
            f"**{fast16['tfm_tokens_per_s'] / fast32['tfm_tokens_per_s']:.2f}x**"
        )
    return lines


# ---------------------------------------------------------------------------------------------
# Decoding


def hf_model(args, max_positions: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=max_positions, n_embd=args.d_model, n_layer=args.layers,
        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    return GPT2LMHeadModel(config).eval()


def bench_decode(args, bandwidth: float) -> list[dict]:
    max_new = max(int(n) for n in args.new_tokens.split(","))
    config = model_config(args, "float32", 8 + max_new).replace(dropout_rate=0.0)
    params = init_params(config, prompt_len=8)
    bf16_config = config.replace(dtype="bfloat16", param_dtype="bfloat16")
    bf16_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    weight_bytes = sum(x.size * 4 for x in jax.tree.leaves(params))
    hf = hf_model(args, 8 + max_new)
    rows = []
    for new_tokens in (int(n) for n in args.new_tokens.split(",")):
        for batch in (int(b) for b in args.decode_batches.split(",")):
            if new_tokens > 256 and batch > 1:
                continue  # the grid: 1,024 new tokens at batch 1
            prompts = np.random.default_rng(batch).integers(3, VOCAB, (batch, 8))

            def tfm_run(cfg=config, p=params, prompts=prompts, new_tokens=new_tokens,
                        segments=DecodeConfig.cache_segments):
                out = lm_generate(p, cfg, prompts, np.full(len(prompts), 8),
                                  max_new_tokens=new_tokens, eos_id=2, cache_segments=segments)
                return np.asarray(out.lengths)

            def hf_run(prompts=prompts, new_tokens=new_tokens):
                with torch.no_grad():
                    out = hf.generate(
                        torch.from_numpy(prompts).long(), attention_mask=torch.ones(prompts.shape),
                        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                        use_cache=True, eos_token_id=None, pad_token_id=0,
                    )
                return out.shape[1] - prompts.shape[1]

            tfm_bf16_run = lambda prompts=prompts, n=new_tokens: tfm_run(bf16_config, bf16_params,
                                                                         prompts, n)
            one_loop_run = functools.partial(tfm_run, segments=1)
            assert (tfm_run() == new_tokens).all() and hf_run() == new_tokens
            assert (one_loop_run() == new_tokens).all()
            tfm_bf16_run()
            runs = (("tfm", tfm_run), ("tfm_one_loop", one_loop_run), ("tfm_bf16", tfm_bf16_run),
                    ("hf", hf_run))
            times = {name: [] for name, _ in runs}
            for _ in range(args.decode_repeats):
                for name, fn in runs:
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            tps = {k: batch * new_tokens / statistics.median(v) for k, v in times.items()}
            row = {
                "work": "decode", "batch": batch, "new_tokens": new_tokens,
                "segment_ends": search.segment_ends(new_tokens, DecodeConfig.cache_segments),
                "tfm_tokens_per_s": tps["tfm"], "tfm_bf16_tokens_per_s": tps["tfm_bf16"],
                "tfm_one_loop_tokens_per_s": tps["tfm_one_loop"],
                "hf_tokens_per_s": tps["hf"], "ratio": tps["tfm"] / tps["hf"],
                "bf16_ratio": tps["tfm_bf16"] / tps["hf"],
            }
            if batch == 1:
                bound = bandwidth / weight_bytes  # tokens/s if only the f32 weights were read
                row.update(bandwidth_bound_tokens_per_s=bound,
                           step_over_bound=bound / tps["tfm"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def report(info: dict, peaks: dict, bandwidth: float, rows: list[dict], command: str) -> str:
    lines = [
        "# tfm vs PyTorch, side by side",
        "",
        f"{hardware.cpu_line(info)}; jax {info['jax']}, torch {info['torch']}.",
        ("Matmul peak (2048^3, GFLOP/s): "
         + "; ".join(f"{d} jax {p['jax'] / 1e9:.0f}, torch {p['torch'] / 1e9:.0f}"
                     for d, p in peaks.items()) + ". " if peaks else "")
        + f"Memory bandwidth (512 MiB sum): {bandwidth / 1e9:.1f} GB/s. "
        f"tfm's XLA options: {info.get('tfm_compiler_options') or 'XLA defaults'}. "
        "Freed host memory: "
        + ("kept (tfm/kernels/cpu_memory.py)." if info.get("keeps_freed_memory")
           else "glibc's defaults."),
        "",
    ]
    train_rows = [r for r in rows if r["work"] == "train"]
    if train_rows:
        lines += [
            "| training | tfm tokens/s | torch tokens/s (same microbatches) | tfm / torch | "
            "tfm / torch whole batch | tfm MFU | torch MFU |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in train_rows:
            k = r.get("microbatches", 1)
            whole = r.get("ratio_to_whole_batch_torch")
            kernels = kernels_label(r.get("cpu_kernels", "xla"), r["dtype"])
            lines.append(
                f"| {r['dtype']}, batch {r['batch']} x {r['block']}"
                f"{f', {k} microbatches' if k > 1 else ''}"
                f"{f', {n} CPU devices' if (n := r.get('cpu_devices', 1)) > 1 else ''}"
                f"{'' if r['dropout_rng'] == 'threefry' else ', dropout ' + r['dropout_rng']}"
                f"{f', {kernels}' if kernels else ''} | "
                f"{r['tfm_tokens_per_s']:,.0f} | {r['torch_tokens_per_s']:,.0f} | "
                f"**{r['ratio']:.2f}** | {'' if whole is None else f'{whole:.2f}'} | "
                f"{100 * r['tfm_mfu']:.0f}% | {100 * r['torch_mfu']:.0f}% |"
            )
        lines.append("")
        if ratios := dtype_ratios(train_rows):
            lines += ["The dtypes against each other, from the same interleaved repeats:", "",
                      *ratios, ""]
    decode_rows = [r for r in rows if r["work"] == "decode"]
    if decode_rows:
        lines += [
            "| greedy decoding | tfm tokens/s | tfm one loop (cache_segments=1) | "
            "tfm bf16 tokens/s | HF generate tokens/s | tfm / HF | one loop / HF | bf16 / HF | "
            "batch-1 bound (f32 weights) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in decode_rows:
            bound = (f"{r['bandwidth_bound_tokens_per_s']:,.0f} tokens/s "
                     f"(tfm at {1 / r['step_over_bound']:.0%})"
                     if "bandwidth_bound_tokens_per_s" in r else "")
            lines.append(
                f"| batch {r['batch']}, {r['new_tokens']} new | {r['tfm_tokens_per_s']:,.0f} | "
                f"{r['tfm_one_loop_tokens_per_s']:,.0f} | "
                f"{r['tfm_bf16_tokens_per_s']:,.0f} | {r['hf_tokens_per_s']:,.0f} | "
                f"**{r['ratio']:.2f}** | "
                f"{r['tfm_one_loop_tokens_per_s'] / r['hf_tokens_per_s']:.2f} | "
                f"{r['bf16_ratio']:.2f} | {bound} |"
            )
        lines.append("")
    lines.append(f"Command: `{command}`")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("train", "decode"), default=None)
    parser.add_argument("--quick", action="store_true", help="batch 16, fewer repeats")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--d_model", type=int, default=384)
    parser.add_argument("--block", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--dropout", type=float, default=0.2)
    parser.add_argument("--dropout_rng", default="threefry",
                        help="tfm's dropout generators to time, comma-separated "
                             "(train.dropout_rng: threefry, threefry2x32, rbg, unsafe_rbg)")
    parser.add_argument("--microbatches", default="1",
                        help="train.microbatches values to time, comma-separated; torch runs "
                             "each with the same gradient accumulation inside its step")
    parser.add_argument("--cpu_devices", default="1",
                        help="CPU device counts to time tfm training on, comma-separated "
                             "(data parallel over this host's cores; torch uses all cores)")
    parser.add_argument("--cpu_kernels", default="auto",
                        help="train.cpu_kernels values to time tfm's train step with, "
                             "comma-separated: auto (tfm's default), xla, ynnpack, "
                             "ynnpack_dots, onednn")
    parser.add_argument("--xla_defaults", choices=("on", "off"), default="on",
                        help="off: tfm compiles with XLA's defaults, not "
                             "tfm/kernels/cpu_compile.py's (TFM_XLA_DEFAULTS=0)")
    parser.add_argument("--malloc_defaults", choices=("on", "off"), default="on",
                        help="off: glibc's malloc defaults, not tfm/kernels/cpu_memory.py's "
                             "(TFM_MALLOC_DEFAULTS=0); the setting is the process's, so torch "
                             "runs under it too")
    parser.add_argument("--steps", type=int, default=2, help="train steps per timing")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved train timings")
    parser.add_argument("--new_tokens", default="256,1024")
    parser.add_argument("--decode_batches", default="1,8")
    parser.add_argument("--decode_repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.quick:
        args.batch, args.repeats, args.decode_repeats = 16, 3, 3
    if args.xla_defaults == "off":
        os.environ["TFM_XLA_DEFAULTS"] = "0"
    if args.malloc_defaults == "off":
        os.environ["TFM_MALLOC_DEFAULTS"] = "0"
    cpu_memory.keep_freed_memory()  # before the backend's threads start (one malloc arena)
    # Before anything starts the backend: devices for --cpu_devices (1 device runs on the first).
    jax.config.update("jax_num_cpu_devices", max(int(n) for n in args.cpu_devices.split(",")))
    torch.set_num_threads(os.cpu_count() or 1)
    info = cpu_info()
    print(json.dumps(info), flush=True)
    if not info["bf16_native"]:
        print("warning: this CPU has no native bfloat16 (no AMX / AVX512-BF16); bfloat16 runs "
              "emulated and is expected to be slower than float32 on both sides", flush=True)
    # The matmul peaks are only for training MFU (torch's emulated bf16 peak alone takes minutes).
    peaks = matmul_peaks(args.dtypes.split(",")) if args.only != "decode" else {}
    bandwidth = memory_bandwidth()
    rows = []
    if args.only in (None, "train"):
        rows += bench_train(args, peaks)
    if args.only in (None, "decode"):
        rows += bench_decode(args, bandwidth)
    command = "python benchmarks/vs_torch.py " + " ".join(sys.argv[1:])
    text = report(info, peaks, bandwidth, rows, command.strip())
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.only is None and not args.quick else f"_{args.only or 'all'}" + (
        "_quick" if args.quick else "")
    payload = {"cpu": info, "matmul_peaks": peaks, "memory_bandwidth": bandwidth,
               "rows": rows, "command": command.strip()}
    (out / f"vs_torch{suffix}.json").write_text(json.dumps(payload, indent=1))
    (out / f"vs_torch{suffix}.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
