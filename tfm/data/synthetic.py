"""Synthetic algorithmic tasks, generated deterministically from a seed, and an answer checker.

Tasks (source -> target, both plain strings over a small alphabet):

    copy      "3141"        -> "3141"
    reverse   "3141"        -> "1413"
    sort      "3141"        -> "1134"       (ascending by character)
    addition  "123+4567"    -> "4690"       (decimal, no leading zeros)

The *length* of an example is the number of symbols of the source for copy/reverse/sort, and the
number of digits of each operand for addition (each operand drawn independently). Lengths are drawn
uniformly from an inclusive range; training and evaluation use separate ranges, so a model trained
on lengths <= L can be tested on longer ones (length generalization).

Example i of a split depends only on (seed, split, i): growing `num_examples` keeps the earlier
examples, and every machine generates the same data. Copy/reverse/sort draw symbols from the first
`num_symbols` characters of `SYMBOLS`. Decoder-only use joins prompt and answer with `SEPARATOR`.
"""

from __future__ import annotations

import random

TASKS = ("copy", "reverse", "sort", "addition")
SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyz"
DIGITS = "0123456789"
PLUS = "+"
SEPARATOR = "="  # joins prompt and answer in decoder-only (lm) mode
# Splits of the synthetic builder (each draws its own examples): train and validation use the
# training lengths, test the evaluation lengths, test_long the optional longer ones.
SPLIT_KEYS = {"train": 0, "validation": 1, "test": 2, "test_long": 3}


def check_task(task: str, num_symbols: int = 10) -> None:
    """Raises ValueError for an unknown task or an alphabet size out of range."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is unknown; choose one of: {', '.join(TASKS)}")
    if not 2 <= num_symbols <= len(SYMBOLS):
        raise ValueError(f"num_symbols={num_symbols} must be in [2, {len(SYMBOLS)}]")


def vocabulary(task: str, num_symbols: int = 10) -> list[str]:
    """Every character a task can produce, including "+" and the separator "=", in a fixed order
    (the synthetic char tokenizer is built from this, never from data)."""
    check_task(task, num_symbols)
    symbols = DIGITS if task == "addition" else SYMBOLS[:num_symbols]
    return [*symbols, PLUS, SEPARATOR]


def solve(task: str, source: str) -> str:
    """The correct target for `source`."""
    if task == "copy":
        return source
    if task == "reverse":
        return source[::-1]
    if task == "sort":
        return "".join(sorted(source))
    if task == "addition":
        left, right = source.split(PLUS)
        return str(int(left) + int(right))
    raise ValueError(f"task={task!r} is unknown; choose one of: {', '.join(TASKS)}")


def _number(rng: random.Random, num_digits: int) -> str:
    first = rng.choice(DIGITS[1:] if num_digits > 1 else DIGITS)
    return first + "".join(rng.choices(DIGITS, k=num_digits - 1))


def example_rng(seed: int, split: str, index: int) -> random.Random:
    """The generator of one example. Python's Mersenne Twister seeded with an int is the same on
    every platform and version, and about 20x cheaper to create than a numpy Generator."""
    if not (0 <= seed < 2**32 and 0 <= index < 2**32):
        raise ValueError(f"seed={seed} and index={index} must be in [0, 2**32)")
    return random.Random((seed << 40) | (SPLIT_KEYS[split] << 32) | index)


def generate(
    task: str, index: int, *, seed: int, split: str, lengths: tuple[int, int], num_symbols: int = 10
) -> tuple[str, str]:
    """Example `index` of `split`: (source, target), a pure function of its arguments."""
    check_task(task, num_symbols)
    low, high = lengths
    if not 1 <= low <= high:
        raise ValueError(f"lengths={lengths} must satisfy 1 <= low <= high")
    rng = example_rng(seed, split, index)
    if task == "addition":
        left = _number(rng, rng.randint(low, high))
        right = _number(rng, rng.randint(low, high))
        source = f"{left}{PLUS}{right}"
    else:
        source = "".join(rng.choices(SYMBOLS[:num_symbols], k=rng.randint(low, high)))
    return source, solve(task, source)


def check_example(
    task: str, source: str, target: str, *, lengths: tuple[int, int], num_symbols: int = 10
) -> str | None:
    """None if (source, target) is a valid example with its length in `lengths`; otherwise a
    sentence saying what is wrong. Checks the answer independently of `generate`."""
    low, high = lengths
    if task == "addition":
        parts = source.split(PLUS)
        if len(parts) != 2 or not all(p and set(p) <= set(DIGITS) for p in parts):
            return f"source {source!r} is not two decimal numbers joined by '+'"
        for part in parts:
            if len(part) > 1 and part[0] == "0":
                return f"operand {part!r} has a leading zero"
            if not low <= len(part) <= high:
                return f"operand {part!r} has {len(part)} digits, outside {lengths}"
        # Schoolbook addition digit by digit, so the check does not reuse solve().
        left, right = parts[0][::-1], parts[1][::-1]
        digits, carry = [], 0
        for i in range(max(len(left), len(right))):
            total = carry + (int(left[i]) if i < len(left) else 0)
            total += int(right[i]) if i < len(right) else 0
            digits.append(str(total % 10))
            carry = total // 10
        if carry:
            digits.append(str(carry))
        expected = "".join(reversed(digits))
    else:
        if not set(source) <= set(SYMBOLS[:num_symbols]):
            return f"source {source!r} uses symbols outside the first {num_symbols}"
        if not low <= len(source) <= high:
            return f"source {source!r} has length {len(source)}, outside {lengths}"
        if task == "copy":
            expected = source
        elif task == "reverse":
            expected = "".join(source[len(source) - 1 - i] for i in range(len(source)))
        elif task == "sort":
            counts = {s: source.count(s) for s in SYMBOLS[:num_symbols]}
            expected = "".join(s * counts[s] for s in SYMBOLS[:num_symbols])
        else:
            return f"task {task!r} is unknown"
    if target != expected:
        return f"target {target!r} for source {source!r} should be {expected!r}"
    return None
