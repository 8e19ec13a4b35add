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
statistics (a heatmap layers x heads), mean over seeds.

report.json keeps every run's final metrics and eval lengths (`runs`), so a results folder
outlives its workdirs: `--merge OLD/report.json` pools an earlier report's runs (e.g. other
seeds, run in another session or on another machine) into this one. Runs of the same name
come from ROOT. A report written before `runs` existed is pooled through its rows: (seeds, mean,
std) per group combine exactly into the pooled mean and sample std.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import math
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tfm.sweeps.sweep import RUN_FILE, SEED_FIELD, SWEEP_FILE, format_value, read_json
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


def _group_key(overrides: dict[str, Any], fields: Sequence[str]) -> tuple:
    return tuple(format_value(overrides.get(field, "")) for field in fields)


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
        groups.setdefault(_group_key(run["overrides"], fields), []).append(run)
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


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


# More legend entries than this are drawn below the axes (a sweep's learning curves, one per run).
_LEGEND_INSIDE = 10


@dataclasses.dataclass(frozen=True)
class MetricAxis:
    """How a metric is drawn: its axis label (with the unit), the factor from the logged value
    to the drawn one, and whether it is a rate (drawn in percent on an axis from 0 to 100)."""

    label: str
    scale: float = 1.0
    rate: bool = False


def metric_axis(metric: str) -> MetricAxis:
    """Exact match is logged in percent and accuracy as a fraction (tfm.training.evaluate): both
    are drawn in percent from 0; losses are mean negative log-likelihoods in nats per token."""
    if metric.endswith("exact_match"):
        return MetricAxis(f"{metric} (%)", rate=True)
    if metric.endswith("accuracy"):
        return MetricAxis(f"{metric} (%)", scale=100.0, rate=True)
    if metric.endswith("bleu"):
        return MetricAxis(f"{metric} (BLEU, 0-100)", rate=True)
    if metric.endswith(("loss", "nll")):
        return MetricAxis(f"{metric} (nats/token)")
    return MetricAxis(metric)


def _style(figure, axes, title: str, xlabel: str, y: MetricAxis | str,
           legend: bool = True) -> None:
    """Title, labels, the y range of a rate (from 0, to 100 unless a value is above), grid and
    legend: the figure is ready to save."""
    y = y if isinstance(y, MetricAxis) else MetricAxis(y)
    axes.set_title(title, fontsize=10)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(y.label)
    if y.rate:  # a 1.5-point gap must look like one, not fill the plot
        top = axes.dataLim.y1 if axes.dataLim.y1 > 100 else 100
        axes.set_ylim(0, top * (1.02 if top > 100 else 1))
    axes.grid(alpha=0.3)
    entries = len(axes.get_legend_handles_labels()[1]) if legend else 0
    figure.tight_layout()  # before the legend: one below the axes must not shrink them
    if entries > _LEGEND_INSIDE:  # many runs: the legend goes below the axes, not over them
        axes.legend(fontsize=6, ncol=2, loc="upper left", bbox_to_anchor=(0.0, -0.18))
    elif entries:
        axes.legend(fontsize=7)


def _write(figure, path: Path) -> None:
    """The PNG; closes the figure."""
    figure.savefig(path, dpi=120, bbox_inches="tight")  # "tight" grows the PNG to fit it
    _pyplot().close(figure)


def _title(text: str, title: str | None) -> str:
    return f"{title}\n{text}" if title else text


def _seeds_text(counts: Sequence[int]) -> str:
    counts = sorted({count for count in counts if count})
    if not counts:
        return "no finished runs"
    if counts == [1]:
        return "one seed, no error bars"
    seeds = str(counts[0]) if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
    return f"mean ± std over {seeds} seeds"


def _as_number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def metric_figure(rows: Sequence[dict], fields: Sequence[str], metric: str, x_field: str,
                  title: str | None = None):
    """A matplotlib Figure: metric (mean ± std) vs `x_field`, a line per value of the other
    fields; rates in percent on an axis from 0."""
    plt = _pyplot()
    y = metric_axis(metric)
    others = [f for f in fields if f != x_field]
    lines: dict[tuple, list[dict]] = {}
    for row in rows:
        lines.setdefault(tuple(row[f] for f in others), []).append(row)
    numeric = all(_as_number(row[x_field]) is not None for row in rows)
    # Categories (scheme names) sit at 0, 1, ...; each line's markers are shifted a little
    # sideways so that equal values (many schemes at 0%) stay visible.
    categories = list(dict.fromkeys(row[x_field] for row in rows))
    figure, axes = plt.subplots(figsize=(6, 4))
    for number, (label, members) in enumerate(lines.items()):
        if numeric:
            members = sorted(members, key=lambda row: float(row[x_field]))
            xs = [float(row[x_field]) for row in members]
        else:
            shift = 0.6 * (number + 0.5) / len(lines) - 0.3
            xs = [categories.index(row[x_field]) + shift for row in members]
        means = [row[metric][0] * y.scale for row in members]
        stds = [row[metric][1] * y.scale for row in members]
        name = ", ".join(f"{f}={v}" for f, v in zip(others, label, strict=True)) or metric
        axes.errorbar(xs, means, yerr=stds, marker="o", capsize=3, label=name,
                      linestyle="-" if numeric else "none", clip_on=False)
    if not numeric:
        axes.set_xticks(range(len(categories)), categories)
    if any(len(str(row[x_field])) > 6 for row in rows):
        figure.autofmt_xdate()  # long category names: slanted
    text = f"{metric} by {x_field} ({_seeds_text([row['seeds'] for row in rows])})"
    _style(figure, axes, _title(text, title), x_field, y, legend=len(lines) > 1)
    return figure


def plot_metric(rows: Sequence[dict], fields: Sequence[str], metric: str, x_field: str,
                path: Path, title: str | None = None) -> None:
    """`metric_figure` as a PNG."""
    _write(metric_figure(rows, fields, metric, x_field, title), path)


def curve_points(workdir: Path, metric: str) -> list[tuple[int, float]]:
    """(step, value) of every logged value of `metric`, by step; a step logged twice (a run
    resumed from an earlier checkpoint logs its steps again) keeps its last value."""
    points = {record["step"]: record[metric] for record in read_metrics(workdir)
              if metric in record and "step" in record}
    return sorted(points.items())


_LINE_STYLES = ("-", "--", ":", "-.")


def curves_figure(runs: Sequence[dict], metric: str, fields: Sequence[str] = (),
                  title: str | None = None):
    """A matplotlib Figure: the metric over training steps, a line per run (a point per
    evaluation), one colour per group of `fields` and one line style per seed; None if no run
    logged the metric."""
    plt = _pyplot()
    y = metric_axis(metric)
    figure, axes = plt.subplots(figsize=(6, 4))
    colours: dict[tuple, int] = {}
    seeds_seen: dict[tuple, int] = {}
    drawn = False
    for run in runs:
        if not run.get("workdir"):
            continue  # a run read back from a merged report.json: no curves
        workdir = Path(run["workdir"])
        if not (workdir / "metrics.jsonl").exists():
            continue
        points = curve_points(workdir, metric)
        if not points:
            continue
        group = _group_key(run["overrides"], fields)
        colour = colours.setdefault(group, len(colours))
        style = _LINE_STYLES[seeds_seen.get(group, 0) % len(_LINE_STYLES)]
        seeds_seen[group] = seeds_seen.get(group, 0) + 1
        steps, values = zip(*points, strict=True)
        axes.plot(steps, [value * y.scale for value in values], color=f"C{colour % 10}",
                  linestyle=style, marker="o" if len(points) < 20 else None, markersize=4,
                  label=run["name"], clip_on=False)
        drawn = True
    if not drawn:
        plt.close(figure)
        return None
    _style(figure, axes, _title(f"{metric} during training (a line per run)", title),
           "training step", y)
    return figure


def plot_curves(runs: Sequence[dict], metric: str, path: Path, fields: Sequence[str] = (),
                title: str | None = None) -> bool:
    """`curves_figure` as a PNG; False if no run logged the metric."""
    figure = curves_figure(runs, metric, fields, title)
    if figure is None:
        return False
    _write(figure, path)
    return True


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
            groups.setdefault(_group_key(run["overrides"], fields), []).append(
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
        _write(lengths_figure(lengths, length_rows, fields, metric, title), path)
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
            plot_metric(rows, fields, metric, x_field, path, title)
            files.append(path)
        path = root / f"curves_{metric}.png"
        if plot_curves(runs, metric, path, fields, title):
            files.append(path)
    if plot_curves(runs, "train_loss", root / "curves_train_loss.png", fields, title):
        files.append(root / "curves_train_loss.png")
    for family in diagnostic_families(runs):
        path = root / f"diagnostics_{family}.png"
        plot_diagnostics(diagnostics_table(runs, fields, family), family, path)
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
        label = ", ".join(_group_key(run["overrides"], fields)) or run["name"]
        for key, value in run["final"].items():
            if key.startswith(prefix):
                layer, _, head = key[len(prefix):].partition("/head_")
                per_head = values.setdefault(label, {}).setdefault(layer, {})
                per_head.setdefault(int(head or 0), []).append(value)
    return {label: {layer: {head: statistics.fmean(v) for head, v in heads.items()}
                    for layer, heads in layers.items()} for label, layers in values.items()}


def plot_diagnostics(table: dict[str, dict[str, dict[int, float]]], family: str,
                     path: Path) -> None:
    """Per-layer values (norms): a line over layers per group. Per-head values (attention): a
    heatmap layers x heads per group, one colour scale for all."""
    layers = sorted({layer for per_layer in table.values() for layer in per_layer},
                    key=lambda name: (name.split("/")[0], int(name.rsplit("_", 1)[-1])))
    num_heads = 1 + max(head for per_layer in table.values() for heads in per_layer.values()
                        for head in heads)
    grids = {label: [[per_layer.get(layer, {}).get(head, math.nan) for head in range(num_heads)]
                     for layer in layers] for label, per_layer in table.items()}
    if family.startswith("attention"):
        _plot_heatmaps(grids, layers, family, path)
    else:
        _plot_layer_lines(grids, layers, family, path)


def _plot_layer_lines(grids: dict[str, list[list[float]]], layers: Sequence[str], family: str,
                      path: Path) -> None:
    """grids: {group label: [layers][1]}."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(6, 4))
    for label, grid in grids.items():
        axes.plot(range(len(layers)), [row[0] for row in grid], marker="o", label=label)
    axes.set_xticks(range(len(layers)), layers, rotation=30, fontsize=7)
    _style(figure, axes, f"{family} by layer (last logged value, mean over seeds)", "layer",
           family)
    _write(figure, path)


def _plot_heatmaps(grids: dict[str, list[list[float]]], layers: Sequence[str], family: str,
                   path: Path) -> None:
    """grids: {group label: [layers][heads]}, one heatmap per group side by side."""
    plt = _pyplot()
    num_heads = len(next(iter(grids.values()))[0])
    finite = [v for grid in grids.values() for row in grid for v in row if not math.isnan(v)]
    size = (1.5 + 0.5 * num_heads * len(grids), 1.2 + 0.35 * len(layers))
    figure, all_axes = plt.subplots(1, len(grids), squeeze=False, figsize=size)
    for number, (axes, (label, grid)) in enumerate(zip(all_axes[0], grids.items(), strict=True)):
        image = axes.imshow(grid, vmin=min(finite), vmax=max(finite), aspect="auto")
        axes.set_title(label, fontsize=8)
        axes.set_xticks(range(num_heads), [str(h) for h in range(num_heads)], fontsize=6)
        axes.set_xlabel("head", fontsize=7)
        axes.set_yticks(range(len(layers)), layers if number == 0 else [], fontsize=6)
    figure.colorbar(image, ax=list(all_axes[0]), label=family)
    figure.suptitle(f"{family} per layer and head (last logged value, mean over seeds)",
                    fontsize=9)
    _write(figure, path)


def lengths_figure(lengths: Sequence[int], rows: Sequence[dict], fields: Sequence[str],
                   metric: str, title: str | None = None):
    """A matplotlib Figure: metric (mean ± std) vs evaluation length, a line per group."""
    plt = _pyplot()
    y = metric_axis(metric)
    figure, axes = plt.subplots(figsize=(6, 4))
    for row in rows:
        points = [(n, row[n]) for n in lengths if row[n] is not None]
        if not points:
            continue
        xs = [n for n, _ in points]
        axes.errorbar(xs, [v[0] * y.scale for _, v in points],
                      yerr=[v[1] * y.scale for _, v in points], marker="o", capsize=3,
                      label=", ".join(f"{f}={row[f]}" for f in fields) or metric, clip_on=False)
    axes.set_xscale("log", base=2)
    axes.set_xticks(list(lengths), [str(n) for n in lengths])
    text = f"{metric} by evaluation length ({_seeds_text([row['seeds'] for row in rows])})"
    _style(figure, axes, _title(text, title), "evaluation length (tokens)", y)
    return figure


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
