"""Sweep: length generalisation of every position scheme on a synthetic task.

    python experiments/position_sweep.py                          # decoder-only, reverse
    python experiments/position_sweep.py --config configs/synthetic_seq2seq.py --task sort
    python experiments/position_sweep.py --schemes rope,alibi --steps 500 --seeds 0,1

Trains the config once per (scheme, seed) in its own workdir (resumable: finished runs are
read back, not retrained), then tabulates exact match on "validation" (unseen examples of the
training lengths) and "test" (longer sequences). Writes experiments/results/
position_sweep_<config>_<task>.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tfm.config import POSITION_SCHEMES  # noqa: E402
from tfm.metrics import read_metrics  # noqa: E402
from tfm.train import train_and_evaluate  # noqa: E402


def load_config(path: str, arg: str):
    spec = importlib.util.spec_from_file_location("sweep_config", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


def final_eval(workdir: Path) -> dict[str, float]:
    """The last eval record a finished run wrote."""
    records = [r for r in read_metrics(workdir) if "eval_exact_match" in r]
    return records[-1] if records else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/synthetic_lm.py")
    parser.add_argument("--task", default="reverse")
    parser.add_argument("--schemes", default=",".join(POSITION_SCHEMES))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=None, help="override train.num_steps")
    parser.add_argument("--runlocal", action="store_true", help="use the runlocal variant")
    parser.add_argument("--workdir", default="workdirs/position_sweep")
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    args = parser.parse_args()

    rows = []
    for scheme in args.schemes.split(","):
        runs = []
        for seed in (int(s) for s in args.seeds.split(",")):
            variant = ",".join([args.task, scheme] + (["runlocal"] if args.runlocal else []))
            config = load_config(args.config, variant)
            config.train.seed = seed
            config.train.progress_bar = False
            if args.steps:
                config.train.num_steps = args.steps
                config.optimizer.total_steps = args.steps
                config.train.eval_every = args.steps
                config.train.checkpoint_every = args.steps
            workdir = Path(args.workdir) / f"{Path(args.config).stem}_{args.task}_{scheme}_s{seed}"
            done = (workdir / "metrics.jsonl").exists() and final_eval(workdir).get(
                "step") == config.train.num_steps
            if not done:
                train_and_evaluate(config, workdir)
            runs.append(final_eval(workdir))
        row = {"scheme": scheme, "seeds": len(runs)}
        for key in ("eval_exact_match", "eval_test_exact_match", "eval_loss", "eval_test_loss"):
            values = [r[key] for r in runs if key in r]
            row[key] = statistics.mean(values) if values else float("nan")
        rows.append(row)
        print(json.dumps(row))

    title = f"Position schemes on {args.task} ({args.config}, seeds {args.seeds})"
    lines = [f"# {title}", "",
             "| scheme | exact match, train lengths | exact match, longer | loss | loss, longer |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | {r['eval_exact_match']:.1f}% | "
                     f"{r['eval_test_exact_match']:.1f}% | {r['eval_loss']:.3f} | "
                     f"{r['eval_test_loss']:.3f} |")
    command = " ".join(["python", "experiments/position_sweep.py", *sys.argv[1:]])
    lines += ["", f"Command: `{command}`"]
    report = "\n".join(lines)
    print(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"position_sweep_{Path(args.config).stem}_{args.task}"
    (out / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    (out / f"{stem}.md").write_text(report + "\n")


if __name__ == "__main__":
    main()
