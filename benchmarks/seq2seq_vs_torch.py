"""Encoder-decoder training, tfm against PyTorch's nn.Transformer, side by side in one process.

    pip install -e ".[bench]"    # torch, only for this benchmark
    python benchmarks/seq2seq_vs_torch.py                 # paper base shape, batch 16 x 64
    python benchmarks/seq2seq_vs_torch.py --d_model 256 --layers 3 --batch 64 --repeats 7

The translation step of configs/translate.py: the paper's base model (6 + 6 post-LN layers,
d_model 512, 8 heads, d_ff 2048, ReLU, biases, sinusoidal positions, embeddings scaled by
sqrt(d_model), one table shared by source, target and output), dropout 0.1, label smoothing 0.1,
the paper's Adam (0.9, 0.98, 1e-9), on packed rows of 64 tokens holding 4 pairs each (what the
translate config's pipeline makes of Multi30k), random tokens from an 8,000-token vocabulary.
tfm runs its real `train.train_step` on `EncoderDecoder(paper_base(8000))`; torch an
`nn.Transformer` (batch_first, the same sizes; it adds a final LayerNorm to each stack) with the
shared embedding, the same positions restarting in each packed pair, block-diagonal attention
masks (causal in the decoder), tied output and `F.cross_entropy(label_smoothing=0.1)`, in eager
mode. Repeats interleave the two; medians are reported as target tokens/s, with MFU against the
measured float32 matmul peak (tfm.training.flops' per-target-token count). A third row times tfm's
step
compiled with XLA's own CPU options (YNNPACK dots and reductions; what TFM_XLA_DEFAULTS=0 gives,
see tfm/kernels/cpu_compile.py), which --no-xla_defaults leaves out. Writes
benchmarks/results/seq2seq_vs_torch.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.linen import meta as nn_meta

from tfm.kernels import cpu_compile, cpu_memory, hardware
from tfm.nn.config import paper_base
from tfm.nn.models import EncoderDecoder
from tfm.training import flops, train
from tfm.training.experiment import TrainState

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError:  # pragma: no cover - the benchmark says what to install
    sys.exit('seq2seq_vs_torch.py needs torch: pip install -e ".[bench]"')

from vs_torch import cpu_info, matmul_peaks

ROOT = Path(__file__).resolve().parents[1]

PAD = 0
XLA_DEFAULTS = "tfm, XLA's CPU defaults"


def packed_batch(batch: int, length: int, pairs: int, vocab: int, seed: int = 0) -> dict:
    """Rows of `pairs` equal-length segments, source and target alike: token ids, positions
    restarting in each segment, segment ids 1..pairs (every token real)."""
    rng = np.random.default_rng(seed)
    segment = length // pairs
    segment_ids = np.repeat(np.arange(1, pairs + 1), segment)[None].repeat(batch, 0)
    positions = np.tile(np.arange(segment), pairs)[None].repeat(batch, 0)
    tokens = lambda: rng.integers(3, vocab, (batch, length))
    return {
        "source": tokens(), "inputs": tokens(), "targets": tokens(),
        "weights": np.ones((batch, length), np.float32),
        "source_positions": positions, "positions": positions,
        "source_segment_ids": segment_ids, "segment_ids": segment_ids,
    }


def tfm_runner(config, batch: dict, lr: float = 1e-4):
    model = EncoderDecoder(config)
    optimizer = optax.adam(lr, b1=0.9, b2=0.98, eps=1e-9)
    arrays = {k: jnp.asarray(v, jnp.float32 if k == "weights" else jnp.int32)
              for k, v in batch.items()}
    boxed = model.init(jax.random.PRNGKey(0), arrays["source"][:1], arrays["inputs"][:1])
    params = nn_meta.unbox(boxed["params"])
    state = TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params),
                             jax.random.PRNGKey(1))
    step = cpu_compile.jit(
        lambda s, b: train.train_step(s, b, model=model, mode="seq2seq", optimizer=optimizer,
                                      schedule=optax.constant_schedule(lr), label_smoothing=0.1),
        donate_argnums=(0,),
    )
    holder = {"state": state}

    def run() -> float:
        begin = time.perf_counter()
        holder["state"], metrics = step(holder["state"], arrays)
        jax.block_until_ready(metrics)
        return time.perf_counter() - begin

    run()  # compile
    return run


class TorchSeq2Seq(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.d_model = args.d_model
        self.embed = nn.Embedding(args.vocab, args.d_model)
        nn.init.normal_(self.embed.weight, std=args.d_model**-0.5)
        position = torch.arange(args.length)[:, None]
        rate = torch.exp(torch.arange(0, args.d_model, 2) * (-math.log(10000.0) / args.d_model))
        table = torch.zeros(args.length, args.d_model)
        table[:, 0::2], table[:, 1::2] = torch.sin(position * rate), torch.cos(position * rate)
        self.register_buffer("positions", table)
        self.drop = nn.Dropout(args.dropout)
        self.transformer = nn.Transformer(
            d_model=args.d_model, nhead=args.heads, num_encoder_layers=args.layers,
            num_decoder_layers=args.layers, dim_feedforward=4 * args.d_model,
            dropout=args.dropout, batch_first=True,
        )
        self.heads = args.heads

    def embed_tokens(self, tokens, positions):
        return self.drop(self.embed(tokens) * math.sqrt(self.d_model) + self.positions[positions])

    def forward(self, b):
        same = lambda q, k: q[:, :, None] != k[:, None, :]  # True = may not attend (torch MHA)
        causal = torch.ones(b["inputs"].shape[1], b["inputs"].shape[1], dtype=torch.bool).triu(1)
        per_head = lambda mask: mask.repeat_interleave(self.heads, dim=0)
        out = self.transformer(
            self.embed_tokens(b["source"], b["source_positions"]),
            self.embed_tokens(b["inputs"], b["positions"]),
            src_mask=per_head(same(b["source_segment_ids"], b["source_segment_ids"])),
            tgt_mask=per_head(same(b["segment_ids"], b["segment_ids"]) | causal),
            memory_mask=per_head(same(b["segment_ids"], b["source_segment_ids"])),
        )
        logits = out @ self.embed.weight.T
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), b["targets"].reshape(-1),
                               label_smoothing=0.1)


def torch_runner(args, batch: dict, lr: float = 1e-4):
    torch.manual_seed(0)
    model = TorchSeq2Seq(args).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(0.9, 0.98), eps=1e-9)
    tensors = {k: torch.from_numpy(np.asarray(v)).long() for k, v in batch.items()
               if k != "weights"}

    def run() -> float:
        begin = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model(tensors).backward()
        optimizer.step()
        return time.perf_counter() - begin

    run()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--pairs", type=int, default=4, help="packed pairs per row")
    parser.add_argument("--d_model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--xla_defaults", action=argparse.BooleanOptionalAction, default=True,
                        help="also time tfm compiled with XLA's own CPU options")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    if args.length % args.pairs:
        parser.error(f"--length {args.length} must be a multiple of --pairs {args.pairs}")
    cpu_memory.keep_freed_memory()
    info = cpu_info()
    print(json.dumps(info), flush=True)
    peak = max(matmul_peaks(["float32"])["float32"].values())
    config = paper_base(args.vocab).replace(
        d_model=args.d_model, num_heads=args.heads, d_ff=4 * args.d_model,
        num_encoder_layers=args.layers, num_decoder_layers=args.layers,
        dropout_rate=args.dropout, max_len=args.length,
    )
    batch = packed_batch(args.batch, args.length, args.pairs, args.vocab)
    runs = {"tfm": tfm_runner(config, batch), "torch": torch_runner(args, batch)}
    options = {"tfm": cpu_compile.compiler_options(), "torch": None}
    if args.xla_defaults:
        with cpu_compile.using(None):
            runs[XLA_DEFAULTS] = tfm_runner(config, batch)
        options[XLA_DEFAULTS] = None
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, run in runs.items():
            with cpu_compile.using(options[name]):
                times[name].append(run())
    tokens = args.batch * args.length
    segment = args.length // args.pairs
    per_token = flops.flops_per_token(config, segment, "seq2seq")
    row = {name: {"step_s": statistics.median(t), "tokens_per_s": tokens / statistics.median(t),
                  "mfu": tokens / statistics.median(t) * per_token / peak}
           for name, t in times.items()}
    ratio = row["tfm"]["tokens_per_s"] / row["torch"]["tokens_per_s"]
    defaults_note = ""
    if XLA_DEFAULTS in row:
        defaults_ratio = row[XLA_DEFAULTS]["tokens_per_s"] / row["torch"]["tokens_per_s"]
        defaults_note = f"; with XLA's CPU defaults: {defaults_ratio:.2f}"
    command = "python benchmarks/seq2seq_vs_torch.py " + " ".join(sys.argv[1:])
    lines = [
        "# Encoder-decoder training: tfm vs torch nn.Transformer", "",
        f"{hardware.cpu_line(info)} (this benchmark is float32); jax {info['jax']}, torch "
        f"{info['torch']}; tfm's XLA options: {info.get('tfm_compiler_options') or 'defaults'}. "
        f"Matmul peak (2048^3, float32, best of jax and torch): {peak / 1e9:.0f} GFLOP/s.",
        f"{args.layers} + {args.layers} post-LN layers, d_model {args.d_model}, {args.heads} "
        f"heads, vocabulary {args.vocab}, dropout {args.dropout}, label smoothing 0.1; batch "
        f"{args.batch} rows of {args.length} tokens, {args.pairs} packed pairs each; medians of "
        f"{args.repeats} interleaved steps.", "",
        "| framework | step ms | target tokens/s | MFU |", "|---|---:|---:|---:|",
        *(f"| {name} | {1000 * r['step_s']:,.0f} | {r['tokens_per_s']:,.0f} | "
          f"{100 * r['mfu']:.0f}% |" for name, r in row.items()),
        "", f"tfm / torch: **{ratio:.2f}**{defaults_note}",
        "", f"Command: `{command.strip()}`", "",
    ]
    table = "\n".join(lines)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"cpu": info, "args": vars(args), "matmul_peak": peak, "rows": row,
              "ratio": ratio, "command": command.strip()}
    (out / "seq2seq_vs_torch.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "seq2seq_vs_torch.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
