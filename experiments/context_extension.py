"""The context-extension study (configs/context_extension.py): every position scheme trained at
256 tokens, evaluated from 256 to 4,096 tokens zero-shot; RoPE also with its scalings set for
the evaluated length, and fine-tuned at 2x and 4x with linear, NTK and YaRN scaling.

    python experiments/context_extension.py train --seeds 0,1,2      # pretraining + fine-tunes
    python experiments/context_extension.py evaluate --seeds 0,1,2   # perplexity and passkey
    python experiments/context_extension.py report                   # tables and plots
    python experiments/context_extension.py all --runlocal --seeds 0 --root /tmp/ce  # a check

Each step is resumable (finished runs and evaluations are read back, not redone), writes under
--root (workdirs/context_extension) and the report into experiments/results/context_extension/
(tables.md; results.json: every evaluation's numbers; perplexity.png, key_nll.png).

Every evaluation at length L reads the same 16,384 tokens of the validation text (cut into rows
of L, in batches of at most 8 rows and 8,192 tokens) and scores the keys of 5 passkey prompts
per seed (one at each of 5 depths) of L - 7 tokens under teacher forcing
(eval.passkey_decode=False: the key's NLL and top-1 tokens). Greedy exact match is each run's
own last evaluation, at the length it trained at.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # configs/ is a folder of the checkout, not of the package
    sys.path.insert(0, str(ROOT))

from configs import context_extension as study  # noqa: E402

LENGTHS = (256, 512, 1024, 2048, 4096)
EVAL_TOKENS = 16384  # validation tokens read at every length
EVAL_BATCH = 8  # rows per evaluation batch, fewer past EVAL_BATCH_TOKENS tokens
EVAL_BATCH_TOKENS = 8192
PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
PASSKEY_PER_CELL = 1
ZERO_SHOT_SCALINGS = ("linear", "ntk", "dynamic", "yarn")
FINETUNE_METHODS = ("linear", "ntk", "yarn")
FINETUNE_FACTORS = (2, 4)
FINETUNE_LEARNING_RATE = 5e-4
RESULTS = ROOT / "experiments" / "results" / "context_extension"
# Schemes run for some seeds only (none now: FIRE's seeds 1 and 2 came later, with its
# whole-row bias, equal to the block form it trained seed 0 with).
ONLY_SEEDS: dict[str, tuple[int, ...]] = {}
CHANCE_NLL = 5 * math.log(10) / 6  # the answer " ddddd": a free space, then 5 digits
RUNLOCAL = {"variant": "", "pretrain_steps": study.PRETRAIN_STEPS,
            "finetune_steps": study.FINETUNE_STEPS, "lengths": LENGTHS}


def _use_runlocal() -> None:
    """configs/context_extension.py's runlocal variant: 20 steps, fine-tunes of 2, two lengths."""
    RUNLOCAL.update(variant=",runlocal", pretrain_steps=20, finetune_steps=2,
                    lengths=LENGTHS[:2])


# ------------------------------------------------------------------------------ the runs

def pretrain_dir(root: Path, scheme: str, seed: int) -> Path:
    return root / "pretrain" / scheme / f"seed{seed}"


def finetune_dir(root: Path, method: str, factor: int, seed: int) -> Path:
    return root / "finetune" / f"{method}_x{factor}" / f"seed{seed}"


def _schemes(seed: int) -> list[str]:
    return [s for s in study.SCHEMES if seed in ONLY_SEEDS.get(s, (seed,))]


def pretrain_command(root: Path, scheme: str, seed: int) -> list[str]:
    return ["./launch.sh", "train", f"configs/context_extension.py:{scheme}{RUNLOCAL['variant']}",
            "--workdir", str(pretrain_dir(root, scheme, seed)), f"--config.train.seed={seed}",
            f"--config.train.compilation_cache_dir={root / 'jax_cache'}"]


def finetune_command(root: Path, method: str, factor: int, seed: int) -> list[str]:
    """RoPE's seed-`seed` model fine-tuned at factor x the length with `method` scaling for
    FINETUNE_STEPS at the pretraining's tokens per step."""
    length = study.TRAIN_LENGTH * factor
    steps = RUNLOCAL["finetune_steps"]
    return ["./launch.sh", "train", f"configs/context_extension.py:rope{RUNLOCAL['variant']}",
            "--workdir", str(finetune_dir(root, method, factor, seed)),
            f"--config.init.checkpoint={pretrain_dir(root, 'rope', seed)}",
            f"--config.train.seed={seed}", f"--config.data.seq_len={length}",
            f"--config.data.batch_size={study.TOKENS_PER_STEP // length}",
            f"--config.model.rope_scaling={method}", f"--config.model.rope_scaling_factor={factor}",
            f"--config.train.num_steps={steps}", f"--config.train.checkpoint_every={steps}",
            f"--config.train.eval_every={steps}", f"--config.train.log_every={min(10, steps)}",
            f"--config.optimizer.learning_rate={FINETUNE_LEARNING_RATE}",
            "--config.optimizer.warmup_steps=1",
            f"--config.eval.passkey_lengths=({length - 7},)",
            f"--config.train.compilation_cache_dir={root / 'jax_cache'}"]


def finished(workdir: Path, steps: int) -> bool:
    return (workdir / "checkpoints" / str(steps)).is_dir()


def train_all(root: Path, seeds: list[int]) -> None:
    jobs = []
    for seed in seeds:  # seed by seed: the first seed's results come first
        jobs += [(pretrain_dir(root, s, seed), RUNLOCAL["pretrain_steps"],
                  pretrain_command(root, s, seed)) for s in _schemes(seed)]
        jobs += [(finetune_dir(root, m, f, seed), RUNLOCAL["finetune_steps"],
                  finetune_command(root, m, f, seed))
                 for f in FINETUNE_FACTORS for m in FINETUNE_METHODS]
    for workdir, steps, command in jobs:
        if finished(workdir, steps):
            continue
        workdir.mkdir(parents=True, exist_ok=True)
        print(" ".join(command), flush=True)
        with open(workdir.parent / f"{workdir.name}.log", "w") as log:
            subprocess.run(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, check=True)


# ------------------------------------------------------------------------ the evaluations

def variants(root: Path, seeds: list[int]) -> list[dict[str, Any]]:
    """Every (row of the tables, seed): the workdir and the model overrides per length."""
    rows = []
    for seed in seeds:
        for scheme in _schemes(seed):
            rows.append(dict(row=scheme, seed=seed, workdir=pretrain_dir(root, scheme, seed),
                             model=lambda length: {}))
        for scaling in ZERO_SHOT_SCALINGS:  # at the training length each is plain RoPE
            rows.append(dict(row=f"rope + {scaling} (zero-shot)", seed=seed,
                             workdir=pretrain_dir(root, "rope", seed), beyond_training=True,
                             model=lambda length, scaling=scaling: _zero_shot(scaling, length)))
        rows.append(dict(row="none + log-length temperature", seed=seed,
                         workdir=pretrain_dir(root, "none", seed),
                         model=lambda length: {"attention_log_length": study.TRAIN_LENGTH}))
        for factor in FINETUNE_FACTORS:
            for method in FINETUNE_METHODS:
                rows.append(dict(row=f"rope + {method}, fine-tuned at {factor}x", seed=seed,
                                 workdir=finetune_dir(root, method, factor, seed),
                                 model=lambda length: {}))
    return rows


def _zero_shot(scaling: str, length: int) -> dict[str, Any]:
    """The scaling set for `length`: factor length / 256 (1 at 256: plain RoPE); dynamic NTK
    sets its own from the row's length, so its factor stays 1."""
    factor = 1.0 if scaling == "dynamic" else max(1.0, length / study.TRAIN_LENGTH)
    return {"rope_scaling": scaling, "rope_scaling_factor": factor}


def evaluate_one(workdir: Path, length: int, model: dict[str, Any], cache: Path
                 ) -> dict[str, float]:
    from tfm import saved_config
    from tfm.training.evaluate import evaluate_checkpoint

    config = saved_config.load(workdir)
    rows = max(1, min(EVAL_BATCH, EVAL_BATCH_TOKENS // length))  # [rows, H, L, L] scores
    config.data.eval_seq_len = length
    config.data.eval_batch_size = rows
    config.eval.max_batches = max(1, EVAL_TOKENS // (rows * length))
    config.eval.update(passkey_lengths=(length - 7,), passkey_depths=PASSKEY_DEPTHS,
                       passkey_examples=PASSKEY_PER_CELL, passkey_decode=False)
    config.train.compilation_cache_dir = str(cache)
    config.model.update(model)
    metrics = evaluate_checkpoint(config, workdir)
    return {key: float(value) for key, value in metrics.items()
            if key == "eval_loss" or key.startswith("passkey/")}


def _saved(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def evaluate_all(root: Path, seeds: list[int]) -> None:
    """Every (row, seed, length) not yet in ROOT/evaluations.json. The file is read again
    before each evaluation and merged into on each write (replaced whole), so evaluations of
    other seeds may run at the same time."""
    path = root / "evaluations.json"
    for variant in variants(root, seeds):
        for length in RUNLOCAL["lengths"]:
            if variant.get("beyond_training") and length <= study.TRAIN_LENGTH:
                continue
            key = f"{variant['row']}|{variant['seed']}|{length}"
            if key in _saved(path):
                continue
            print(f"evaluating {key}", flush=True)
            result = evaluate_one(variant["workdir"], length, variant["model"](length),
                                  root / "jax_cache")
            partial = path.with_name(f"{path.name}.{os.getpid()}")
            partial.write_text(json.dumps({**_saved(path), key: result}, indent=1) + "\n")
            partial.replace(path)


# ------------------------------------------------------------------------------- the report

def collect(evaluations: dict[str, dict[str, float]]) -> dict[str, dict[int, dict[str, list]]]:
    """{row: {length: {"ppl", "passkey" (percent exact), "key_nll", "key_chars" (percent):
    [per seed], "depth": {d: [per seed]}}}}."""
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for key, metrics in evaluations.items():
        row, _, length = key.split("|")
        cell = table.setdefault(row, {}).setdefault(
            int(length), {"ppl": [], "passkey": [], "key_nll": [], "key_chars": [], "depth": {}})
        cell["ppl"].append(math.exp(metrics["eval_loss"]))
        prompt = int(length) - 7
        cell["key_nll"].append(metrics[f"passkey/passkey_len{prompt}_key_nll"])
        cell["key_chars"].append(metrics[f"passkey/passkey_len{prompt}_key_chars"])
        if f"passkey/passkey_len{prompt}" not in metrics:
            continue  # scored under teacher forcing only
        cell["passkey"].append(metrics[f"passkey/passkey_len{prompt}"])
        for depth in PASSKEY_DEPTHS:
            name = f"passkey/passkey_len{prompt}_depth{depth:g}"
            cell["depth"].setdefault(depth, []).append(metrics[name])
    return table


def _cell(values: list[float], digits: int) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f} (1 seed)"
    return f"{statistics.fmean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def markdown(table: dict, measure: str, digits: int) -> str:
    lines = ["| model | " + " | ".join(str(n) for n in LENGTHS) + " |",
             "|---|" + "---:|" * len(LENGTHS)]
    for row, cells in table.items():
        values = [_cell(cells.get(n, {}).get(measure, []), digits) for n in LENGTHS]
        lines.append(f"| {row} | " + " | ".join(values) + " |")
    return "\n".join(lines)


def rope_rows(table: dict) -> tuple[list[str], list[str]]:
    """(the schemes trained at 256 evaluated as trained, RoPE with its scalings and fine-tunes):
    the two panels of a plot."""
    rope = [row for row in table if row.startswith("rope")]
    return [row for row in table if row not in rope or row == "rope"], rope


def plot(table: dict, measure: str, ylabel: str, path: Path, log: bool) -> None:
    """Two panels, the schemes and RoPE's variants, a line per row (mean over seeds)."""
    from tfm.sweeps import plots

    pyplot = plots._pyplot()
    figure, panels = pyplot.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    for axes, rows, title in zip(panels, rope_rows(table),
                                 ("every scheme, as trained", "RoPE: scalings and fine-tunes"),
                                 strict=True):
        _lines(axes, {row: table[row] for row in rows}, measure, log)
        axes.set_title(title)
    panels[0].set_ylabel(ylabel)
    figure.suptitle(f"Context extension: {ylabel} by evaluation length (mean of seeds)")
    plots.write_png(figure, path)


def _lines(axes: Any, table: dict, measure: str, log: bool) -> None:
    for row, cells in table.items():
        lengths = [n for n in LENGTHS if cells.get(n, {}).get(measure)]
        means = [statistics.fmean(cells[n][measure]) for n in lengths]
        style = "--" if "fine-tuned" in row else (":" if "zero-shot" in row else "-")
        axes.plot(lengths, means, style, marker="o", label=row)
    axes.set_xscale("log", base=2)
    if log:
        axes.set_yscale("log")
    axes.set_xticks(LENGTHS, [str(n) for n in LENGTHS])
    axes.axvline(study.TRAIN_LENGTH, color="grey", linewidth=0.8)
    axes.set_xlabel("evaluation length (tokens; trained at 256)")
    axes.legend(fontsize=7)


def trained_length_exact(root: Path) -> dict[str, list[float]]:
    """{run kind: [exact-match percent per seed]} from each run's own last evaluation, greedy
    decoding at the length it trained at (256 for pretraining, 2x / 4x for fine-tunes)."""
    found: dict[str, list[float]] = {}
    for metrics in sorted(root.glob("*/*/seed*/metrics.jsonl")):
        final: dict[str, float] = {}
        for line in metrics.read_text().splitlines():
            final.update(json.loads(line))
        exact = [v for k, v in final.items()
                 if k.startswith("passkey/passkey_len") and k[19:].isdigit()]
        if exact:
            found.setdefault(metrics.parent.parent.name, []).extend(exact)
    return found


def report(root: Path, out: Path) -> None:
    evaluations = json.loads((root / "evaluations.json").read_text())
    table = collect(evaluations)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(evaluations, indent=1, sort_keys=True) + "\n")
    seeds = sorted({int(key.split("|")[1]) for key in evaluations})
    text = [f"Seeds {', '.join(map(str, seeds))}; mean ± sample std over seeds.", "",
            "## Perplexity of the validation text (characters) by evaluation length", "",
            markdown(table, "ppl", 2), "",
            "## Passkey exact match (%) at the length each run trained at (greedy decoding)", "",
            "| run | seeds | exact match |", "|---|---:|---:|",
            *(f"| {kind} | {len(values)} | {_cell(values, 0)} |"
              for kind, values in trained_length_exact(root).items()), "",
            "## The key under teacher forcing: NLL per key token (nats) by evaluation length", "",
            f"Knowing the format but not the key costs {CHANCE_NLL:.2f} nats per key token "
            "(the leading space is free, each of 5 digits ln 10).", "",
            markdown(table, "key_nll", 2), "",
            "## The key under teacher forcing: tokens ranked first (%)", "",
            markdown(table, "key_chars", 0), ""]
    (out / "tables.md").write_text("\n".join(text))
    plot(table, "ppl", "perplexity", out / "perplexity.png", log=True)
    plot(table, "key_nll", "key NLL (nats per token)", out / "key_nll.png", log=False)
    print("\n".join(text))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("train", "evaluate", "report", "all"))
    parser.add_argument("--runlocal", action="store_true",
                        help="the config's runlocal variant: a few steps, two lengths (a check)")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--root", default=str(ROOT / "workdirs" / "context_extension"))
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    root, seeds = Path(args.root).resolve(), [int(s) for s in args.seeds.split(",")]
    if args.runlocal:
        _use_runlocal()
    if args.step in ("train", "all"):
        train_all(root, seeds)
    if args.step in ("evaluate", "all"):
        evaluate_all(root, seeds)
    if args.step in ("report", "all"):
        report(root, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
