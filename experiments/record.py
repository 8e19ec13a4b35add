"""Runs one command and records it beside the results: the command, its wall time, the machine,
and the JSON object it printed last (what `./launch.sh train/eval` print at the end).

    python experiments/record.py experiments/results/NAME/FILE -- ./launch.sh eval CONFIG ...

Writes FILE.json ({"command", "wall_s", "machine", "result"}) and FILE.md; the command's own
output still goes to the terminal. When the result names a `workdir` with a metrics.jsonl (what
`./launch.sh train` prints), FILE.metrics.jsonl keeps that run's learning curve too. Exits with
the command's status, writing nothing on failure, so a failed run never replaces an earlier
record.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tfm.kernels import hardware  # noqa: E402


def last_json_object(text: str) -> dict | None:
    """The last top-level `{...}` block of `text` that parses as JSON, or None."""
    end = text.rfind("}")
    while end != -1:
        start = text.rfind("{", 0, end)
        while start != -1:
            try:
                value = json.loads(text[start:end + 1])
            except json.JSONDecodeError:
                start = text.rfind("{", 0, start)
                continue
            if isinstance(value, dict):
                return value
            break
        end = text.rfind("}", 0, end)
    return None


def markdown(record: dict) -> str:
    lines = [f"# {Path(record['file']).name}", "", "Made by (from the repository root):", "",
             "```bash", record["command"], "```", "",
             f"Wall time: {record['wall_s']:.0f} s. Machine: {record['machine']}", "",
             "| metric | value |", "|---|---:|"]
    for key, value in (record["result"] or {}).items():
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        lines.append(f"| {key} | {shown} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") != 1 or len(argv) < 3:
        sys.stderr.write(__doc__.split("\n\n")[1] + "\n")
        return 2
    target, command = Path(argv[0]), argv[2:]
    start = time.perf_counter()
    process = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    wall_s = time.perf_counter() - start
    sys.stdout.write(process.stdout)
    if process.returncode != 0:
        sys.stderr.write(f"record.py: the command failed (status {process.returncode}); "
                         f"nothing written to {target}\n")
        return process.returncode
    record = {"file": str(target), "command": shlex.join(command), "wall_s": round(wall_s, 1),
              "machine": hardware.cpu_features(), "result": last_json_object(process.stdout)}
    target.parent.mkdir(parents=True, exist_ok=True)
    target.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    target.with_suffix(".md").write_text(markdown(record))
    workdir = (record["result"] or {}).get("workdir")
    curve = ROOT / workdir / "metrics.jsonl" if isinstance(workdir, str) else None
    if curve is not None and curve.is_file():
        shutil.copy(curve, target.with_suffix(".metrics.jsonl"))
    print(f"wrote {target.with_suffix('.json')} and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
