"""tfm.sweeps.report: mean ± std over seeds from fabricated metrics files, checked against a hand
computation; the markdown, CSV and JSON tables; the plots; lengths from eval_seq_len.json."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import pytest

from tfm.sweeps import report, sweep

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
