"""Recompiles the rows of the docs' compiled tables at the code as it is and prints each beside
the figures committed for it (`benchmarks/results/compile_targets/NAME.json`): memory per
chip, bytes accessed, roofline MFU and the decode loop's memory, with what changed per row.

    python benchmarks/wide_vocab_text.py /tmp/wide_vocab.txt --vocab 50304   # the vocab50k rows
    PYTHONPATH=/path/to/libtpu-site ALLOW_MULTIPLE_LIBTPU_LOAD=1 \\
        python benchmarks/recheck_compiled.py --targets v5e-8,v5p-8 --jobs 2
    python benchmarks/recheck_compiled.py --targets h100-8        # with the [gpu] extra
    python benchmarks/recheck_compiled.py --rows gpt2s_t5_8k_flex,gpt2m_rope_1k_splash
    python benchmarks/recheck_compiled.py --decode_only --targets v5e-8,v5p-8   # decoding only
    python benchmarks/recheck_compiled.py --train_only --rows gpt2s_rope_1k_splash  # steps only

Each row is one `./launch.sh compile ... --json` (printed before it runs; 1-10 minutes on a
2-core host, longer for the long-context rows, which run only when named or with --long;
TABLE_ROWS are the cells of docs/scaling.md's longest-row table that had no row).
The new reports go to --out (default benchmarks/results/recheck/), never over the committed
ones; a table of old against new goes to --out/recheck.md and .json. A row's verdict is
`same` within 0.5% on every figure, else `better` or `worse` when the figures that moved all
moved one way (memory and bytes lower is better, MFU higher), else `mixed`. A report whose
roofline MFU is over 100% counted less work than the model does (XLA counted a loop body once):
its bytes and MFU are not compared, and the row says so (`undercounted`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shlex
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMITTED = REPO / "benchmarks" / "results" / "compile_targets"
CHIPS = {"v5e-8": 8, "v5p-8": 4, "h100-8": 8}
SHAPES = {"s": (768, 12, 3072, 12), "m": (1024, 16, 4096, 24), "l": (1280, 20, 5120, 36)}
SCHEME = {"rope": "rope", "alibi": "alibi", "t5": "t5_bias", "fire": "fire",
          "kerple_log": "kerple_log", "learned": "learned"}


def gpt2(size: str, scheme: str, length: int, rows_per_chip: int, target: str,
         *extra: str, vocab_text: bool = False, context: int = 1) -> list[str]:
    """`./launch.sh compile` arguments of a GPT-2 body row (the docs' commands)."""
    d_model, heads, d_ff, layers = SHAPES[size]
    chips = CHIPS[target]
    batch = rows_per_chip * chips // context
    flags = [f"--config.model.d_model={d_model}", f"--config.model.num_heads={heads}",
             f"--config.model.d_ff={d_ff}", f"--config.model.num_decoder_layers={layers}",
             f"--config.data.seq_len={length}", f"--config.data.batch_size={batch}",
             "--config.model.dtype=bfloat16", "--config.model.dropout_rate=0.0",
             f"--config.model.position_scheme={SCHEME[scheme]}"]
    if length != 1024 or scheme == "learned":
        flags += [f"--config.model.max_len={length}"]
    if length != 1024:
        flags += [f"--config.data.eval_seq_len={length}"]
    if context > 1:
        flags += [f"--config.mesh.context={context}", "--config.mesh.data=1"]
    if vocab_text:
        flags += ["--config.data.path={vocab_text}"]
    return ["configs/char_lm.py", "--target", target, *flags, *extra]


def paper(big: bool, target: str) -> list[str]:
    """The paper's base / big translation models, 1,024 rows of 64 tokens per step."""
    flags = ["--config.model.dtype=bfloat16", "--config.data.batch_size=1024",
             "--config.data.source_path={multi30k}/train.de.gz",
             "--config.data.target_path={multi30k}/train.en.gz",
             "--config.data.eval_source_path={multi30k}/val.de.gz",
             "--config.data.eval_target_path={multi30k}/val.en.gz"]
    if big:
        flags += ["--config.model.d_model=1024", "--config.model.num_heads=16",
                  "--config.model.d_ff=4096", "--config.model.dropout_rate=0.3"]
    return ["configs/translate.py", "--target", target, *flags]


REFERENCE = "--config.model.attention_backend=reference"
FLEX = "--config.model.attention_backend=flex"
ROWS = {  # committed JSON name -> launch.sh compile arguments
    # docs/gpu-tpu.md, "Compile for a target you do not have"
    "gpt2s_alibi_1k_reference": gpt2("s", "alibi", 1024, 8, "v5e-8", REFERENCE),
    "gpt2s_rope_1k_splash": gpt2("s", "rope", 1024, 8, "v5e-8"),
    "gpt2s_alibi_1k_flex": gpt2("s", "alibi", 1024, 8, "v5e-8"),
    "gpt2s_t5_1k_flex": gpt2("s", "t5", 1024, 8, "v5e-8"),
    "gpt2s_rope_8k_splash": gpt2("s", "rope", 8192, 1, "v5e-8"),
    "gpt2s_t5_8k_flex": gpt2("s", "t5", 8192, 1, "v5e-8"),
    "gpt2s_fire_8k_flex": gpt2("s", "fire", 8192, 1, "v5e-8"),
    "gpt2s_kerple_log_8k_flex": gpt2("s", "kerple_log", 8192, 1, "v5e-8"),
    "gpt2s_alibi_32k_flex": gpt2("s", "alibi", 32768, 1, "v5e-8"),
    "gpt2s_t5_32k_flex": gpt2("s", "t5", 32768, 1, "v5e-8"),
    "s1k_splash_v5p": gpt2("s", "rope", 1024, 16, "v5p-8"),
    "s1k_cudnn_h100": gpt2("s", "rope", 1024, 8, "h100-8"),
    # "With GPT-2's vocabulary"
    "gpt2s_vocab50k_1k_reference_loss": gpt2(
        "s", "rope", 1024, 8, "v5e-8", "--config.model.loss_backend=reference",
        vocab_text=True),
    "gpt2s_vocab50k_1k_fused_loss": gpt2("s", "rope", 1024, 8, "v5e-8", vocab_text=True),
    "gpt2s_vocab50k_8k_fused_loss": gpt2("s", "rope", 8192, 1, "v5e-8", vocab_text=True),
    "gpt2s_vocab50k_1k_fused_loss_v5p": gpt2("s", "rope", 1024, 16, "v5p-8", vocab_text=True),
    # "Batch and model size"
    "gpt2s_rope_16x1k_splash": gpt2("s", "rope", 1024, 16, "v5e-8"),
    "gpt2s_rope_32x1k_splash": gpt2("s", "rope", 1024, 32, "v5e-8"),
    "gpt2m_rope_1k_splash": gpt2("m", "rope", 1024, 8, "v5e-8"),
    "gpt2m_rope_8k_splash": gpt2("m", "rope", 8192, 1, "v5e-8"),
    "gpt2m_rope_1k_splash_v5p": gpt2("m", "rope", 1024, 16, "v5p-8"),
    "gpt2m_rope_1k_cudnn_h100": gpt2("m", "rope", 1024, 8, "h100-8"),
    "gpt2l_rope_1k_splash": gpt2("l", "rope", 1024, 8, "v5e-8"),
    "gpt2l_rope_8k_splash": gpt2("l", "rope", 8192, 1, "v5e-8"),
    "gpt2l_rope_1k_splash_v5p": gpt2("l", "rope", 1024, 16, "v5p-8"),
    "gpt2l_rope_1k_cudnn_h100": gpt2("l", "rope", 1024, 8, "h100-8"),
    "paper_base_8k_splash": paper(False, "v5e-8"),
    "paper_base_8k_splash_v5p": paper(False, "v5p-8"),
    "paper_base_8k_h100": paper(False, "h100-8"),
    "paper_big_8k_splash": paper(True, "v5e-8"),
    "paper_big_8k_splash_v5p": paper(True, "v5p-8"),
    "paper_big_8k_h100": paper(True, "h100-8"),
}
LONG_ROWS = {  # docs/scaling.md: one long row per step, 10-30 minutes each here
    f"gpt2s_{name}_131k_cp8_flex": gpt2("s", name, 131072, 1, "v5e-8", context=8)
    for name in ("t5", "alibi", "rope")
} | {
    f"gpt2s_{name}_131k_cp4_flex_v5p": gpt2("s", name, 131072, 1, "v5p-8", context=4)
    for name in ("t5", "alibi", "rope")
} | {
    "gpt2s_t5_131k_cp8_ring": gpt2("s", "t5", 131072, 1, "v5e-8",
                                   "--config.model.context_parallel=ring", context=8),
    "gpt2m_rope_131k_cp4_flex_v5p": gpt2("m", "rope", 131072, 1, "v5p-8", context=4),
    "gpt2s_t5_131k_h100": gpt2("s", "t5", 131072, 8, "h100-8"),
    "gpt2s_rope_131k_flex_h100": gpt2("s", "rope", 131072, 8, "h100-8", FLEX),
}
REMAT = "--config.model.remat=full"
TABLE_ROWS = {  # docs/scaling.md, "the longest row per scheme": its cells for every scheme
    **{f"gpt2m_{name}_131k_cp4_flex_v5p": gpt2("m", name, 131072, 1, "v5p-8", context=4)
       for name in ("t5", "alibi")},
    **{f"gpt2m_{name}_131k_cp8_remat_flex": gpt2("m", name, 131072, 1, "v5e-8", REMAT,
                                                  context=8) for name in ("alibi", "rope")},
    **{f"gpt2m_{name}_64k_h100": gpt2("m", name, 65536, 1, "h100-8") for name in ("t5", "alibi")},
    **{f"gpt2m_{name}_262k_cp8_h100": gpt2("m", name, 262144, 1, "h100-8", context=8)
       for name in ("t5", "alibi")},
    "gpt2s_alibi_131k_flex_v5p": gpt2("s", "alibi", 131072, 1, "v5p-8"),
    "gpt2s_rope_131k_splash_v5p": gpt2("s", "rope", 131072, 1, "v5p-8"),
    "gpt2s_rope_32k_splash": gpt2("s", "rope", 32768, 1, "v5e-8"),
    **{f"gpt2m_{name}_16k_{kernel}": gpt2("m", name, 16384, 1, "v5e-8")
       for name, kernel in (("t5", "flex"), ("alibi", "flex"), ("rope", "splash"))},
    **{f"gpt2m_{name}_65k_{kernel}_v5p": gpt2("m", name, 65536, 1, "v5p-8")
       for name, kernel in (("t5", "flex"), ("alibi", "flex"), ("rope", "splash"))},
}
LONG_ROWS |= TABLE_ROWS
ALL_ROWS = ROWS | LONG_ROWS
FIGURES = (("needed_bytes", "memory", 1e9, "GB", -1), ("bytes_per_chip", "bytes", 1e9, "GB", -1),
           ("roofline_mfu", "MFU", 0.01, "%", +1), ("decode", "decode loop", 1e9, "GB", -1))


def figures(report: dict) -> dict:
    """The figures a row is judged by (None where the report has none: GPU cost, no decode)."""
    decode = report.get("decode")
    return {"needed_bytes": report.get("needed_bytes"),
            "bytes_per_chip": report.get("bytes_per_chip") or None,
            "roofline_mfu": report.get("roofline_mfu") or None,
            "decode": decode.get("needed_bytes") if isinstance(decode, dict) else None,
            "fits": report.get("fits")}


COUNTED_WORK = ("bytes_per_chip", "roofline_mfu")  # the figures of XLA's cost analysis


def undercounted(report_figures: dict) -> bool:
    """Whether a report's cost analysis counted less work than the model does: a roofline MFU
    over 100% (the model's FLOPs over more than the peak) means XLA left work out, such as a
    loop body counted once, so its bytes are a lower bound too."""
    return (report_figures.get("roofline_mfu") or 0) > 1


def verdict(old: dict, new: dict, tolerance: float = 0.005) -> str:
    """`same` (every figure within the tolerance), `better` or `worse` (the figures that moved
    past it all one way), else `mixed`; a row that fitted and no longer does is `worse`. Bytes
    and MFU are compared only where neither report is `undercounted`."""
    moves = []
    skipped = COUNTED_WORK if undercounted(old) or undercounted(new) else ()
    for key, _, _, _, sign in FIGURES:
        if key in skipped:
            continue
        if old.get(key) and new.get(key):
            change = sign * (new[key] - old[key]) / old[key]
            if abs(change) > tolerance:
                moves.append(change)
    if old.get("fits") and new.get("fits") is False:
        return "worse"
    if not moves:
        return "same"
    if all(move > 0 for move in moves):
        return "better"
    return "worse" if all(move < 0 for move in moves) else "mixed"


def compile_row(name: str, arguments: list[str], out: Path, substitutions: dict,
                earlier: dict | None = None, only: str | None = None) -> dict:
    """One `./launch.sh compile` of a row; its report's figures beside the committed ones.
    With `earlier` (the row of an earlier recheck) and `only` ("decode" or "train") only that
    part is compiled (`--decode_only`, `--train_only`): the row keeps earlier's other figures
    and takes the new ones."""
    arguments = [argument.format(**substitutions) for argument in arguments]
    report_path = out / (f"{name}.decode.json" if only == "decode" else f"{name}.json")
    command = ["./launch.sh", "compile", *arguments, "--json", str(report_path),
               "--workdir", str(out / "workdirs" / name), *([f"--{only}_only"] if only else [])]
    print("$", shlex.join(command), flush=True)
    loop = _last_decode(out, name) if only == "train" else None
    start = time.time()
    env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env=env)
    seconds = round(time.time() - start, 1)
    committed = COMMITTED / f"{name}.json"
    old = figures(json.loads(committed.read_text())) if committed.exists() else {}
    if not report_path.exists():
        error = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no output"]
        print(f"{name}: compile failed after {seconds} s: {error[0]}", flush=True)
        return {"row": name, "old": old, "new": None, "verdict": "failed",
                "error": error[0], "command": shlex.join(command), "seconds": seconds}
    new = figures(json.loads(report_path.read_text()))
    row = {"row": name, "old": old, "new": new, "verdict": verdict(old, new),
           "command": shlex.join(command), "seconds": seconds}
    if only == "decode":
        new = {**earlier["new"], "decode": new["decode"]}
        row = {**earlier, "new": new, "verdict": verdict(old, new),
               "decode_command": shlex.join(command), "decode_commit": _commit()}
    elif only == "train":
        new = {**new, "decode": earlier["new"].get("decode")}
        row = {**earlier, "new": new, "verdict": verdict(old, new),
               "command": shlex.join(command), "seconds": seconds, "train_commit": _commit()}
        _keep_decode(report_path, loop)
    print(f"{name}: {row['verdict']} ({seconds} s) {line(row)}", flush=True)
    return row


def _last_decode(out: Path, name: str) -> dict | None:
    """The row's decode loop as last compiled: its decode-only report, else its whole one."""
    for path in (out / f"{name}.decode.json", out / f"{name}.json"):
        if path.exists():
            return json.loads(path.read_text()).get("decode")
    return None


def _keep_decode(report_path: Path, loop: dict | None) -> None:
    """A train-only report takes the row's last decode loop, so NAME.json stays one whole
    report (a train step and its loop)."""
    report = json.loads(report_path.read_text())
    if loop is not None:
        report["decode"] = loop
    report_path.write_text(json.dumps(report, indent=1) + "\n")


def _figure(value, scale: float, unit: str) -> str:
    if value is None:
        return "-"
    return f"{value / scale:.1f}%" if unit == "%" else f"{value / scale:.2f} {unit}"


def line(row: dict) -> str:
    """One markdown table line: each figure as committed -> now."""
    cells = []
    for key, _, scale, unit, _ in FIGURES:
        old = _figure(row["old"].get(key), scale, unit)
        new = _figure((row["new"] or {}).get(key), scale, unit)
        cells.append(old if old == new else f"{old} -> {new}")
    judged = verdict(row["old"], row["new"]) if row["new"] else row["verdict"]
    counted_less = [label for side, label in (("old", "committed"), ("new", "now"))
                    if undercounted(row[side] or {})]
    if counted_less:
        judged += f" ({' and '.join(counted_less)} undercounted: bytes and MFU not compared)"
    return f"| {row['row']} | " + " | ".join(cells) + f" | {judged} |"


def markdown(rows: list[dict], commit: str) -> str:
    header = " | ".join(label for _, label, _, _, _ in FIGURES)
    lines = [f"Compiled at {commit} against the committed reports (committed -> now):", "",
             f"| row | {header} | verdict |", "|---|" + "---:|" * len(FIGURES) + "---|"]
    lines += [line(row) for row in rows]
    failed = [row for row in rows if row["verdict"] == "failed"]
    lines += ["", *(f"- {row['row']}: {row['error']}" for row in failed)]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="", help="comma-separated names (default: all)")
    parser.add_argument("--targets", default="v5e-8,v5p-8,h100-8")
    parser.add_argument("--long", action="store_true", help="the long-context rows too")
    parser.add_argument("--jobs", type=int, default=1, help="compiles at once")
    parser.add_argument("--vocab_text", default="/tmp/wide_vocab.txt")
    parser.add_argument("--multi30k", default=str(REPO.parent / "shared" / "data" / "multi30k"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "recheck"))
    only_part = parser.add_mutually_exclusive_group()
    only_part.add_argument("--decode_only", action="store_true",
                        help="compile only the decode loops (for a change that cannot touch a "
                        "train step); each row keeps its other figures from --out/recheck.json")
    only_part.add_argument("--train_only", action="store_true",
                        help="compile only the train steps (for a change that cannot touch "
                        "decoding); each row keeps its decode loop from --out/recheck.json")
    parser.add_argument("--render", action="store_true",
                        help="only write --out/recheck.md again from its recheck.json")
    args = parser.parse_args()
    if args.render:
        found = json.loads((Path(args.out) / "recheck.json").read_text())
        for row in found["rows"]:
            if row["new"]:
                row["verdict"] = verdict(row["old"], row["new"])
        (Path(args.out) / "recheck.json").write_text(json.dumps(found, indent=1))
        (Path(args.out) / "recheck.md").write_text(markdown(found["rows"], found["commit"]))
        return
    pool = ALL_ROWS if (args.long or args.rows) else ROWS
    names = args.rows.split(",") if args.rows else list(pool)
    unknown = sorted(set(names) - set(ALL_ROWS))
    if unknown:
        parser.error(f"--rows: unknown {unknown}; known: {sorted(ALL_ROWS)}")
    targets = set(args.targets.split(","))
    names = [name for name in names if ALL_ROWS[name][2] in targets]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    substitutions = {"vocab_text": args.vocab_text, "multi30k": args.multi30k}
    earlier = out / "recheck.json"  # rows of other runs (other targets) are kept
    before = {row["row"]: row for row in json.loads(earlier.read_text())["rows"]
              } if earlier.exists() else {}
    only = "decode" if args.decode_only else "train" if args.train_only else None
    if only:
        missing = [name for name in names if not (before.get(name) or {}).get("new")]
        if missing:
            parser.error(f"--{only}_only: no earlier figures in {earlier} for {missing}; "
                         "recheck those rows whole first")
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool_:
        rows = list(pool_.map(lambda name: compile_row(
            name, ALL_ROWS[name], out, substitutions, before.get(name), only), names))
    commit = _commit()
    if earlier.exists():
        ran = {row["row"] for row in rows}
        rows = [row for row in json.loads(earlier.read_text())["rows"]
                if row["row"] not in ran and row["row"] in ALL_ROWS] + rows
        rows.sort(key=lambda row: list(ALL_ROWS).index(row["row"]))
    table = markdown(rows, commit)
    print(table)
    (out / "recheck.md").write_text(table)
    (out / "recheck.json").write_text(json.dumps({"commit": commit, "rows": rows}, indent=1))


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    main()
