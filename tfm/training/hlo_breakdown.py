"""Where a compiled step's bytes and FLOPs go: `./launch.sh compile ... --breakdown`.

XLA's `cost_analysis()` gives one total per program. This module reads the compiled
program's text (`compiled.as_text()`) and costs each top-level instruction the way XLA's
HLO cost analysis does for the ones that matter: an instruction (a fusion, a custom call, a
collective) reads its operands and writes its output, so its bytes are the sizes of its
operand and output arrays (a parameter read through slices costs the slices, an in-place
row update costs the row); a fusion's FLOPs are those of the dots and convolutions inside it
(2 x output elements x contracted size; elementwise work is left out, it is small beside the
matmuls and absent from a memory-bound verdict; Pallas kernels declare none). Loop bodies
(`while`) are costed once, as XLA does. The bytes sum to `cost_analysis()["bytes accessed"]`
exactly on CPU and within 2-7% on TPU for GPT-2 small (whose cost analysis has rules of its own
for tile padding; tests/training/test_hlo_breakdown.py, docs/performance.md), so the groups
say why a step is memory-bound.

Each instruction is put in a group by its opcode (collectives) or by its `op_name`, the JAX
name stack of the code that made it (flax module paths such as `layer_3/self_attention`, the
optimizer's `named_scope`): attention, ffn, norm, embedding/loss, optimizer, collectives,
other. An instruction with no name stack (a prefetch, a layout copy) takes its user's.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Any

_ARRAY = re.compile(r"\b(pred|s4|u4|s8|u8|s16|u16|bf16|f16|s32|u32|f32|s64|u64|f64|c64|c128|"
                    r"f8e4m3fn|f8e5m2)\[([0-9,]*)\]")
_ITEM_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "f8e4m3fn": 8, "f8e5m2": 8,
              "s16": 16, "u16": 16, "bf16": 16, "f16": 16, "s32": 32, "u32": 32, "f32": 32,
              "s64": 64, "u64": 64, "f64": 64, "c64": 64, "c128": 128}
_HEADER = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|branch_computations|"
                    r"called_computations|async_execution_thread)=\{?([^}]*?)\}?(?:,\s|$)")
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute",
                "collective-broadcast", "ragged-all-to-all")
# Instructions that move no data of their own (views, tuples, bookkeeping), and the second
# halves of asynchronous pairs (their start already counted the transfer).
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain"}
_RECURSE = {"while", "call", "conditional"}

GROUPS = ("attention", "ffn", "norm", "embedding/loss", "optimizer", "collectives", "other")


def array_bytes(shape_text: str) -> int:
    """Bytes of every array named in an HLO shape ('f32[8,128]{1,0}', or a tuple of them)."""
    total = 0
    for match in _ARRAY.finditer(shape_text):
        dims = [int(d) for d in match.group(2).split(",") if d]
        total += math.prod(dims) * _ITEM_BITS[match.group(1)] // 8
    return total


def _dims(shape_text: str) -> list[int]:
    match = _ARRAY.search(shape_text)
    return [] if match is None else [int(d) for d in match.group(2).split(",") if d]


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its name, opcode, output shape text, operand names, the text
    after the operands (attributes), and the JAX name stack that made it."""

    name: str
    opcode: str
    shape: str
    operands: tuple[str, ...]
    attributes: str
    op_name: str
    root: bool = False
    parameter: int = -1  # a parameter's number

    def called(self) -> list[str]:
        """Computations this instruction calls (fusion bodies, loop bodies, reducers)."""
        names = []
        for match in _CALLS.finditer(self.attributes):
            names += re.findall(r"%([\w.\-]+)", match.group(1))
        return names


def _closing(text: str, depth: int) -> int:
    """Index of the parenthesis in `text` that brings `depth` open ones to zero."""
    for index, char in enumerate(text):
        depth += (char == "(") - (char == ")")
        if depth == 0:
            return index
    return len(text)


def _split_instruction(rest: str) -> tuple[str, str, str, str] | None:
    """'SHAPE opcode(OPERANDS), ATTRS' -> (shape, opcode, operands, attrs)."""
    if rest.startswith("("):  # a tuple shape: up to its closing parenthesis
        end = _closing(rest, 0)
        shape, rest = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode, paren, rest = rest.partition("(")
    if not paren:
        return None
    end = _closing(rest, 1)
    return shape, opcode.strip(), rest[:end], rest[end + 1:]


def parse(program: str) -> tuple[dict[str, list[Instruction]], str]:
    """(computation name -> its instructions, the entry computation's name) of HLO text."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in program.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and line.rstrip().endswith("{"):
                current = header.group(2)
                computations[current] = []
                if header.group(1):
                    entry = current
            continue
        if line.rstrip() == "}":  # (a custom call's config may span lines)
            current = None
            continue
        match = _INSTRUCTION.match(line)
        if match is None:
            continue
        parts = _split_instruction(match.group(3))
        if parts is None:
            continue
        shape, opcode, operands, attributes = parts
        op_name = _OP_NAME.search(attributes)
        computations[current].append(Instruction(
            match.group(2), opcode, shape, tuple(re.findall(r"%([\w.\-]+)", operands)),
            attributes, op_name.group(1) if op_name else "", root=bool(match.group(1)),
            parameter=int(operands) if opcode == "parameter" and operands.isdigit() else -1))
    return computations, entry


def _matmul_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
    """2 x output elements x contracted size, for a dot or a convolution."""
    out = math.prod(_dims(instruction.shape))
    if instruction.opcode == "dot":
        lhs = _dims(shapes.get(instruction.operands[0], ""))
        match = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instruction.attributes)
        contracted = math.prod(lhs[int(d)] for d in match.group(1).split(",") if d) if (
            match and lhs) else 1
        return 2.0 * out * contracted
    return _convolution_flops(instruction, shapes, out)


def _convolution_flops(instruction: Instruction, shapes: dict[str, str], out: int) -> float:
    """2 x (output elements / output positions) x input features x the (output position,
    kernel tap) pairs that land inside the input: taps over padding are not work (TPU writes
    some dots as convolutions whose window slides over a padded length-1 axis)."""
    if len(instruction.operands) < 2:
        return 0.0
    lhs = _dims(shapes.get(instruction.operands[0], ""))
    rhs = _dims(shapes.get(instruction.operands[1], ""))
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instruction.attributes)
    if not lhs or not rhs or not labels:
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    out_dims = _dims(instruction.shape)
    window = re.search(r"window=\{([^}]*)\}", instruction.attributes)
    sizes = pads = strides = None
    if window:
        fields = dict(part.split("=", 1) for part in window.group(1).split() if "=" in part)
        sizes = [int(v) for v in fields.get("size", "").split("x") if v]
        pads = [tuple(int(p) for p in v.split("_")) for v in fields.get("pad", "").split("x") if v]
        strides = [int(v) for v in fields.get("stride", "").split("x") if v]
    pairs, positions = 1, 1
    for axis in sorted(label for label in out_labels if label.isdigit()):
        length = lhs[lhs_labels.index(axis)]
        outputs = out_dims[out_labels.index(axis)]
        index = int(axis)
        taps = sizes[index] if sizes and index < len(sizes) else rhs[rhs_labels.index(axis)]
        low = pads[index][0] if pads and index < len(pads) else 0
        stride = strides[index] if strides and index < len(strides) else 1
        pairs *= sum(1 for position in range(outputs) for tap in range(taps)
                     if 0 <= position * stride + tap - low < length)
        positions *= outputs
    features = rhs[rhs_labels.index("i")] if "i" in rhs_labels else 1  # of one group
    return 2.0 * out / max(positions, 1) * features * pairs


def _computation_flops(name: str, computations: dict[str, list[Instruction]],
                       seen: frozenset[str] = frozenset()) -> float:
    """Matmul FLOPs of a fused computation (and the computations it calls)."""
    if name in seen or name not in computations:
        return 0.0
    body = computations[name]
    shapes = {instruction.name: instruction.shape for instruction in body}
    total = 0.0
    for instruction in body:
        if instruction.opcode in ("dot", "convolution"):
            total += _matmul_flops(instruction, shapes)
        for called in instruction.called():
            total += _computation_flops(called, computations, seen | {name})
    return total


_SLICES = ("dynamic-slice", "slice", "gather")


def _fusion_bytes(fusion: Instruction, shapes: dict[str, str],
                  computations: dict[str, list[Instruction]]) -> int:
    """A fusion's bytes as XLA counts them: a parameter read only through slices costs the
    slices, and an output updated in place (a dynamic-update-slice of a parameter: one
    layer's row of a stacked buffer) costs the update, not the whole buffer."""
    body = computations.get(fusion.called()[0], [])
    inner = {instruction.name: instruction for instruction in body}
    parameters = {instruction.parameter: instruction.name for instruction in body
                  if instruction.opcode == "parameter"}
    users: dict[str, list[Instruction]] = defaultdict(list)
    for instruction in body:
        for operand in instruction.operands:
            users[operand].append(instruction)
    root = next((instruction for instruction in body if instruction.root), None)
    written, in_place = array_bytes(fusion.shape), None
    if (root is not None and root.opcode == "dynamic-update-slice"
            and inner.get(root.operands[0], root).opcode == "parameter"
            and root.operands[1] in inner):
        in_place = root.operands[0]
        written = array_bytes(inner[root.operands[1]].shape)
    read = 0
    for position, operand in enumerate(fusion.operands):
        name = parameters.get(position)
        if name == in_place:
            continue
        consumers = users.get(name, []) if name else []
        if consumers and all(user.opcode in _SLICES and user.operands[0] == name
                             for user in consumers):
            read += sum(array_bytes(user.shape) for user in consumers)
        else:
            read += array_bytes(shapes.get(operand, ""))
    return read + written


@dataclasses.dataclass(frozen=True)
class Cost:
    """One top-level instruction's cost: bytes read and written, matmul FLOPs."""

    name: str
    opcode: str
    op_name: str
    bytes: int
    flops: float
    group: str


def classify(opcode: str, op_name: str) -> str:
    """The group (GROUPS) of an instruction, by opcode for collectives, else by name stack."""
    base = opcode.removesuffix("-start").removesuffix("-done")
    return "collectives" if base in _COLLECTIVES else name_group(op_name)


def name_group(op_name: str) -> str:
    """The group (GROUPS, but collectives) of the code whose JAX name stack is `op_name`."""
    name = op_name.lower()
    if any(word in name for word in ("optax", "adam", "optimizer", "clip", "apply_updates",
                                     "global_norm", "scale_by")):
        return "optimizer"
    # A norm module sits beside the sublayer it feeds (`feed_forward_norm/layer_norm`).
    if any(part.endswith("norm") for part in name.split("/")):
        return "norm"
    if any(word in name for word in ("attention", "splash", "/attn")):
        return "attention"
    if any(word in name for word in ("mlp", "ffn", "feedforward", "feed_forward", "/dense_ff")):
        return "ffn"
    if any(word in name for word in ("embed", "logits", "loss", "cross_entropy", "softmax",
                                     "position")):
        return "embedding/loss"
    return "other"


def _fused_names(name: str, computations: dict[str, list[Instruction]]) -> list[str]:
    """The name stacks of the instructions inside a fused computation."""
    return [instruction.op_name for instruction in computations.get(name, [])
            if instruction.op_name]


def _group(instruction: Instruction, op_name: str,
           computations: dict[str, list[Instruction]]) -> str:
    """classify(); "collectives" for a fusion that wraps a collective alone (TPU's
    async all-gathers); and for a fusion whose own name says nothing (a bare `add` at the top of
    the step: the optimizer's update fused with apply_updates), the optimizer if any of its
    fused instructions is the optimizer's, else the group most of them belong to."""
    if instruction.opcode == "fusion":  # TPU runs async collectives as fusions
        opcodes = {inner.opcode.removesuffix("-start") for called in instruction.called()
                   for inner in computations.get(called, [])}
        if opcodes & set(_COLLECTIVES) and not opcodes & {"dot", "convolution"}:
            return "collectives"
    group = classify(instruction.opcode, op_name)
    if group != "other" or instruction.opcode != "fusion":
        return group
    inner = [classify("fusion", name) for called in instruction.called()
             for name in _fused_names(called, computations)]
    inner = [group for group in inner if group != "other"]
    if "optimizer" in inner:  # a weight's gradient fused into its update: the update's
        return "optimizer"
    return max(set(inner), key=inner.count) if inner else "other"


def instruction_costs(program: str) -> list[Cost]:
    """The cost of every instruction the entry computation runs (loop and call bodies
    costed once, their instructions listed in their place). An instruction without a name
    stack (a parameter's prefetch, a layout copy) takes the name of the first instruction
    that uses it, directly or through other unnamed ones."""
    computations, entry = parse(program)
    costs: list[Cost] = []

    def walk(name: str, seen: frozenset[str]) -> None:
        body = computations.get(name, [])
        shapes = {instruction.name: instruction.shape for instruction in body}
        users: dict[str, list[Instruction]] = defaultdict(list)
        for instruction in body:
            for operand in instruction.operands:
                users[operand].append(instruction)

        def named(instruction: Instruction, depth: int = 0) -> str:
            if instruction.op_name or depth > 6:
                return instruction.op_name
            for user in users.get(instruction.name, []):
                found = named(user, depth + 1)
                if found:
                    return found
            return ""

        for instruction in body:
            opcode = instruction.opcode
            if opcode in _RECURSE:
                for called in instruction.called():
                    if called not in seen:
                        walk(called, seen | {called})
                continue
            if opcode in _FREE or opcode.endswith("-done"):
                continue
            if opcode.endswith("-start") or opcode.endswith("-update"):
                # An async start's output tuple repeats its operands: count the result only.
                outputs = _ARRAY.findall(instruction.shape)
                written = array_bytes(f"{outputs[-1][0]}[{outputs[-1][1]}]") if outputs else 0
                read = sum(array_bytes(shapes.get(o, "")) for o in instruction.operands)
                size = read + written
            elif opcode == "fusion" and instruction.called():
                size = _fusion_bytes(instruction, shapes, computations)
            else:
                size = array_bytes(instruction.shape) + sum(
                    array_bytes(shapes.get(o, "")) for o in instruction.operands)
            flops = 0.0
            if opcode in ("dot", "convolution"):
                flops = _matmul_flops(instruction, shapes)
            elif opcode == "fusion":
                flops = sum(_computation_flops(c, computations) for c in instruction.called())
            op_name = named(instruction)
            costs.append(Cost(instruction.name, opcode, op_name, size, flops,
                              _group(instruction, op_name, computations)))

    walk(entry, frozenset({entry}))
    return costs


def short_label(op_name: str, opcode: str) -> str:
    """A readable label: the name stack without jit(...) and transformation wrappers, marked
    `(backward)` where it came from a transpose (the gradient), up to 90 characters."""
    parts = []
    for part in op_name.split("/"):
        while (match := re.match(r"^(jvp|transpose|remat|checkpoint|vmap|pjit|jit)\((.*)\)$",
                                 part)):
            part = match.group(2)
        parts.append(part)
    parts = [part for part in parts if part and part != "train_step"]
    label = re.sub(r"(layer|layers|Block|block)_\d+", r"\1_*", "/".join(parts)) or opcode
    label = label + " (backward)" if "transpose(" in op_name else label
    return label if len(label) <= 90 else "..." + label[-87:]


def breakdown(program: str, top: int = 12) -> dict[str, Any]:
    """{"total_bytes", "total_flops", "groups": {group: {"bytes", "flops", "count"}},
    "largest": [(label, opcode, group, bytes, flops)] by bytes} for compiled HLO text.
    Labels merge the instructions one name stack made, all layers together (`layer_*`)."""
    costs = instruction_costs(program)
    groups: dict[str, dict[str, float]] = {group: {"bytes": 0, "flops": 0.0, "count": 0}
                                           for group in GROUPS}
    by_label: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for cost in costs:
        groups[cost.group]["bytes"] += cost.bytes
        groups[cost.group]["flops"] += cost.flops
        groups[cost.group]["count"] += 1
        key = (short_label(cost.op_name, cost.opcode), cost.opcode, cost.group)
        by_label[key][0] += cost.bytes
        by_label[key][1] += cost.flops
    largest = sorted(((label, opcode, group, size, flop)
                      for (label, opcode, group), (size, flop) in by_label.items()),
                     key=lambda item: -item[3])[:top]
    return {"total_bytes": sum(cost.bytes for cost in costs),
            "total_flops": sum(cost.flops for cost in costs),
            "groups": groups, "largest": largest}


def format_breakdown(result: dict[str, Any], compiler_bytes: float | None = None) -> str:
    """The breakdown as lines for a terminal."""
    total = result["total_bytes"]
    check = ("" if not compiler_bytes else
             f" (XLA's cost analysis: {compiler_bytes / 1e9:.2f} GB)")
    lines = [f"where the bytes go: {total / 1e9:.2f} GB summed over the program's "
             f"instructions{check}; matmul FLOPs {result['total_flops']:.3e}"]
    for group, figures in sorted(result["groups"].items(), key=lambda item: -item[1]["bytes"]):
        if figures["count"]:
            lines.append(f"  {group:<15} {figures['bytes'] / 1e9:7.2f} GB "
                         f"{100 * figures['bytes'] / max(total, 1):5.1f}%  "
                         f"{figures['flops']:.3e} FLOPs  {figures['count']} instructions")
    lines.append("  largest contributors (bytes, FLOPs, opcode, group, name stack):")
    lines.extend(f"  {size / 1e9:7.2f} GB {flop:10.3e} {opcode:<14} {group:<15} {label}"
                 for label, opcode, group, size, flop in result["largest"])
    return "\n".join(lines)
