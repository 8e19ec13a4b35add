"""Copies a sweep's report (./launch.sh report ROOT) into experiments/results/NAME/ with its
provenance: the commands, the machine, every run's status and wall time.

    python experiments/export_report.py ROOT NAME "SWEEP COMMAND" "REPORT COMMAND"
"""

import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tfm.kernels import hardware  # noqa: E402

root, name, sweep_command, report_command = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
out = ROOT / "experiments/results" / name
out.mkdir(parents=True, exist_ok=True)
for f in root.glob("report*"):
    shutil.copy(f, out / f.name)
for f in root.glob("curves_*.png"):
    shutil.copy(f, out / f.name)
runs = [json.loads(p.read_text()) for p in sorted(root.glob("*/sweep_run.json"))]
runs.sort(key=lambda r: r["index"])
lines = [f"# {name}", "", "Made by (from the repository root):", "", "```bash", sweep_command,
         report_command, "```", "", f"Machine: {hardware.cpu_features()}", "",
         "| run | status | wall s (train + evals) |", "|---|---|---:|"]
lines += [f"| {r['name']} | {r['status']} | {r.get('wall_s', '')} |" for r in runs]
total = sum(r.get("wall_s") or 0 for r in runs)
done = sum(r["status"] == "done" for r in runs)
lines += ["", f"{done} runs done, {total / 60:.1f} min wall in all.", "",
          (root / "report.md").read_text()]
(out / "README.md").write_text("\n".join(lines) + "\n")
print("wrote", out)
