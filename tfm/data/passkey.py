"""Passkey retrieval (Mohtashami and Jaggi 2023) and a multi-key needle task: a random key hidden
in filler text at a chosen depth, the model asked for it at the end. Offline and deterministic:
example i of a (task, length, depth) cell depends only on (seed, task, length, depth, i).

    passkey    <intro> <filler ...> The pass key is 48213. Remember it. 48213 is the pass key.
               <filler ...> What is the pass key? The pass key is             -> " 48213"
    multi_key  the same with `num_keys` lines "The pass key of <name> is <key>." at evenly
               spread depths around `depth`, asked for one name: "What is the pass key of
               <name>? The pass key of <name> is"                              -> " <its key>"

The needle and the question are Mohtashami and Jaggi's (their filler too); the question ends as
the needle's sentence begins, so a model can find the key by matching the phrase before it.

`length` is the prompt's length in tokens of the given tokenizer (its `encode`), answer excluded;
`depth` in [0, 1] is where the (asked-for) key line starts, as a fraction of the filler. Keys use
`alphabet` (digits by default; a character model whose vocabulary lacks digits can use letters).

`training_texts` makes rows to train on (prompt and answer as one text, `data.passkey_rows`):
their keys come from a seed no evaluation cell uses, their depths spread evenly over [0, 1].
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable, Sequence

TASKS = ("passkey", "multi_key")
INTRO = "Find the pass key in this text."  # short: character models train at a few hundred
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
TRAINING_SEED = -1  # evaluation seeds are data.seed >= 0
GOLDEN = (5**0.5 - 1) / 2  # depth of training row i: i * GOLDEN mod 1, evenly spread
NAMES = ("alder", "birch", "cedar", "elm", "hazel", "larch", "maple", "oak", "rowan", "yew")


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt and the answer that completes it (the key, with its leading space)."""

    task: str
    length: int  # the requested prompt length in tokens
    depth: float
    prompt: str
    answer: str


def _rng(seed: int, task: str, length: int, depth: float, index: int) -> random.Random:
    key = f"{seed}/{task}/{length}/{depth:.6f}/{index}".encode()
    return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))


def _key(rng: random.Random, alphabet: str, key_length: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(key_length))


def _fill(encode: Callable[[str], Sequence[int]], budget: int) -> str:
    """The longest repetition of FILLER (cut at a word) whose encoding fits `budget` tokens."""
    words = FILLER.split(" ")
    text, candidate = "", ""
    index = 0
    while True:
        word = words[index % len(words)]
        candidate = f"{text} {word}" if text else word
        if len(encode(candidate)) > budget:
            return text
        text, index = candidate, index + 1


def _assemble(encode: Callable[[str], Sequence[int]], length: int,
              needles: list[tuple[float, str]], question: str) -> str:
    """INTRO, the most filler that keeps the whole prompt within `length` tokens, the needle
    lines inserted at their depths (fractions of the filler), then the question."""
    fixed = " ".join([INTRO, *(line for _, line in needles), question])
    budget = length - len(encode(fixed)) - 2 - len(needles)  # the joining spaces
    if budget < 0:
        raise ValueError(f"length={length} is too short for the passkey prompt "
                         f"({len(encode(fixed))} tokens without filler)")
    while True:
        filler = _fill(encode, budget).split(" ") if budget > 0 else []
        pieces, cursor = [INTRO], 0
        for where, line in sorted(needles):
            cut = max(cursor, round(where * len(filler)))
            pieces += [" ".join(filler[cursor:cut]), line]
            cursor = cut
        pieces += [" ".join(filler[cursor:]), question]
        prompt = " ".join(piece for piece in pieces if piece)
        if len(encode(prompt)) <= length or budget <= 0:
            return prompt
        budget -= len(encode(prompt)) - length  # a tokenizer that merges across the joins


def make_example(task: str, length: int, depth: float, index: int, *,
                 encode: Callable[[str], Sequence[int]], seed: int = 0,
                 alphabet: str = "0123456789", key_length: int = 5, num_keys: int = 4) -> Example:
    """Example `index` of the (task, length, depth) cell."""
    if task not in TASKS:
        raise ValueError(f"task={task!r} is unknown; choose one of: {', '.join(TASKS)}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth={depth} must be in [0, 1]")
    rng = _rng(seed, task, length, depth, index)
    if task == "passkey":
        key = _key(rng, alphabet, key_length)
        line = f"The pass key is {key}. Remember it. {key} is the pass key."
        prompt = _assemble(encode, length, [(depth, line)],
                           "What is the pass key? The pass key is")
        return Example(task, length, depth, prompt, f" {key}")
    names = rng.sample(NAMES, num_keys)
    keys = [_key(rng, alphabet, key_length) for _ in names]
    asked = rng.randrange(num_keys)
    # The asked-for key at `depth`, the others spread over the rest of the text.
    others = [(i + 0.5) / (num_keys - 1) for i in range(num_keys - 1)]
    depths = others[:asked] + [depth] + others[asked:]
    needles = [(where, f"The pass key of {name} is {key}.")
               for where, name, key in zip(depths, names, keys, strict=True)]
    prompt = _assemble(encode, length, needles,
                       f"What is the pass key of {names[asked]}? The pass key of {names[asked]} is")
    return Example(task, length, depth, prompt, f" {keys[asked]}")


def make_cells(task: str, lengths: Sequence[int], depths: Sequence[float], per_cell: int, *,
               encode: Callable[[str], Sequence[int]], seed: int = 0,
               alphabet: str = "0123456789", key_length: int = 5) -> list[Example]:
    """`per_cell` examples of every (length, depth) cell, lengths outermost."""
    return [make_example(task, length, depth, index, encode=encode, seed=seed,
                         alphabet=alphabet, key_length=key_length)
            for length in lengths for depth in depths for index in range(per_cell)]


def accuracy_by_cell(examples: Sequence[Example], predictions: Sequence[str]
                     ) -> dict[tuple[int, float], float]:
    """Exact-match accuracy (the prediction starts with the key, surrounding spaces ignored)
    per (length, depth) cell."""
    hits: dict[tuple[int, float], list[bool]] = {}
    for example, prediction in zip(examples, predictions, strict=True):
        right = prediction.strip().startswith(example.answer.strip())
        hits.setdefault((example.length, example.depth), []).append(right)
    return {cell: sum(values) / len(values) for cell, values in hits.items()}


def training_texts(count: int, length: int, *, task: str = "passkey",
                   alphabet: str = "0123456789", key_length: int = 5) -> list[str]:
    """`count` training rows, each a prompt of `length` characters and its answer as one text
    (length + 1 + key_length characters), at depths i * GOLDEN mod 1 (rounded to 1e-6)."""
    texts = []
    for index in range(count):
        depth = round((index * GOLDEN) % 1.0, 6)
        example = make_example(task, length, depth, index, encode=list, seed=TRAINING_SEED,
                               alphabet=alphabet, key_length=key_length)
        texts.append(example.prompt + example.answer)
    return texts
