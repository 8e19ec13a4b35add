"""Length generalisation of every position scheme on a synthetic task: a thin wrapper over
`./launch.sh sweep` and `./launch.sh report` (tfm.sweeps.sweep, tfm.sweeps.report) that writes one
table.

    python experiments/position_sweep.py                          # decoder-only, reverse
    python experiments/position_sweep.py --config configs/synthetic_seq2seq.py --task sort
    python experiments/position_sweep.py --schemes rope,alibi --steps 500 --seeds 0,1

The same runs with the general tools (every scheme is the configs' `get_sweep`):

    ./launch.sh sweep configs/synthetic_lm.py:reverse --seeds 0,1,2 --parallel 2
    ./launch.sh report workdirs/sweeps/synthetic_lm_reverse

Each (scheme, seed) trains in its own workdir (resumable: finished runs are read back, not
retrained), then exact match on "validation" (unseen examples of the training lengths) and
"test" (longer sequences) is tabulated, mean ± std over seeds. Writes experiments/results/
position_sweep_<config>_<task>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tfm.nn.positions import POSITION_SCHEMES  # noqa: E402
from tfm.sweeps import report, sweep  # noqa: E402

METRICS = ("eval_exact_match", "eval_test_exact_match", "eval_loss", "eval_test_loss")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/synthetic_lm.py")
    parser.add_argument("--task", default="reverse")
    parser.add_argument("--schemes", default=",".join(POSITION_SCHEMES))
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=None, help="override train.num_steps")
    parser.add_argument("--runlocal", action="store_true", help="use the runlocal variant")
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--workdir", default="workdirs/position_sweep")
    parser.add_argument("--out", default=str(ROOT / "experiments" / "results"))
    args = parser.parse_args()

    config_arg = f"{args.config}:{args.task}" + (",runlocal" if args.runlocal else "")
    overrides = sweep.product(
        sweep.sweep("model.position_scheme", args.schemes.split(",")),
        sweep.sweep(sweep.SEED_FIELD, [int(s) for s in args.seeds.split(",")]),
    )
    extra = []
    if args.steps:
        extra = [f"--config.{field}={args.steps}" for field in (
            "train.num_steps", "train.eval_every",
            "train.checkpoint_every")]
    root = Path(args.workdir)
    if not root.is_absolute():
        root = ROOT / root
    runs = sweep.make_runs(config_arg, overrides, root, extra)
    sweep.run_sweep(runs, root, args.parallel)

    fields, metrics, rows = report.aggregate(report.find_runs(root), METRICS)
    title = f"Position schemes on {args.task} ({args.config}, seeds {args.seeds})"
    lines = [f"# {title}", "",
             "| scheme | seeds | exact match, train lengths | exact match, longer | loss | "
             "loss, longer |", "|---|---|---|---|---|---|"]
    for row in rows:
        cells = [report.format_cell(row[m], row["seeds"]) for m in metrics]
        lines.append(f"| {row['model.position_scheme']} | {row['seeds']} | "
                     f"{cells[0]}% | {cells[1]}% | {cells[2]} | {cells[3]} |")
    command = " ".join(["python", "experiments/position_sweep.py", *sys.argv[1:]])
    lines += ["", f"Command: `{command}`"]
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"position_sweep_{Path(args.config).stem}_{args.task}"
    (out / f"{stem}.json").write_text(json.dumps(
        [{"scheme": row["model.position_scheme"], "seeds": row["seeds"],
          **{m: row[m][0] for m in metrics}, **{f"{m}_std": row[m][1] for m in metrics}}
         for row in rows], indent=1))
    (out / f"{stem}.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
