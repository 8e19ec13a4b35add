"""The plots of `./launch.sh report` (tfm/sweeps/report.py): a metric by a swept field, learning
curves, a metric by evaluation length, per-layer diagnostics. Every plot has a title and units:
rates (exact match, accuracy, BLEU) in percent on an axis from 0, losses in nats/token."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

from tfm.sweeps.sweep import group_key
from tfm.training.metrics import read_metrics


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


def write_png(figure, path: Path) -> None:
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
    write_png(metric_figure(rows, fields, metric, x_field, title), path)


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
        group = group_key(run["overrides"], fields)
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
    write_png(figure, path)
    return True


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
    write_png(figure, path)


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
    write_png(figure, path)


def plot_passkey(grids: dict[str, list[list[float]]], lengths: Sequence[int],
                 depths: Sequence[float], task: str, path: Path, title: str | None = None) -> None:
    """grids: {group label: rows by depth, columns by length, accuracy in [0, 1]}: a heatmap
    per group (0-100%, one colour scale), the cell's percent written in it."""
    plt = _pyplot()
    size = (1.5 + (0.6 * len(lengths) + 0.6) * len(grids), 1.4 + 0.4 * len(depths))
    figure, all_axes = plt.subplots(1, len(grids), squeeze=False, figsize=size)
    for number, (axes, (label, grid)) in enumerate(zip(all_axes[0], grids.items(), strict=True)):
        percent = [[100 * value for value in row] for row in grid]
        image = axes.imshow(percent, vmin=0, vmax=100, aspect="auto", cmap="viridis")
        for i, row in enumerate(percent):
            for j, value in enumerate(row):
                if not math.isnan(value):
                    axes.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=6,
                              color="white" if value < 60 else "black")
        axes.set_title(label, fontsize=8)
        axes.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=6, rotation=45)
        axes.set_xlabel("prompt length (tokens)", fontsize=7)
        axes.set_yticks(range(len(depths)), [f"{d:g}" for d in depths] if number == 0 else [],
                        fontsize=6)
    all_axes[0][0].set_ylabel("depth of the key", fontsize=7)
    figure.colorbar(image, ax=list(all_axes[0]), label="accuracy (%)")
    figure.suptitle(_title(f"{task} retrieval accuracy by length and depth (mean over seeds)",
                           title), fontsize=9)
    write_png(figure, path)


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
