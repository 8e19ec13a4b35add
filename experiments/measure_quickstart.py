"""Measures the README quick start, so the numbers quoted there come from a run, not memory.

    python experiments/measure_quickstart.py                 # 3-5 minutes on a 2-core CPU
    python experiments/measure_quickstart.py --steps 100     # a quick try of the script itself

Runs the quick start's commands as a new user would (./launch.sh train, then generate with the
README's prompts) in a fresh workdir, and writes experiments/results/quickstart.{json,md}: held-out
exact match at every evaluation, the test split (longer strings), wall-clock time, the parameter
count and the generated outputs. Training is deterministic (seeded data, init and dropout), so
the accuracies repeat from run to run; the time depends on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = "configs/synthetic_seq2seq.py"
PROMPTS = ("3141592", "12345678901")


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", str(REPO / "launch.sh"), *args], cwd=REPO, env=env,
                            capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"./launch.sh {' '.join(args)} failed:\n{result.stderr[-3000:]}")
    return result


def parameter_count(workdir: Path) -> int:
    import jax
    import numpy as np

    from tfm import checkpoint

    with checkpoint.Checkpointer(workdir / "checkpoints", async_save=False) as checkpointer:
        params = checkpointer.restore()["params"]
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="default: the config's (1,000)")
    parser.add_argument("--output", default=str(REPO / "experiments" / "results" / "quickstart"))
    args = parser.parse_args()
    overrides = [f"--config.train.num_steps={args.steps}"] if args.steps else []

    with tempfile.TemporaryDirectory(prefix="tfm_quickstart_") as scratch:
        workdir = Path(scratch) / "run"
        # A fresh data directory too: the first run's dataset generation is part of the time.
        env = {**os.environ, "TFDS_DATA_DIR": str(Path(scratch) / "tensorflow_datasets")}
        start = time.perf_counter()
        run("train", CONFIG, "--workdir", str(workdir), *overrides, env=env)
        train_seconds = time.perf_counter() - start
        prompts = [arg for prompt in PROMPTS for arg in ("--prompt", prompt)]
        generated = run("generate", CONFIG, "--workdir", str(workdir), *prompts, env=env)
        records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
        num_params = parameter_count(workdir)

    evaluations = [
        {key: r[key] for key in ("step", "eval_loss", "eval_exact_match", "eval_test_exact_match")
         if key in r}
        for r in records if "eval_exact_match" in r
    ]
    outputs = [line.split("\t") for line in generated.stdout.strip().splitlines()]
    results = {
        "command": f"./launch.sh train {CONFIG} {' '.join(overrides)}".strip(),
        "train_wall_seconds": round(train_seconds, 1),
        "parameters": num_params,
        "evaluations": evaluations,
        "generated": {prompt: output for prompt, _, output in outputs},
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "date": time.strftime("%Y-%m-%d"),
    }
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    minutes, seconds = divmod(round(train_seconds), 60)
    lines = [
        f"# Quick start, measured ({results['date']}, {results['machine']})",
        "",
        f"`{results['command']}`: {num_params:,} parameters, {minutes} min {seconds} s wall clock "
        "(including dataset generation and compilation).",
        "",
        "| step | eval_loss | exact match, lengths 1-12 (unseen) | exact match, lengths 13-24 |",
        "|---|---|---|---|",
        *(f"| {e['step']} | {e['eval_loss']:.4f} | {e['eval_exact_match']:.1f}% | "
          f"{e.get('eval_test_exact_match', float('nan')):.1f}% |" for e in evaluations),
        "",
        "Generated (greedy):",
        "",
        *(f"    {prompt} -> {output}" for prompt, output in results["generated"].items()),
        "",
    ]
    output.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
