"""Input-pipeline throughput: examples/s and tokens/s of the packed training pipeline.

Datasets (from the shared data folder, default ../shared/data next to the repository):
  tinyshakespeare   char-level LM, seq_len 256, paragraphs cut into windows, packed
  multi30k de->en   seq2seq, shared SentencePiece vocabulary (8000), seq_len 64/64, packed

Each is measured with grain read threads (the default) and with worker processes. Preparation
(tfds array_record) and tokenizer training are timed once, in a fresh data directory unless
--data_dir is given. Throughput is the median of --repeats windows of --seconds each, after a
warm-up. "examples" are packed segments (for the LM: windows of at most seq_len tokens);
"tokens" are non-padding target tokens (plus source tokens, reported separately).

    python benchmarks/data_pipeline.py    # writes benchmarks/results/data_pipeline.{json,md}
    python benchmarks/data_pipeline.py --seconds 3 --repeats 1    # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from absl import flags

REPO = Path(__file__).resolve().parents[1]


def configs(shared: Path, data_dir: Path) -> dict[str, dict]:
    multi30k = shared / "multi30k"
    return {
        "tinyshakespeare (char LM)": dict(
            kind="text",
            path=str(shared / "tinyshakespeare.txt"),
            tokenizer="char",
            seq_len=256,
            batch_size=64,
            packing=True,
            data_dir=str(data_dir),
        ),
        "multi30k de-en (spm 8000, seq2seq)": dict(
            kind="parallel",
            source_path=str(multi30k / "train.de.gz"),
            target_path=str(multi30k / "train.en.gz"),
            eval_source_path=str(multi30k / "val.de.gz"),
            eval_target_path=str(multi30k / "val.en.gz"),
            tokenizer="sentencepiece",
            vocab_size=8000,
            shared_vocab=True,
            seq_len=64,
            source_seq_len=64,
            batch_size=128,
            packing=True,
            data_dir=str(data_dir),
        ),
    }


def measure(iterator, seconds: float, warmup: int) -> dict[str, float]:
    for _ in range(warmup):
        next(iterator)
    batches = examples = tokens = source_tokens = slots = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        batch = next(iterator)
        batches += 1
        examples += int(batch["segment_ids"].max(axis=1).sum())
        tokens += int((batch["segment_ids"] > 0).sum())
        slots += batch["segment_ids"].size
        if "source_segment_ids" in batch:
            source_tokens += int((batch["source_segment_ids"] > 0).sum())
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu_start  # all threads of this process (not worker processes)
    return {
        "batches_per_s": batches / elapsed,
        "examples_per_s": examples / elapsed,
        "tokens_per_s": tokens / elapsed,
        "source_tokens_per_s": source_tokens / elapsed,
        "fill": tokens / max(slots, 1),
        "examples_per_cpu_s": examples / max(cpu, 1e-9),
        "cpu_utilisation": cpu / elapsed,
    }


def run(args: argparse.Namespace) -> list[dict]:
    from tfm.data import build, build_data

    fresh = args.data_dir is None
    data_dir = Path(tempfile.mkdtemp(prefix="tfm_data_bench_")) if fresh else Path(args.data_dir)
    results = []
    try:
        for name, config in configs(Path(args.shared), data_dir).items():
            start = time.perf_counter()
            data = build_data(config)
            build_seconds = time.perf_counter() - start
            summary = build.dataset_summary(data)
            for variant, overrides in (
                ("2 read threads", dict(read_threads=2, num_workers=0)),
                ("2 worker processes", dict(read_threads=1, num_workers=2)),
            ):
                variant_data = build_data({**config, **overrides})
                start = time.perf_counter()
                iterator = variant_data.train_iterator()
                next(iterator)
                first_batch_seconds = time.perf_counter() - start
                runs = [measure(iterator, args.seconds, args.warmup) for _ in range(args.repeats)]
                median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                iterator.close()
                row = {
                    "dataset": name,
                    "variant": variant,
                    "batch_size": config["batch_size"],
                    "seq_len": config["seq_len"],
                    "build_s": build_seconds,
                    "first_batch_s": first_batch_seconds,
                    **median,
                    "runs": runs,
                    "summary": summary,
                }
                results.append(row)
                print(
                    f"{name:36s} {variant:20s} {median['examples_per_s']:10.0f} ex/s "
                    f"{median['tokens_per_s']:12.0f} tok/s  fill {median['fill']:.3f}",
                    flush=True,
                )
    finally:
        if fresh:
            shutil.rmtree(data_dir, ignore_errors=True)
    return results


def markdown(results: list[dict], args: argparse.Namespace) -> str:
    lines = [
        "# Input pipeline throughput (packed training batches)",
        "",
        f"Machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPU cores (shared, noisy). "
        f"Median of {args.repeats} windows of {args.seconds:g} s after {args.warmup} warm-up "
        "batches. build = preparation + tokenizer training on a fresh data dir "
        f"(later runs reuse both). 1-minute load average when written: {os.getloadavg()[0]:.1f}.",
        "",
        "| dataset | variant | batch x len | examples/s | target tokens/s | source tokens/s "
        "| batches/s | fill | examples per CPU-s (threads) | first batch (s) | build (s) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        per_cpu = "-" if "worker" in r["variant"] else f"{r['examples_per_cpu_s']:,.0f}"
        lines.append(
            f"| {r['dataset']} | {r['variant']} | {r['batch_size']} x {r['seq_len']} "
            f"| {r['examples_per_s']:,.0f} | {r['tokens_per_s']:,.0f} "
            f"| {r['source_tokens_per_s']:,.0f} | {r['batches_per_s']:.1f} | {r['fill']:.3f} "
            f"| {per_cpu} | {r['first_batch_s']:.1f} | {r['build_s']:.1f} |"
        )
    command = " ".join(["python benchmarks/data_pipeline.py", *args.argv])
    lines += [
        "",
        "examples per CPU-s: examples per second of CPU time used by the pipeline's threads, a",
        "figure that does not depend on how busy the shared machine was.",
        "",
        f"Command: `{command}`",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shared", default=str(REPO.parent / "shared" / "data"))
    parser.add_argument("--data_dir", default=None, help="reuse prepared data (default: fresh)")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args, _ = parser.parse_known_args()
    args.argv = sys.argv[1:]
    flags.FLAGS.mark_as_parsed()  # grain worker processes read absl flags
    results = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data_pipeline.json").write_text(json.dumps(results, indent=2))
    (out / "data_pipeline.md").write_text(markdown(results, args))
    print(markdown(results, args))


if __name__ == "__main__":
    main()
