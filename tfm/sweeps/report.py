"""`./launch.sh report ROOT`: one table and plots for any sweep (tfm.sweeps.sweep) or folder of
runs.

Reads each run's overrides from ROOT/sweep.json (or ROOT/*/sweep_run.json) and its metrics from
ROOT/NAME/metrics.jsonl (the last value of each metric). Runs that differ only in train.seed
form a group; the table has mean ± std (sample std over seeds) per group. Writes
ROOT/report.{md,csv,json}, ROOT/report_<metric>.png (metric vs the swept field, error bars =
std) and ROOT/curves_<metric>.png (the metric over steps, a line per run, a point per
evaluation, a colour per group). Every plot has a title (`--title` heads it) and units: rates
(exact match, accuracy) in percent on an axis from 0 to 100, losses in nats/token. With runs
evaluated at several lengths (`./launch.sh eval ... --eval_seq_len 64,128,...` writes
eval_seq_len.json), also ROOT/report_eval_seq_len_<metric>.png: the metric vs eval length, a
line per group. Runs trained with train.diagnostics_every add ROOT/diagnostics_<family>.png: per
group, the last logged per-layer norms (a line over layers) or per-layer, per-head attention
statistics (a heatmap layers x heads), mean over seeds. Runs with passkey evaluations
(eval.passkey_lengths) add ROOT/report_passkey_<task>.png: accuracy by length x depth, a
heatmap per group, mean over seeds.

report.json keeps every run's final metrics and eval lengths (`runs`), so a results folder
outlives its workdirs: `--merge OLD/report.json` pools an earlier report's runs (e.g. other
seeds, run in another session or on another machine) into this one. Runs of the same name
come from ROOT. A report written before `runs` existed is pooled through its rows: (seeds, mean,
std) per group combine exactly into the pooled mean and sample std. The plots are drawn by
tfm/sweeps/plots.py.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tfm.sweeps import plots
from tfm.sweeps.sweep import RUN_FILE, SEED_FIELD, SWEEP_FILE, group_key, read_json
from tfm.training.metrics import read_metrics

LENGTHS_FILE = "eval_seq_len.json"


def find_runs(root: Path) -> list[dict[str, Any]]:
    """[{name, overrides, workdir, status}] of the sweep under `root`."""
    manifest = read_json(root / SWEEP_FILE)
    if manifest:
        runs = manifest["runs"]
        for run in runs:
            status = read_json(root / run["name"] / RUN_FILE) or {}
            run["status"] = status.get("status", run.get("status", "pending"))
            if "error" in status:
                run["error"] = status["error"]
            run["workdir"] = str(root / run["name"])
        return runs
    runs = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        status = read_json(folder / RUN_FILE)
        if status or (folder / "metrics.jsonl").exists():
            status = status or {"overrides": {}, "status": "done"}
            runs.append({**status, "name": folder.name, "workdir": str(folder)})
    return runs


def final_metrics(workdir: Path) -> dict[str, float]:
    """The last logged value of every metric of a run ({} without metrics.jsonl)."""
    if not (workdir / "metrics.jsonl").exists():
        return {}
    final: dict[str, float] = {}
    for record in read_metrics(workdir):
        final.update(record)
    return final


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """(mean, sample standard deviation); std is 0 for one value, NaN for none."""
    if not values:
        return math.nan, math.nan
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def pooled_mean_std(parts: Sequence[tuple[int, float, float]]) -> tuple[float, float]:
    """(mean, sample std) of the union of samples given as (count, mean, sample std) parts:
    mean = sum(n m) / N, variance = (sum((n - 1) s^2) + sum(n (m - mean)^2)) / (N - 1)."""
    parts = [part for part in parts if part[0] > 0 and not math.isnan(part[1])]
    total = sum(n for n, _, _ in parts)
    if total == 0:
        return math.nan, math.nan
    mean = sum(n * m for n, m, _ in parts) / total
    if total == 1:
        return mean, 0.0
    within = sum((n - 1) * s * s for n, _, s in parts)
    between = sum(n * (m - mean) ** 2 for n, m, _ in parts)
    return mean, math.sqrt(max(within + between, 0.0) / (total - 1))


def aggregate(runs: Sequence[dict[str, Any]], metrics: Sequence[str] | None = None,
              earlier_rows: Sequence[dict[str, Any]] = ()
              ) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """(group fields, metric names, rows): a row per group of runs that differ only in their
    seed, with `<metric>` = (mean, std) over the runs that have it and `seeds` = how many.
    A run may carry its `final` metrics already (a run read back from a report.json).
    `earlier_rows` (rows of an old report.json, with `seeds` and (mean, std) per metric) pool
    into the group with the same field values."""
    for run in runs:
        if "final" not in run:
            run["final"] = final_metrics(Path(run["workdir"]))
    if metrics is None:
        names = {key for run in runs for key in run["final"] if key.startswith("eval_")}
        names |= {key for row in earlier_rows for key in row if key.startswith("eval_")}
        metrics = sorted(names)
    fields: list[str] = []
    for run in runs:
        fields += [key for key in run["overrides"] if key != SEED_FIELD and key not in fields]
    for row in earlier_rows:
        missing = [f for f in fields if f not in row]
        if missing:
            raise ValueError(f"a merged report has no field {', '.join(missing)}; its fields: "
                             f"{', '.join(k for k in row if not isinstance(row[k], list))}")
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault(group_key(run["overrides"], fields), []).append(run)
    summaries: dict[tuple, list[dict[str, Any]]] = {}
    for row in earlier_rows:
        key = tuple(str(row[f]) for f in fields)
        summaries.setdefault(key, []).append(row)
        groups.setdefault(key, [])
    rows = []
    for key, members in groups.items():
        row: dict[str, Any] = dict(zip(fields, key, strict=True))
        # A run counts once it has one of the table's metrics (a run stopped before its first
        # evaluation has only training metrics).
        done = [m for m in members if any(metric in m["final"] for metric in metrics)]
        old = [r for r in summaries.get(key, [])
               if any(metric in r and not math.isnan(r[metric][0]) for metric in metrics)]
        row["seeds"] = len(done) + sum(r["seeds"] for r in old)
        row["failed"] = (sum(m.get("status") == "failed" for m in members)
                         + sum(r.get("failed", 0) for r in old))
        for metric in metrics:
            parts = [(1, m["final"][metric], 0.0) for m in done if metric in m["final"]]
            parts += [(r["seeds"], *r[metric]) for r in old if metric in r]
            row[metric] = pooled_mean_std(parts)
        rows.append(row)
    return fields, list(metrics), rows


def read_merged(paths: Sequence[Path], runs: Sequence[dict[str, Any]]
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """(runs, summary rows, notes) from earlier report.json files: their per-run records,
    except runs named like one in `runs` (ROOT's own come first); the rows of a report that has
    no per-run records; a line per file for the report."""
    names = {run["name"] for run in runs}
    merged_runs, summary_rows, notes = [], [], []
    for path in paths:
        try:
            earlier = json.loads(Path(path).read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"--merge {path}: not a readable report.json ({error})") from None
        if not isinstance(earlier, dict) or "rows" not in earlier:
            raise ValueError(f"--merge {path}: not a report.json (no 'rows')")
        if "runs" in earlier:
            fresh = [run for run in earlier["runs"] if run["name"] not in names]
            names |= {run["name"] for run in fresh}
            merged_runs += [{**run, "workdir": None} for run in fresh]
            skipped = len(earlier["runs"]) - len(fresh)
            notes.append(f"{path}: {len(fresh)} runs" + (f" ({skipped} already here)"
                                                          if skipped else ""))
        else:
            summary_rows += [row for row in earlier["rows"] if row.get("seeds")]
            notes.append(f"{path}: pooled from its rows (it has no per-run records)")
    return merged_runs, summary_rows, notes


def format_cell(value: tuple[float, float], seeds: int) -> str:
    mean, std = value
    if math.isnan(mean):
        return "n/a"
    return f"{mean:.4g} ± {std:.2g}" if seeds > 1 else f"{mean:.4g}"


def markdown_table(fields: Sequence[str], metrics: Sequence[str], rows: Sequence[dict]) -> str:
    header = [*fields, "seeds", *metrics]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        seeds = row["seeds"] if not row["failed"] else f"{row['seeds']} ({row['failed']} failed)"
        cells = [str(row[f]) for f in fields] + [str(seeds)]
        cells += [format_cell(row[m], row["seeds"]) for m in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def csv_table(fields: Sequence[str], metrics: Sequence[str], rows: Sequence[dict]) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow([*fields, "seeds", "failed",
                     *(f"{m}_{part}" for m in metrics for part in ("mean", "std"))])
    for row in rows:
        writer.writerow([row[f] for f in fields] + [row["seeds"], row["failed"]]
                        + [v for m in metrics for v in row[m]])
    return out.getvalue()


def length_table(runs: Sequence[dict], fields: Sequence[str], metric: str
                 ) -> tuple[list[int], list[dict[str, Any]]]:
    """From each run's eval_seq_len.json: (lengths, a row per group with `metric` (mean, std)
    per length, None where the length is n/a (e.g. learned positions past max_len), `seeds` (the
    runs in the group) and `n/a` (the reasons given, sorted))."""
    lengths: set[int] = set()
    per_run = {}
    for run in runs:
        results = run.get("lengths")
        if results:
            per_run[run["name"]] = {int(k): v for k, v in results.items()}
            lengths |= set(per_run[run["name"]])
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        if run["name"] in per_run:
            groups.setdefault(group_key(run["overrides"], fields), []).append(
                per_run[run["name"]])
    rows = []
    for key, members in groups.items():
        row: dict[str, Any] = dict(zip(fields, key, strict=True))
        for length in sorted(lengths):
            values = [m[length][metric] for m in members if metric in m.get(length, {})]
            row[length] = mean_std(values) if values else None
        row["seeds"] = len(members)
        row["n/a"] = sorted({m[n]["n/a"] for m in members for n in m if "n/a" in m[n]})
        rows.append(row)
    return sorted(lengths), rows


def write_report(root: Path, metrics: Sequence[str] | None = None, x_field: str | None = None,
                 title: str | None = None, merge: Sequence[Path] = ()) -> dict[str, Any]:
    """Writes the table and plots; returns {"fields", "metrics", "rows", "files"}. `merge`:
    earlier report.json files whose runs join ROOT's (see the module docstring)."""
    runs = find_runs(root) if root.is_dir() else []
    for run in runs:  # read once: the length tables and report.json's run records use it
        run["lengths"] = read_json(Path(run["workdir"]) / LENGTHS_FILE)
    merged_runs, summary_rows, notes = read_merged(merge, runs)
    runs = runs + merged_runs
    if not runs and not summary_rows:
        raise FileNotFoundError(f"no runs under {root} (no sweep.json, no */metrics.jsonl)")
    fields, metrics, rows = aggregate(runs, metrics, summary_rows)
    if x_field is None:
        varying = [f for f in fields if len({row[f] for row in rows}) > 1]
        x_field = varying[0] if varying else (fields[0] if fields else None)
    elif x_field not in fields:
        raise ValueError(f"--x={x_field!r} is not a swept field; swept: {', '.join(fields)}")
    root.mkdir(parents=True, exist_ok=True)
    files = []
    table = markdown_table(fields, metrics, rows)
    heading = title or f"Sweep {root}"
    sections = [f"# {heading}", "", table]
    if notes:
        sections += ["", "Merged with earlier reports:", *(f"- {note}" for note in notes)]
    for metric in metrics:
        lengths, length_rows = length_table(runs, fields, metric)
        if all(row[n] is None for row in length_rows for n in lengths):
            continue  # no run evaluated this metric at several lengths
        header = [*fields, *(f"len {n}" for n in lengths)]
        lines = [f"{metric} by evaluation length (`eval --eval_seq_len`):", "",
                 "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for row in length_rows:
            cells = [str(row[f]) for f in fields]
            cells += ["n/a" if row[n] is None else format_cell(row[n], row["seeds"])
                      for n in lengths]
            lines.append("| " + " | ".join(cells) + " |")
        reasons = sorted({reason for row in length_rows for reason in row["n/a"]})
        lines += ["", *(f"n/a: {reason}" for reason in reasons)] if reasons else []
        sections += ["", *lines]
        path = root / f"report_eval_seq_len_{metric}.png"
        plots.write_png(plots.lengths_figure(lengths, length_rows, fields, metric, title), path)
        files.append(path)
    (root / "report.md").write_text("\n".join(sections) + "\n")
    (root / "report.csv").write_text(csv_table(fields, metrics, rows))
    (root / "report.json").write_text(json.dumps(
        {"fields": fields, "metrics": metrics, "rows": rows, "runs": run_records(runs)},
        indent=1, default=str))
    files += [root / "report.md", root / "report.csv", root / "report.json"]
    for metric in metrics:
        if x_field is not None and any(not math.isnan(row[metric][0]) for row in rows):
            path = root / f"report_{metric}.png"
            plots.plot_metric(rows, fields, metric, x_field, path, title)
            files.append(path)
        path = root / f"curves_{metric}.png"
        if plots.plot_curves(runs, metric, path, fields, title):
            files.append(path)
    if plots.plot_curves(runs, "train_loss", root / "curves_train_loss.png", fields, title):
        files.append(root / "curves_train_loss.png")
    for task, (lengths, depths) in passkey_cells(runs).items():
        path = root / f"report_passkey_{task}.png"
        plots.plot_passkey(passkey_grids(runs, fields, task, lengths, depths), lengths, depths,
                           task, path, title)
        files.append(path)
    for family in diagnostic_families(runs):
        path = root / f"diagnostics_{family}.png"
        plots.plot_diagnostics(diagnostics_table(runs, fields, family), family, path)
        files.append(path)
    return {"fields": fields, "metrics": metrics, "rows": rows, "files": files, "table": table}


def run_records(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What report.json keeps of each run: name, overrides, status, final metrics and the
    eval-length results, enough for a later `--merge` without the workdir."""
    records = []
    for run in runs:
        lengths = run.get("lengths")
        record = {"name": run["name"], "overrides": run["overrides"],
                  "status": run.get("status", "done"), "final": run["final"]}
        if lengths:
            record["lengths"] = lengths
        records.append(record)
    return records


DIAGNOSTICS = "diagnostics/"  # tfm/training/diagnostics.py: diagnostics/<family>/<layer>[/head_h]


PASSKEY_CELL = re.compile(r"passkey/(?P<task>\w+?)_len(?P<length>\d+)_depth(?P<depth>[0-9.e-]+)$")


def passkey_cells(runs: Sequence[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """{task: (lengths, depths)} of the passkey cells (`passkey/{task}_len{L}_depth{D}`,
    tfm.training.long_context) in the runs' final metrics, each sorted."""
    cells: dict[str, tuple[set[int], set[float]]] = {}
    for run in runs:
        for name in run["final"]:
            match = PASSKEY_CELL.match(name)
            if match:
                lengths, depths = cells.setdefault(match["task"], (set(), set()))
                lengths.add(int(match["length"]))
                depths.add(float(match["depth"]))
    return {task: (sorted(lengths), sorted(depths)) for task, (lengths, depths) in cells.items()}


def passkey_grids(runs: Sequence[dict], fields: Sequence[str], task: str, lengths: Sequence[int],
                  depths: Sequence[float]) -> dict[str, list[list[float]]]:
    """{group label: rows by depth, columns by length: mean accuracy over the group's seeds
    (nan: not run)}."""
    names = {(n, d): f"passkey/{task}_len{n}_depth{d:g}" for n in lengths for d in depths}
    _, _, rows = aggregate(runs, sorted(names.values()))
    return {", ".join(f"{f}={row[f]}" for f in fields) or "runs":
            [[row[names[n, d]][0] for n in lengths] for d in depths] for row in rows}


def diagnostic_families(runs: Sequence[dict]) -> list[str]:
    """The diagnostics families (param_norm, attention_entropy, ...) in the runs' final metrics."""
    return sorted({key.split("/")[1] for run in runs for key in run["final"]
                   if key.startswith(DIAGNOSTICS)})


def diagnostics_table(runs: Sequence[dict], fields: Sequence[str], family: str
                      ) -> dict[str, dict[str, dict[int, float]]]:
    """{group label: {layer ("decoder/layer_0"): {head (0 for per-layer values): mean over the
    group's runs of the last logged value}}}."""
    prefix = f"{DIAGNOSTICS}{family}/"
    values: dict[str, dict[str, dict[int, list[float]]]] = {}
    for run in runs:
        label = ", ".join(group_key(run["overrides"], fields)) or run["name"]
        for key, value in run["final"].items():
            if key.startswith(prefix):
                layer, _, head = key[len(prefix):].partition("/head_")
                per_head = values.setdefault(label, {}).setdefault(layer, {})
                per_head.setdefault(int(head or 0), []).append(value)
    return {label: {layer: {head: statistics.fmean(v) for head, v in heads.items()}
                    for layer, heads in layers.items()} for label, layers in values.items()}



def main(argv: Sequence[str] | None = None) -> int:
    # The docstring's first paragraph: its first sentence spans two lines.
    parser = argparse.ArgumentParser(prog="./launch.sh report",
                                     description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("root", help="the sweep's root folder (holds sweep.json or run folders)")
    parser.add_argument("--metrics", default=None,
                        help="comma-separated metric names (default: every eval_* metric)")
    parser.add_argument("--x", default=None, help="the swept field on the plots' x axis")
    parser.add_argument("--title", default=None)
    parser.add_argument("--merge", action="append", default=[], metavar="REPORT_JSON",
                        help="an earlier report.json whose runs join ROOT's (repeatable)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    metrics = args.metrics.split(",") if args.metrics else None
    try:
        result = write_report(Path(args.root), metrics, args.x, args.title,
                              [Path(p) for p in args.merge])
    except (FileNotFoundError, ValueError) as error:
        sys.stderr.write(f"launch.sh report: {error}\n")
        return 2
    print(result["table"])
    print("wrote " + ", ".join(str(path) for path in result["files"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
