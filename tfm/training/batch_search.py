"""`./launch.sh compile CONFIG --target NAME --largest_batch`: the largest `data.batch_size`
whose train step fits the target chip's memory, found by compiling a few batch sizes.

A step's memory per chip is close to affine in the batch (parameters and optimizer state fixed,
activations per row), so two compiles give a line, the line gives a guess, and compiles at the
guess and one multiple above settle it: usually four compiles. The search never trusts the line
alone: a batch is reported only when it was compiled and fit, and the next multiple only when it
was compiled and did not (or the compiler refused it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MAX_COMPILES = 16
GROWTH = 4  # the most a guess may multiply the largest batch known to fit
# Above this share of the chip's memory XLA may already be rematerialising to fit (TPU: the
# memory of 432 and 864 rows of GPT-2 small differs by 0.01 GB), so the line is not trusted.
NEAR_FULL = 0.95


def largest_fitting(
    needed_at: Callable[[int], float | None],  # batch -> bytes per chip; None: refused
    start: int,
    unit: int,
    capacity: float,
    max_compiles: int = MAX_COMPILES,
) -> tuple[int | None, int | None, dict[int, float | None]]:
    """(largest batch found to fit, smallest found not to, every batch tried -> bytes needed)
    over multiples of `unit`, from `start`. The first is None when even `unit` rows do not
    fit; the second None when the search stopped (max_compiles) before finding one that does
    not. Assumes more rows never need less memory."""
    tried: dict[int, float | None] = {}

    def fits(batch: int) -> bool:
        if batch not in tried:
            tried[batch] = needed_at(batch)
        needed = tried[batch]
        return needed is not None and needed <= capacity

    def multiple(rows: float) -> int:
        return max(unit, int(rows // unit) * unit)

    low, high = None, None  # largest known to fit, smallest known not to
    batch = multiple(start)
    while len(tried) < max_compiles:
        if fits(batch):
            low = batch
        else:
            high = batch
        if low is None:  # nothing fits yet: halve toward one unit
            if batch == unit:
                return None, unit, tried
            batch = multiple(batch / 2)
            continue
        if high is not None and high - low <= unit:
            return low, high, tried
        batch = _next_guess(tried, low, high, unit, capacity, multiple)
    return low, high, tried


def _next_guess(tried: dict[int, float | None], low: int, high: int | None, unit: int,
                capacity: float, multiple: Callable[[float], int]) -> int:
    """The batch to compile next: where the line through the two largest fitting batches
    reaches `capacity` (at most GROWTH times low), kept strictly between low and high; twice
    low with one point only, or when the line cannot be trusted (flat, or the largest fitting
    batch already near full: the compiler may be trading recomputation for memory)."""
    fitting = sorted(b for b, needed in tried.items()
                     if needed is not None and needed <= capacity)
    guess = 2 * low
    if len(fitting) >= 2:
        small, large = fitting[-2], fitting[-1]
        slope = (tried[large] - tried[small]) / (large - small)
        near_full = [tried[rows] >= NEAR_FULL * capacity for rows in (small, large)]
        if near_full == [False, True]:  # at the edge by the line: check the multiple above
            guess = low + unit
        elif not near_full[1] and slope > 0:
            guess = multiple(large + (capacity - tried[large]) / slope)
            if guess == low:  # the line says low is the last: check the multiple above
                guess = low + unit
        # (both near full: memory has gone flat, the compiler is squeezing: double)
    guess = min(guess, multiple(GROWTH * low))  # the line may run far past a compiler refusal
    if high is not None and not low < guess < high:
        guess = multiple((low + high) / 2)
        guess = guess if low < guess < high else low + unit
    return max(guess, low + unit)


def search(config: Any, workdir: Any, target_name: str, capacity: float, unit: int,
           compile_at: Callable[[Any, Any, str], dict[str, Any]],
           on_try: Callable[[int, float | None], None] | None = None) -> dict[str, Any]:
    """The largest `data.batch_size` of `config` whose train step fits `capacity` bytes per
    chip on `target_name`, in multiples of `unit` rows (the target's chip count):
    {"largest": rows or None, "smallest_not": rows or None, "tried": {rows: bytes or None},
    "unit": unit, "hbm_bytes": capacity, "report": the compile report at the largest batch}.
    compile_at(config, workdir, target) compiles one train step and returns its report
    (compile_report.train_report, which also resolves the target and its memory:
    compile_report.largest_batch); on_try(rows, bytes or None) hears of each compile as it
    ends. The search knows nothing of compiling: it calls compile_at."""
    reports: dict[int, dict[str, Any]] = {}

    def needed_at(batch: int) -> float | None:
        trial = config.copy_and_resolve_references()
        trial.data.batch_size = batch
        try:
            reports[batch] = compile_at(trial, workdir, target_name)
            needed = reports[batch]["needed_bytes"]
        except Exception as error:  # the compiler's own out-of-memory verdict
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            needed = None
        if on_try is not None:
            on_try(batch, needed)
        return needed

    largest, smallest_not, tried = largest_fitting(
        needed_at, config.data.batch_size, unit, capacity)
    return {"largest": largest, "smallest_not": smallest_not, "tried": tried,
            "unit": unit, "hbm_bytes": capacity, "report": reports.get(largest)}


def summary(result: dict[str, Any], target_name: str) -> str:
    """One line: the largest batch that fits, the one above that does not, what was tried."""
    gb = lambda needed: "refused" if needed is None else f"{needed / 1e9:.2f} GB"
    tried = ", ".join(f"{rows}: {gb(needed)}" for rows, needed in sorted(result["tried"].items()))
    if result["largest"] is None:
        return (f"largest batch on {target_name}: none fits, not even "
                f"{result['smallest_not']} rows (tried {tried})")
    largest, above = result["largest"], result["smallest_not"]
    if above is None:
        upper = "no batch found that does not (the compile budget ran out)"
    elif above - largest > result.get("unit", 1):
        upper = (f"{above} rows do not; those between were not compiled (the compile budget "
                 "ran out)")
    else:
        upper = f"{above} rows do not"
    return (f"largest batch on {target_name}: {largest} rows fit "
            f"{result['hbm_bytes'] / 1e9:.1f} GB per chip, {upper} (tried {tried})")
