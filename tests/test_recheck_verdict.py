"""The verdict benchmarks/recheck_compiled.py gives a recompiled row against its committed
report: figures compared only where both reports count the same work."""

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "recheck_compiled.py"


def _recheck():
    spec = importlib.util.spec_from_file_location("recheck_compiled", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _figures(memory, traffic, mfu, loop):
    return {"needed_bytes": memory, "bytes_per_chip": traffic, "roofline_mfu": mfu,
            "decode": loop, "fits": True}


def test_figures_moving_one_way_or_both_ways():
    recheck = _recheck()
    old = _figures(8e9, 100e9, 0.5, 3e9)
    assert recheck.verdict(old, _figures(8.01e9, 100.2e9, 0.501, 3e9)) == "same"
    assert recheck.verdict(old, _figures(7e9, 90e9, 0.55, 3e9)) == "better"
    assert recheck.verdict(old, _figures(9e9, 100e9, 0.5, 3e9)) == "worse"
    assert recheck.verdict(old, _figures(7e9, 110e9, 0.5, 3e9)) == "mixed"
    assert recheck.verdict(old, {**_figures(7e9, 90e9, 0.55, 2e9), "fits": False}) == "worse"


def test_a_report_over_the_peak_leaves_bytes_and_mfu_out_of_the_verdict():
    """A committed report at 129% MFU counted a loop body once: its bytes (408 GB) are not
    the unrolled loop's 1,288 GB to compare against, while its memory figures are."""
    recheck = _recheck()
    counted_once = _figures(7.29e9, 408.6e9, 1.293, 14.74e9)
    assert recheck.undercounted(counted_once)
    assert not recheck.undercounted(_figures(7e9, 1288e9, 0.41, 5.9e9))
    assert recheck.verdict(counted_once, _figures(6.84e9, 1288e9, 0.41, 5.9e9)) == "better"
    assert recheck.verdict(counted_once, _figures(7.5e9, 1288e9, 0.41, 5.9e9)) == "mixed"
    assert recheck.verdict(_figures(7e9, 1288e9, 0.41, 5.9e9), counted_once) == "worse"
    row = {"row": "ring", "old": counted_once, "new": _figures(6.84e9, 1288e9, 0.41, 5.9e9),
           "verdict": "better"}
    assert "committed undercounted" in recheck.line(row)
