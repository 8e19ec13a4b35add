"""Measures the README quick start, so the numbers quoted there come from a run, not memory.

    python experiments/measure_quickstart.py                 # 3-5 minutes on a 2-core CPU
    python experiments/measure_quickstart.py --steps 100     # a quick try of the script itself
    python experiments/measure_quickstart.py --config configs/char_lm.py --prompt ROMEO:

Runs the quick start's commands as a new user would (./launch.sh train, then generate with the
README's prompts) in a fresh workdir, and writes experiments/results/quickstart.{json,md}: held-out
exact match at every evaluation, the test split (longer strings), wall-clock time, the parameter
count and the generated outputs. Training is deterministic (seeded data, init and dropout), so
the accuracies repeat from run to run; the time depends on the machine. `--config` measures
another config the same way (every eval metric it logs) into results/<config name>.{json,md}.
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

    from tfm.training import checkpoint

    with checkpoint.Checkpointer(workdir / "checkpoints", async_save=False) as checkpointer:
        params = checkpointer.restore()["params"]
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=CONFIG, help=f"default: {CONFIG}, the quick start")
    parser.add_argument("--prompt", action="append", default=None,
                        help=f"generate from it (repeatable; default {', '.join(PROMPTS)})")
    parser.add_argument("--steps", type=int, default=None, help="default: the config's")
    parser.add_argument("--output", default=None,
                        help="default: experiments/results/quickstart (or <config name>)")
    args = parser.parse_args()
    config = args.config
    name = "quickstart" if config == CONFIG else Path(config.split(":")[0]).stem
    output = Path(args.output or REPO / "experiments" / "results" / name)
    overrides = [f"--config.train.num_steps={args.steps}"] if args.steps else []

    with tempfile.TemporaryDirectory(prefix="tfm_quickstart_") as scratch:
        workdir = Path(scratch) / "run"
        # A fresh data directory too: the first run's dataset generation is part of the time.
        env = {**os.environ, "TFDS_DATA_DIR": str(Path(scratch) / "tensorflow_datasets")}
        start = time.perf_counter()
        run("train", config, "--workdir", str(workdir), *overrides, env=env)
        train_seconds = time.perf_counter() - start
        prompts = [arg for prompt in args.prompt or PROMPTS for arg in ("--prompt", prompt)]
        generated = run("generate", config, "--workdir", str(workdir), *prompts, env=env)
        records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
        num_params = parameter_count(workdir)

    evaluations = [r for r in records if "eval_loss" in r]
    columns = sorted({key for r in evaluations for key in r if key.startswith("eval_")})
    results = {
        "command": f"./launch.sh train {config} {' '.join(overrides)}".strip(),
        "train_wall_seconds": round(train_seconds, 1),
        "parameters": num_params,
        "evaluations": evaluations,
        "generated": generated.stdout.strip(),  # lines "PROMPT<tab>-><tab>OUTPUT"
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "date": time.strftime("%Y-%m-%d"),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    minutes, seconds = divmod(round(train_seconds), 60)
    lines = [
        f"# {'Quick start' if name == 'quickstart' else config}, measured ({results['date']}, "
        f"{results['machine']})",
        "",
        f"`{results['command']}`: {num_params:,} parameters, {minutes} min {seconds} s wall clock "
        "(including dataset generation and compilation).",
        "",
        "| step | " + " | ".join(columns) + " |",
        "|---|" + "---|" * len(columns),
        *(f"| {e['step']} | " + " | ".join(f"{e.get(c, float('nan')):.4g}" for c in columns)
          + " |" for e in evaluations),
        "",
        "Exact match is in percent; on the synthetic tasks `eval` holds unseen strings of the "
        "training lengths, `eval_test` longer ones.",
        "",
        "Generated (the config's `generate` settings):",
        "",
        "```",
        results["generated"].replace("\t", " "),
        "```",
        "",
    ]
    output.with_suffix(".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
