"""The collective bytes of a compiled step, per kind: what `./launch.sh compile` reports as
"collectives per step" (all-gather against ring under context parallelism).

A collective's bytes are the size of its result on one device: the whole gathered array of
an all-gather, the block a collective-permute delivers, the reduced array of an all-reduce,
the shard of a reduce-scatter. A collective inside a loop counts once per iteration (the
loop's `known_trip_count`: the ring's `lax.scan` over the context axis), unlike
`cost_analysis()` and tfm.training.hlo_breakdown, which cost a loop body once; a loop
without a known trip count counts once and is reported in "loops_without_trip_count".
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from tfm.training.hlo_breakdown import Instruction, array_bytes, name_group, parse, short_label

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "collective-permute", "all-to-all",
         "collective-broadcast", "ragged-all-to-all")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _tuple_elements(shape: str) -> list[str]:
    """The top-level elements of an HLO tuple shape '(a, (b, c), d)'; [shape] if not a tuple."""
    if not shape.startswith("("):
        return [shape]
    elements, depth, start = [], 0, 1
    for index, char in enumerate(shape):
        depth += (char in "({[") - (char in ")}]")
        if (char == "," and depth == 1) or depth == 0:
            elements.append(shape[start:index].strip())
            start = index + 1
        if depth == 0:
            break
    return elements


def result_bytes(instruction: Instruction) -> int:
    """Bytes of a collective's result on one device. An asynchronous all-gather-start or
    collective-permute-start returns (operand, result, ...): its result is the second element;
    all-reduce-start returns its result."""
    if instruction.opcode in ("all-gather-start", "collective-permute-start"):
        elements = _tuple_elements(instruction.shape)
        return array_bytes(elements[1] if len(elements) > 1 else elements[0])
    return array_bytes(instruction.shape)


def collective_bytes(program: str, top: int = 6) -> dict[str, Any]:
    """{"bytes": {kind: bytes per device per step}, "attention": {kind: the part whose name
    stack is attention's (context parallelism)}, "count": {kind: instructions},
    "largest": [[kind, name stack, bytes], ...] (the `top` largest, the layers' together),
    "loops_without_trip_count": n} of compiled HLO text (`compiled.as_text()`)."""
    computations, entry = parse(program)
    totals: dict[str, dict[str, int]] = {key: defaultdict(int)
                                         for key in ("bytes", "attention", "count")}
    by_name: dict[tuple[str, str], int] = defaultdict(int)
    unknown = 0

    def walk(name: str, times: int, seen: frozenset[str]) -> None:
        nonlocal unknown
        for instruction in computations.get(name, []):
            kind = instruction.opcode.removesuffix("-start")
            if kind in KINDS and not instruction.opcode.endswith("-done"):
                size = result_bytes(instruction) * times
                totals["bytes"][kind] += size
                totals["count"][kind] += times
                if name_group(instruction.op_name) == "attention":
                    totals["attention"][kind] += size
                by_name[kind, short_label(instruction.op_name, kind)] += size
            repeat = 1
            if instruction.opcode == "while":
                trip = _TRIP_COUNT.search(instruction.attributes)
                repeat = int(trip.group(1)) if trip else 1
                unknown += trip is None
            for called in instruction.called():
                if called not in seen:
                    walk(called, times * repeat, seen | {called})

    walk(entry, 1, frozenset({entry}))
    largest = sorted(by_name.items(), key=lambda item: -item[1])[:top]
    return {**{key: dict(value) for key, value in totals.items()},
            "largest": [[kind, name, size] for (kind, name), size in largest],
            "loops_without_trip_count": unknown}


def format_collectives(result: dict[str, Any]) -> str:
    """'collectives per step: all-gather X GB (attention Y GB), ...', then the largest by
    name stack (where each comes from), a line each."""
    if not result["bytes"]:
        return "collectives per step: none"
    parts = [f"{kind} {size / 1e9:.3f} GB" + (
        f" (attention {result['attention'][kind] / 1e9:.3f} GB)"
        if result["attention"].get(kind) else "")
        for kind, size in sorted(result["bytes"].items(), key=lambda item: -item[1])]
    unknown = result["loops_without_trip_count"]
    largest = [f"  {size / 1e9:7.3f} GB {kind:<18} {name}"
               for kind, name, size in result.get("largest", [])]
    return "\n".join(
        ["collectives per step (result bytes per chip): " + ", ".join(parts)
         + (f"; {unknown} loops of unknown trip count counted once" if unknown else ""),
         *(["  largest by name stack:"] + largest if largest else [])])


if __name__ == "__main__":  # python -m tfm.training.collectives DUMPED_HLO.txt
    import json
    import sys
    from pathlib import Path

    found = collective_bytes(Path(sys.argv[1]).read_text())
    print(format_collectives(found))
    print(json.dumps(found))
