"""The largest-batch search of `launch.sh compile --largest_batch` (tfm.training.batch_search)
against brute force over memory functions with a known answer: affine, with a jump, with the
compiler refusing large batches, nothing fitting, and a start far above the answer."""

from __future__ import annotations

import numpy as np
import pytest

from tfm.checks import ConfigError
from tfm.training import batch_search

GB = 1e9


def brute_force(needed_at, unit, capacity, limit=10_000):
    best = None
    for rows in range(unit, limit, unit):
        needed = needed_at(rows)
        if needed is None or needed > capacity:
            return best, rows
        best = rows
    raise AssertionError("no batch above the answer in range")


def counted(function):
    calls = []

    def needed_at(rows):
        calls.append(rows)
        return function(rows)

    return needed_at, calls


MEMORY = {
    "affine": lambda rows: 1 * GB + 0.1 * GB * rows,
    "jump above 100 rows": lambda rows: 1 * GB + 0.1 * GB * rows + (5 * GB if rows > 100 else 0),
    "refused above 120 rows": lambda rows: None if rows > 120 else 2 * GB + 0.01 * GB * rows,
    "convex": lambda rows: 1 * GB + 0.001 * GB * rows**2,
}


@pytest.mark.parametrize("name", list(MEMORY))
@pytest.mark.parametrize("start", [8, 64, 4096])
def test_the_search_finds_what_brute_force_finds(name, start):
    unit, capacity = 8, 16 * GB
    needed_at, calls = counted(MEMORY[name])
    largest, smallest_not, tried = batch_search.largest_fitting(needed_at, start, unit, capacity)
    assert (largest, smallest_not) == brute_force(MEMORY[name], unit, capacity)
    # Both answers were compiled, not read off the line; each batch compiled once.
    assert largest in tried and smallest_not in tried and len(calls) == len(set(calls))
    assert len(calls) <= batch_search.MAX_COMPILES


def test_an_affine_memory_takes_four_compiles_from_a_fitting_start():
    needed_at, calls = counted(MEMORY["affine"])
    result = batch_search.largest_fitting(needed_at, 64, 8, 16 * GB)
    assert result[:2] == (144, 152)  # 1 + 0.1 * 144 = 15.4 GB; 152 rows need 16.2
    assert len(calls) == 4


def test_random_monotone_memories():
    rng = np.random.default_rng(0)
    for _ in range(200):
        fixed, per_row, bend = rng.uniform(0.5, 8), rng.uniform(0.001, 0.5), rng.uniform(0, 0.01)
        unit = int(rng.choice([1, 4, 8, 32]))
        memory = lambda rows, f=fixed, p=per_row, b=bend: (f + p * rows + b * rows**1.5) * GB
        start = int(rng.integers(1, 2000))
        largest, smallest_not, _ = batch_search.largest_fitting(memory, start, unit, 16 * GB,
                                                                max_compiles=40)
        assert (largest, smallest_not) == brute_force(memory, unit, 16 * GB, limit=200_000)


def test_nothing_fits():
    needed_at, calls = counted(lambda rows: 20 * GB + rows)
    assert batch_search.largest_fitting(needed_at, 64, 8, 16 * GB)[:2] == (None, 8)
    assert calls == [64, 32, 16, 8]


def test_the_compile_budget_leaves_the_upper_answer_open():
    needed_at, calls = counted(lambda rows: 1.0 * rows)
    largest, smallest_not, _ = batch_search.largest_fitting(needed_at, 8, 8, 1e9, max_compiles=2)
    assert largest == 16 and smallest_not is None and calls == [8, 16]
    line = batch_search.summary({"largest": largest, "smallest_not": None, "hbm_bytes": 1e9,
                                 "unit": 8, "tried": {8: 8.0, 16: 16.0}}, "v5e-8")
    assert "16 rows fit" in line and "the compile budget ran out" in line
    gap = batch_search.summary({"largest": 864, "smallest_not": 904, "hbm_bytes": 16e9,
                                "unit": 8, "tried": {864: 15.7e9, 904: 16.3e9}}, "v5e-8")
    assert "904 rows do not; those between were not compiled" in gap


def test_near_full_the_line_is_not_trusted():
    """XLA on TPU rematerialises to fit: memory flattens just under the chip's size (as
    compiled for GPT-2 small on v5e: 424 rows 15.91 GB, 432 rows 15.71, 864 rows 15.72, 904
    rows 16.34). The search must not take the flat part for the last fitting batch."""
    def squeezed(rows):
        free = 1 * GB + 0.035 * GB * rows
        return free if free < 15.5 * GB else (15.7 * GB if rows <= 880 else 16.3 * GB)

    largest, smallest_not, tried = batch_search.largest_fitting(squeezed, 64, 8, 16 * GB)
    assert (largest, smallest_not) == (880, 888) == brute_force(squeezed, 8, 16 * GB)


def test_a_target_without_a_memory_size_is_one_config_error():
    from ml_collections import ConfigDict

    from tfm.training import compile_report

    config = ConfigDict({"data": {"batch_size": 8}})
    with pytest.raises(ConfigError, match="known memory size"):
        compile_report.largest_batch(config, "/nonexistent", "cpu")


def test_the_search_imports_no_compiler():
    """The search is arithmetic over a compile callback: compile_report imports it, never the
    reverse (an import inside a function would still make the two modules one)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(batch_search))
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom | ast.Import)]
    imported = [alias.name for node in imports for alias in node.names] + [
        getattr(node, "module", "") or "" for node in imports]
    assert not [name for name in imported if "compile_report" in name or "tfm.training" in name]


def test_the_search_compiles_copies_of_the_config_and_counts_a_refusal_as_not_fitting(
        monkeypatch):
    """`search` over a stand-in compiler (8 chips of 16 GB): each compile gets its own copy of
    the config with the batch set; RESOURCE_EXHAUSTED means "does not fit"; any other error
    is a bug and propagates."""
    from ml_collections import ConfigDict

    config = ConfigDict({"data": {"batch_size": 64}})
    seen, heard = [], []

    def compile_at(trial, workdir, target_name):
        seen.append(trial.data.batch_size)
        if trial.data.batch_size > 100:
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
        return {"needed_bytes": 1e9 + 0.1e9 * trial.data.batch_size}

    result = batch_search.search(config, "/unused", "v5e-8", 16 * GB, 8, compile_at,
                                 lambda rows, needed: heard.append((rows, needed)))
    assert (result["largest"], result["smallest_not"]) == (96, 104)
    assert result["report"] == {"needed_bytes": 1e9 + 0.1e9 * 96}
    assert config.data.batch_size == 64 and seen == [rows for rows, _ in heard]
    assert any(needed is None for _, needed in heard)  # 128 rows: refused, searched below

    def broken(trial, workdir, target_name):
        raise ValueError("a bug, not memory")

    with pytest.raises(ValueError, match="a bug"):
        batch_search.search(config, "/unused", "v5e-8", 16 * GB, 8, broken)
