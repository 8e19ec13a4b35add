"""experiments/record.py: a command's last printed JSON object, its command and wall time are
recorded; a failing command records nothing and keeps an earlier record."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "record.py"


def _record(target: Path, code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(target), "--", sys.executable, "-c",
                           code], capture_output=True, text=True)


def test_records_the_last_json_object_printed(tmp_path):
    code = ("import json; print('progress {not json}'); print(json.dumps({'a': 1}));"
            "print('step 5'); print(json.dumps({'eval_bleu': 12.5, 'nested': {'x': 2}}))")
    process = _record(tmp_path / "r", code)
    assert process.returncode == 0, process.stderr
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["result"] == {"eval_bleu": 12.5, "nested": {"x": 2}}
    assert record["command"].startswith(f"{sys.executable} -c ")
    assert "eval_bleu" in record["command"]
    assert record["wall_s"] >= 0
    assert "| eval_bleu | 12.5 |" in (tmp_path / "r.md").read_text()


def test_a_failing_command_keeps_the_earlier_record(tmp_path):
    assert _record(tmp_path / "r", "print('{\"a\": 1}')").returncode == 0
    before = (tmp_path / "r.json").read_text()
    process = _record(tmp_path / "r", "import sys; print('{\"a\": 2}'); sys.exit(3)")
    assert process.returncode == 3
    assert "nothing written" in process.stderr
    assert (tmp_path / "r.json").read_text() == before


def test_the_learning_curve_of_the_printed_workdir_is_kept(tmp_path):
    workdir = tmp_path / "run"
    workdir.mkdir()
    curve = '{"step": 1, "eval_bleu": 1.0}\n{"step": 2, "eval_bleu": 2.0}\n'
    (workdir / "metrics.jsonl").write_text(curve)
    code = f"import json; print(json.dumps({{'workdir': {str(workdir)!r}, 'eval_bleu': 2.0}}))"
    assert _record(tmp_path / "r", code).returncode == 0
    assert (tmp_path / "r.metrics.jsonl").read_text() == curve
