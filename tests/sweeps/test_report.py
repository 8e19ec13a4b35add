"""tfm.sweeps.report: mean ± std over seeds from fabricated metrics files, checked against a hand
computation; the markdown, CSV and JSON tables; the plots; lengths from eval_seq_len.json."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest

from tfm.sweeps import plots, report, sweep

# (scheme, seed) -> final eval_exact_match, eval_loss
FINAL = {
    ("rope", 0): (90.0, 0.5), ("rope", 1): (80.0, 0.7), ("rope", 2): (100.0, 0.3),
    ("alibi", 0): (60.0, 1.0), ("alibi", 1): (70.0, 2.0),
}


def fabricated_sweep(root: Path, with_failure: bool = True) -> list[sweep.Run]:
    overrides = sweep.product(sweep.sweep("model.position_scheme", ["rope", "alibi"]),
                              sweep.sweep("train.seed", [0, 1, 2]))
    runs = sweep.make_runs("configs/synthetic_lm.py", overrides, root)
    records = {}
    for run in runs:
        key = (run.overrides["model.position_scheme"], run.overrides["train.seed"])
        run.workdir.mkdir(parents=True)
        if key not in FINAL:  # alibi seed 2 failed: no metrics
            records[run.index] = {**run.manifest(), "status": "failed", "error": "boom"}
            (run.workdir / sweep.RUN_FILE).write_text(json.dumps(records[run.index]))
            continue
        exact, loss = FINAL[key]
        lines = [{"step": 10, "train_loss": 3.0, "eval_exact_match": exact / 2, "eval_loss": 9.0},
                 {"step": 20, "train_loss": 1.0},
                 {"step": 20, "eval_exact_match": exact, "eval_loss": loss}]
        (run.workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        records[run.index] = {**run.manifest(), "status": "done"}
        (run.workdir / sweep.RUN_FILE).write_text(json.dumps(records[run.index]))
    sweep.write_manifest(root, runs, records)
    return runs


def test_mean_and_std_over_seeds_match_a_hand_computation(tmp_path):
    fabricated_sweep(tmp_path)
    result = report.write_report(tmp_path, ["eval_exact_match", "eval_loss"])
    rows = {row["model.position_scheme"]: row for row in result["rows"]}
    assert result["fields"] == ["model.position_scheme"]
    assert rows["rope"]["seeds"] == 3 and rows["alibi"]["seeds"] == 2
    assert rows["alibi"]["failed"] == 1 and rows["rope"]["failed"] == 0
    # rope: mean(90, 80, 100) = 90, sample std sqrt(((0)^2 + 10^2 + 10^2) / 2) = 10.
    assert rows["rope"]["eval_exact_match"] == pytest.approx((90.0, 10.0))
    # alibi: mean(60, 70) = 65, std sqrt((25 + 25) / 1) = 7.0711.
    assert rows["alibi"]["eval_exact_match"] == pytest.approx((65.0, math.sqrt(50.0)))
    assert rows["rope"]["eval_loss"] == pytest.approx((0.5, 0.2))
    assert rows["alibi"]["eval_loss"] == pytest.approx((1.5, math.sqrt(0.5)))

    markdown = (tmp_path / "report.md").read_text()
    assert "| model.position_scheme | seeds | eval_exact_match | eval_loss |" in markdown
    assert "| rope | 3 | 90 ± 10 | 0.5 ± 0.2 |" in markdown
    assert "| alibi | 2 (1 failed) | 65 ± 7.1 | 1.5 ± 0.71 |" in markdown
    table = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert float(table[1]["eval_exact_match_std"]) == pytest.approx(math.sqrt(50.0))
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["rows"][0]["eval_exact_match"] == pytest.approx([90.0, 10.0])
    for name in ("report_eval_exact_match.png", "curves_eval_loss.png", "curves_train_loss.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_default_metrics_x_field_and_eval_lengths(tmp_path, capsys):
    runs = fabricated_sweep(tmp_path)
    for run in runs[:2]:  # rope seeds 0 and 1, evaluated at two lengths
        seed = run.overrides["train.seed"]
        (run.workdir / report.LENGTHS_FILE).write_text(json.dumps(
            {"64": {"eval_loss": 1.0 + seed}, "256": {"eval_loss": 3.0 + seed}}))
    learned = runs[3]  # alibi seed 0 stands in for a run with a learned table
    (learned.workdir / report.LENGTHS_FILE).write_text(json.dumps(
        {"64": {"eval_loss": 2.0}, "256": {"n/a": "learned: no positions past max_len"}}))
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "eval_exact_match" in out and "eval_loss" in out  # every eval_* metric by default
    markdown = (tmp_path / "report.md").read_text()
    assert "| model.position_scheme | len 64 | len 256 |" in markdown
    assert "| rope | 1.5 ± 0.71 | 3.5 ± 0.71 |" in markdown
    assert "| alibi | 2 | n/a |" in markdown  # one seed: no ± (as in the main table)
    assert "\nn/a: learned: no positions past max_len\n" in markdown
    assert (tmp_path / "report_eval_seq_len_eval_loss.png").exists()
    assert report.main([str(tmp_path), "--x", "model.d_model"]) == 2
    assert "not a swept field" in capsys.readouterr().err


def test_folder_of_runs_without_a_manifest(tmp_path):
    for name, loss in (("a", 1.0), ("b", 3.0)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "eval_loss": loss}))
    result = report.write_report(tmp_path)
    assert result["fields"] == [] and len(result["rows"]) == 1
    assert result["rows"][0]["eval_loss"] == pytest.approx((2.0, math.sqrt(2.0)))


def _split_sweep(tmp_path: Path) -> tuple[Path, Path, Path]:
    """The fabricated sweep, whole in ALL; seed 0 alone in FIRST; seeds 1-2 alone in REST."""
    roots = tuple(tmp_path / name for name in ("all", "first", "rest"))
    for root in roots:
        runs = fabricated_sweep(root)
        for run in runs:
            (run.workdir / report.LENGTHS_FILE).write_text(json.dumps(
                {"64": {"eval_loss": 1.0 + run.overrides["train.seed"] ** 2}}))
        seeds = {"all": {0, 1, 2}, "first": {0}, "rest": {1, 2}}[root.name]
        kept = [run for run in runs if run.overrides["train.seed"] in seeds]
        for run in runs:
            if run not in kept:
                for f in run.workdir.iterdir():
                    f.unlink()
                run.workdir.rmdir()
        (root / sweep.SWEEP_FILE).write_text(json.dumps(
            {**json.loads((root / sweep.SWEEP_FILE).read_text()),
             "runs": [{**r.manifest()} for r in kept]}))
    return roots


@pytest.mark.parametrize("with_run_records", [True, False])
def test_merging_an_earlier_report_equals_reporting_all_runs_at_once(tmp_path, with_run_records):
    whole, first, rest = _split_sweep(tmp_path)
    expected = report.write_report(whole, ["eval_exact_match", "eval_loss"])
    report.write_report(first, ["eval_exact_match", "eval_loss"])
    earlier = first / "report.json"
    if not with_run_records:  # a report written before per-run records existed
        saved = json.loads(earlier.read_text())
        earlier.write_text(json.dumps({k: v for k, v in saved.items() if k != "runs"}))
    for run_dir in [p for p in first.iterdir() if p.is_dir()]:
        shutil.rmtree(run_dir)  # the workdirs are gone; only report.json is left
    merged = report.write_report(rest, ["eval_exact_match", "eval_loss"], merge=[earlier])
    by_scheme = lambda result: {row["model.position_scheme"]: row for row in result["rows"]}
    for scheme, row in by_scheme(expected).items():
        got = by_scheme(merged)[scheme]
        assert got["seeds"] == row["seeds"]
        for metric in ("eval_exact_match", "eval_loss"):
            assert got[metric] == pytest.approx(row[metric], rel=1e-12)
    markdown = (rest / "report.md").read_text()
    assert "| rope | 3 | 90 ± 10 | 0.5 ± 0.2 |" in markdown
    if with_run_records:  # eval lengths travel with the runs: seeds 0, 1, 2 -> 1, 2, 5
        assert "| rope | 2.667 ± 2.1 |" in markdown
        # Merging the merged report again adds nothing: runs are matched by name.
        again = report.write_report(rest, ["eval_exact_match"], merge=[rest / "report.json"])
        assert by_scheme(again)["rope"]["seeds"] == 3
    else:
        assert "pooled from its rows" in markdown


def test_a_bad_merge_file_is_one_clear_error(tmp_path, capsys):
    fabricated_sweep(tmp_path / "sweep")
    (tmp_path / "bad.json").write_text("{not json")
    assert report.main([str(tmp_path / "sweep"), "--merge", str(tmp_path / "bad.json")]) == 2
    assert "bad.json: not a readable report.json" in capsys.readouterr().err
    other = {"fields": ["model.d_model"], "metrics": [], "rows": [{"model.d_model": "64",
                                                                    "seeds": 1}]}
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert report.main([str(tmp_path / "sweep"), "--merge", str(tmp_path / "other.json")]) == 2
    assert "has no field model.position_scheme" in capsys.readouterr().err


# ------------------------------------------------------------------------- plots


def _rows(values: dict[str, tuple[float, float]], seeds: int = 2) -> list[dict]:
    return [{"model.position_scheme": scheme, "seeds": seeds, "failed": 0, "eval_metric": value}
            for scheme, value in values.items()]


def _close(figure) -> None:
    import matplotlib.pyplot as plt

    plt.close(figure)


def test_a_rate_is_drawn_in_percent_on_an_axis_from_0_to_100(tmp_path):
    # The pilot: 7.8% vs 9.4% exact match filled the whole plot (auto-zoomed y axis).
    rows = [{**row, "eval_test_exact_match": row.pop("eval_metric")}
            for row in _rows({"rope": (7.8, 1.0), "alibi": (9.4, 0.5)})]
    figure = plots.metric_figure(rows, ["model.position_scheme"], "eval_test_exact_match",
                                  "model.position_scheme")
    axes = figure.axes[0]
    assert axes.get_ylim() == (0.0, 100.0)
    assert axes.get_ylabel() == "eval_test_exact_match (%)"
    assert axes.get_xlabel() == "model.position_scheme"
    assert axes.get_title() == ("eval_test_exact_match by model.position_scheme "
                                "(mean ± std over 2 seeds)")
    _close(figure)
    # Accuracy is logged as a fraction: drawn in percent, on the same 0-100 axis.
    rows = [{**row, "eval_accuracy": row.pop("eval_metric")}
            for row in _rows({"rope": (0.85, 0.05), "alibi": (0.75, 0.0)}, seeds=1)]
    figure = plots.metric_figure(rows, ["model.position_scheme"], "eval_accuracy",
                                  "model.position_scheme", title="Pilot")
    axes = figure.axes[0]
    drawn = [line for line in axes.get_lines() if len(line.get_ydata()) == 2][0]
    assert list(drawn.get_ydata()) == pytest.approx([85.0, 75.0])
    assert axes.get_ylim() == (0.0, 100.0) and axes.get_ylabel() == "eval_accuracy (%)"
    assert axes.get_title().startswith("Pilot\n") and "one seed" in axes.get_title()
    _close(figure)


def test_a_loss_keeps_its_own_range_and_says_its_unit():
    rows = [{**row, "eval_loss": row.pop("eval_metric")}
            for row in _rows({"rope": (1.8, 0.1), "alibi": (1.9, 0.1)})]
    figure = plots.metric_figure(rows, ["model.position_scheme"], "eval_loss",
                                  "model.position_scheme")
    axes = figure.axes[0]
    assert axes.get_ylabel() == "eval_loss (nats/token)"
    assert axes.get_ylim()[0] > 1.0  # not a rate: not forced to 0
    _close(figure)


def test_a_curve_has_a_point_per_evaluation_and_a_colour_per_group(tmp_path):
    runs = fabricated_sweep(tmp_path)
    rope_0 = runs[0].workdir / "metrics.jsonl"
    # Evaluated at steps 10, 20 and 30; step 20 logged again after a resume (its last value
    # counts); training lines in between carry no eval metric.
    lines = [{"step": 10, "eval_exact_match": 20.0}, {"step": 15, "train_loss": 2.0},
             {"step": 20, "eval_exact_match": 30.0}, {"step": 20, "eval_exact_match": 40.0},
             {"step": 30, "eval_exact_match": 90.0}]
    rope_0.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert plots.curve_points(runs[0].workdir, "eval_exact_match") == [
        (10, 20.0), (20, 40.0), (30, 90.0)]
    found = report.find_runs(tmp_path)
    figure = plots.curves_figure(found, "eval_exact_match", ["model.position_scheme"])
    axes = figure.axes[0]
    by_name = {line.get_label(): line for line in axes.get_lines()}
    first = by_name[runs[0].name]
    assert list(first.get_xdata()) == [10, 20, 30]
    assert list(first.get_ydata()) == [20.0, 40.0, 90.0]
    assert first.get_marker() == "o"  # few points: each evaluation is visible
    # The other runs evaluated twice (steps 10 and 20): two points each; alibi seed 2 failed.
    assert [len(by_name[run.name].get_xdata()) for run in runs[1:5]] == [2, 2, 2, 2]
    assert runs[5].name not in by_name
    # One colour per scheme, one line style per seed.
    rope = [by_name[run.name] for run in runs[:3]]
    alibi = [by_name[run.name] for run in runs[3:5]]
    assert len({line.get_color() for line in rope}) == 1
    assert rope[0].get_color() != alibi[0].get_color()
    assert len({line.get_linestyle() for line in rope}) == 3
    assert axes.get_xlabel() == "training step"
    assert axes.get_ylabel() == "eval_exact_match (%)" and axes.get_ylim() == (0.0, 100.0)
    assert axes.get_title() == "eval_exact_match during training (a line per run)"
    _close(figure)
    assert plots.curves_figure(found, "eval_bleu") is None  # nobody logged it


def test_every_plot_of_a_report_has_a_title_and_labelled_axes(tmp_path, monkeypatch):
    runs = fabricated_sweep(tmp_path)
    for run in runs[:2]:
        (run.workdir / report.LENGTHS_FILE).write_text(json.dumps(
            {"64": {"eval_exact_match": 50.0}, "256": {"eval_exact_match": 10.0}}))
    seen = {}

    def record(figure, path):
        axes = figure.axes[0]
        seen[path.name] = (axes.get_title(), axes.get_xlabel(), axes.get_ylabel(),
                           axes.get_ylim())
        _close(figure)

    monkeypatch.setattr(plots, "write_png", record)
    report.write_report(tmp_path, ["eval_exact_match", "eval_loss"], title="Fabricated")
    assert sorted(seen) == sorted([
        "report_eval_exact_match.png", "report_eval_loss.png", "curves_eval_exact_match.png",
        "curves_eval_loss.png", "curves_train_loss.png",
        "report_eval_seq_len_eval_exact_match.png"])
    for name, (title, xlabel, ylabel, ylim) in seen.items():
        assert title.startswith("Fabricated\n") and xlabel and ylabel, name
        if "exact_match" in name:
            assert ylabel.endswith("(%)") and ylim == (0.0, 100.0), name
        else:
            assert ylabel.endswith("(nats/token)"), name
    assert seen["report_eval_seq_len_eval_exact_match.png"][1] == "evaluation length (tokens)"


def test_report_help_is_whole_sentences(capsys):
    with pytest.raises(SystemExit):
        report.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "one table and plots for any sweep (tfm.sweeps.sweep) or folder of runs." in out


def test_passkey_cells_become_a_length_by_depth_heatmap_per_group(tmp_path):
    """Each run's passkey/{task}_len{L}_depth{D} metrics: the grid is the mean over a group's
    seeds at every (depth, length); the report draws it."""
    runs = fabricated_sweep(tmp_path)
    for run in runs:
        metrics = run.workdir / "metrics.jsonl"
        if not metrics.exists():
            continue
        scheme, seed = run.overrides["model.position_scheme"], run.overrides["train.seed"]
        cells = {f"passkey/passkey_len{n}_depth{d:g}": (n + 10 * d + seed) / 1000
                 for n in (64, 128) for d in (0.0, 0.5, 1.0)}
        if scheme == "alibi":
            cells = {name: 0.0 for name in cells}
        with metrics.open("a") as file:
            file.write(json.dumps({"step": 20, **cells}) + "\n")
    result = report.write_report(tmp_path, ["eval_loss"])
    assert tmp_path / "report_passkey_passkey.png" in result["files"]
    assert (tmp_path / "report_passkey_passkey.png").read_bytes()[:4] == b"\x89PNG"
    found = report.find_runs(tmp_path)
    for run in found:
        run["final"] = report.final_metrics(Path(run["workdir"]))
    assert report.passkey_cells(found) == {"passkey": ([64, 128], [0.0, 0.5, 1.0])}
    grids = report.passkey_grids(found, ["model.position_scheme"], "passkey", [64, 128],
                                 [0.0, 0.5, 1.0])
    # rope seeds 0, 1, 2: mean of (n + 10 d + seed) / 1000 = (n + 10 d + 1) / 1000.
    expected = [[(n + 10 * d + 1) / 1000 for n in (64, 128)] for d in (0.0, 0.5, 1.0)]
    for row, want in zip(grids["model.position_scheme=rope"], expected, strict=True):
        assert row == pytest.approx(want)
    assert grids["model.position_scheme=alibi"] == [[0.0, 0.0]] * 3
