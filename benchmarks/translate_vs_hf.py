"""Encoder-decoder decoding, tfm against Hugging Face on the same weights, side by side.

    pip install -e ".[bench]"    # torch + transformers, only for this benchmark
    python benchmarks/translate_vs_hf.py                  # greedy and beam 4, batch 1 and 32
    python benchmarks/translate_vs_hf.py --batches 8 --methods beam --repeats 3

The model: a T5 of the paper's base shape (6 + 6 layers, d_model 512, 8 heads of 64, d_ff 2048,
ReLU; T5's pre-RMSNorm and relative position bias; vocabulary 32,128, tied), randomly
initialised in `transformers`, saved, and loaded into tfm with `tfm.interop.hf` - the same
weights on both sides. tfm's `generate.translate` (encoder once, then the decode loop inside jit
over an explicit KV cache; cross-attention keys and values computed once) against
`T5ForConditionalGeneration.generate` (its KV cache), greedy and beam search with 4 beams, on
32-token sources and 64 new tokens per row. The EOS embedding row is zeroed (its logit is 0,
never among the top candidates of 32,128 random logits), so every row runs its full 64 tokens
on both sides; the run checks that.

Exactness: the greedy tokens must be equal, and the best beam's tokens too (with no EOS every
hypothesis has the same length, so the two length penalties rank alike); the table reports the
fraction of rows whose tokens agree. Speed: tokens/s = rows x 64 / median time of interleaved
repeats (compile excluded), and the batch-1 greedy bound: weight bytes a decode step reads (the
decoder and the tied embedding as output layer) over the measured memory bandwidth. Also the
output layer alone at 1-128 rows, from the tied table read transposed and from a
[d_model, vocab] copy (`tfm.nn.models.output_kernel`), torch beside (--no-output_layer skips).
Writes
benchmarks/results/translate_vs_hf.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from tfm.decode.generate import best_sequences, translate
from tfm.interop import hf as interop
from tfm.kernels import cpu_compile, cpu_memory, hardware

try:
    import torch
    from transformers import T5Config, T5ForConditionalGeneration
except ImportError:  # pragma: no cover - the benchmark says what to install
    sys.exit('translate_vs_hf.py needs torch and transformers: pip install -e ".[bench]"')

from vs_torch import cpu_info, memory_bandwidth

ROOT = Path(__file__).resolve().parents[1]

PAD, EOS = 0, 1


def hf_model(args) -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=args.vocab, d_model=args.d_model, d_kv=args.d_model // args.heads,
        d_ff=4 * args.d_model, num_layers=args.layers, num_heads=args.heads, dropout_rate=0.0,
        feed_forward_proj="relu", tie_word_embeddings=True, pad_token_id=PAD, eos_token_id=EOS,
        decoder_start_token_id=PAD,
    )
    model = T5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.shared.weight[EOS] = 0.0  # EOS never wins: every row decodes its full length
    return model


def decoder_weight_bytes(params) -> int:
    """float32 bytes a decode step reads: the decoder's weights and the tied embedding."""
    leaves = jax.tree.leaves(params["decoder"]) + jax.tree.leaves(params["embed"])
    return sum(leaf.size * 4 for leaf in leaves)


def output_layer_rows(args, repeats: int = 15) -> list[dict]:
    """The decode step's output layer alone, jitted: rows x d_model times the tied table read
    transposed ([vocab, d_model], what decoding did before `models.output_kernel`) and times a
    [d_model, vocab] copy (what it does now), with torch's `x @ table.T` beside; median ms."""
    rng = np.random.default_rng(0)
    table = rng.normal(size=(args.vocab, args.d_model)).astype(np.float32)
    on_jax, copy = jnp.asarray(table), jnp.asarray(table.T.copy())
    on_torch = torch.from_numpy(table)
    transposed = cpu_compile.jit(lambda x, t: x @ t.T)
    plain = cpu_compile.jit(lambda x, k: x @ k)
    rows = []
    for count in (1, 4, 8, 32, 128):
        x = rng.normal(size=(count, args.d_model)).astype(np.float32)
        on_device, x_torch = jnp.asarray(x), torch.from_numpy(x)
        runs = {
            "table_transposed_ms": lambda x=on_device: transposed(x, on_jax).block_until_ready(),
            "copy_ms": lambda x=on_device: plain(x, copy).block_until_ready(),
            "torch_ms": lambda x=x_torch: x @ on_torch.T,
        }
        times = {name: [] for name in runs}
        for _ in range(repeats + 1):  # the first round compiles
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
        row = {"rows": count, **{k: 1000 * statistics.median(v[1:]) for k, v in times.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def bench(args, bandwidth: float) -> list[dict]:
    hf = hf_model(args)
    with tempfile.TemporaryDirectory() as folder:
        hf.save_pretrained(folder)
        config, params = interop.load_pretrained(folder)
    rows = []
    for method in args.methods.split(","):
        beam = 4 if method == "beam" else 1
        for batch in (int(b) for b in args.batches.split(",")):
            rng = np.random.default_rng(batch)
            source = rng.integers(2, args.vocab, (batch, args.source_len)).astype(np.int32)

            def tfm_run(source=source, method=method):
                out = translate(params, config, source, method=method, beam_size=4,
                                max_new_tokens=args.new_tokens, bos_id=PAD, eos_id=EOS)
                tokens, _ = best_sequences(out)
                return tokens

            def hf_run(source=source, beam=beam):
                with torch.no_grad():
                    out = hf.generate(
                        torch.from_numpy(source).long(), attention_mask=torch.ones(source.shape),
                        max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                        num_beams=beam, do_sample=False, use_cache=True, eos_token_id=None,
                        early_stopping=False,
                    )
                return out[:, 1:].numpy()  # drop the decoder start token

            tfm_tokens, hf_tokens = tfm_run(), hf_run()
            if tfm_tokens.shape != (batch, args.new_tokens) or hf_tokens.shape != tfm_tokens.shape:
                raise SystemExit(f"{method} batch {batch}: tokens {tfm_tokens.shape} (tfm) and "
                                 f"{hf_tokens.shape} (HF), wanted ({batch}, {args.new_tokens})")
            if (tfm_tokens == EOS).any():
                raise SystemExit(f"{method} batch {batch}: tfm emitted EOS; rows would be short")
            agree = float((tfm_tokens == hf_tokens).all(axis=1).mean())
            times = {"tfm": [], "hf": []}
            for _ in range(args.repeats):
                for name, run in (("tfm", tfm_run), ("hf", hf_run)):
                    start = time.perf_counter()
                    run()
                    times[name].append(time.perf_counter() - start)
            tps = {k: batch * args.new_tokens / statistics.median(v) for k, v in times.items()}
            row = {"method": method, "beam_size": beam, "batch": batch,
                   "tfm_tokens_per_s": tps["tfm"], "hf_tokens_per_s": tps["hf"],
                   "ratio": tps["tfm"] / tps["hf"], "rows_with_equal_tokens": agree}
            if method == "greedy" and batch == 1:
                bound = bandwidth / decoder_weight_bytes(params)
                row.update(bandwidth_bound_tokens_per_s=bound, step_over_bound=bound / tps["tfm"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def output_layer_report(rows: list[dict]) -> list[str]:
    lines = ["", "The output layer alone (vocabulary x d_model tied table), median ms:", "",
             "| rows | table read transposed (before) | [d_model, vocab] copy (now) | torch |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {r['rows']} | {r['table_transposed_ms']:.2f} | {r['copy_ms']:.2f} | "
              f"{r['torch_ms']:.2f} |" for r in rows]
    return lines


def report(info: dict, args, bandwidth: float, rows: list[dict], command: str) -> str:
    lines = [
        "# Encoder-decoder decoding: tfm vs Hugging Face T5 on the same weights", "",
        f"{hardware.cpu_line(info)} (this benchmark is float32); jax {info['jax']}, torch "
        f"{info['torch']}; tfm's XLA options: {info.get('tfm_compiler_options') or 'defaults'}. "
        f"Memory bandwidth (512 MiB sum): {bandwidth / 1e9:.1f} GB/s.",
        f"T5 of the paper's base shape: {args.layers} + {args.layers} layers, d_model "
        f"{args.d_model}, {args.heads} heads, d_ff {4 * args.d_model}, vocabulary {args.vocab}; "
        f"{args.source_len}-token sources, {args.new_tokens} new tokens per row, float32; medians "
        f"of {args.repeats} interleaved repeats.", "",
        "| decoding | batch | tfm tokens/s | HF tokens/s | tfm / HF | rows with equal tokens "
        "| batch-1 bound (weights) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        name = "greedy" if row["method"] == "greedy" else f"beam {row['beam_size']}"
        bound = ""
        if "bandwidth_bound_tokens_per_s" in row:
            share = 100 / row["step_over_bound"]
            bound = f"{row['bandwidth_bound_tokens_per_s']:,.0f} tokens/s (tfm at {share:.0f}%)"
        lines.append(
            f"| {name} | {row['batch']} | {row['tfm_tokens_per_s']:,.0f} | "
            f"{row['hf_tokens_per_s']:,.0f} | **{row['ratio']:.2f}** | "
            f"{100 * row['rows_with_equal_tokens']:.0f}% | {bound} |"
        )
    if args.output_layer:
        lines += output_layer_report(args.output_layer)
    lines += ["", f"Command: `{command}`", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", default="greedy,beam")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--d_model", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32128)
    parser.add_argument("--source_len", type=int, default=32)
    parser.add_argument("--new_tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output_layer", action=argparse.BooleanOptionalAction, default=True,
                        help="also time the output layer alone, tied table vs its copy")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    unknown = set(args.methods.split(",")) - {"greedy", "beam"}
    if unknown:
        parser.error(f"--methods: {sorted(unknown)} not in greedy, beam")
    cpu_memory.keep_freed_memory()
    info = cpu_info()
    print(json.dumps(info), flush=True)
    bandwidth = memory_bandwidth()
    args.output_layer = output_layer_rows(args) if args.output_layer else []
    rows = bench(args, bandwidth)
    command = "python benchmarks/translate_vs_hf.py " + " ".join(sys.argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"cpu": info, "args": vars(args), "bandwidth_bytes_per_s": bandwidth,
              "rows": rows, "command": command.strip()}
    (out / "translate_vs_hf.json").write_text(json.dumps(record, indent=2) + "\n")
    table = report(info, args, bandwidth, rows, command.strip())
    (out / "translate_vs_hf.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
