"""Several processes, as Levanter runs the harness: process 0 drives it, and sends each batch it
would run to the other processes, which run the same jitted step on their part of the mesh.

A message is one operation (`op`), JSON metadata and a few numpy arrays. It travels as three
collectives (jax.experimental.multihost_utils.broadcast_one_to_all): its JSON's length, the
JSON (as bytes; it names the arrays' shapes and dtypes), then the arrays. Every process calls
`share` once per message, in the same order: process 0 with the message, the others with None.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

STOP = "stop"  # the message that ends a follower's loop
HEADER_QUANTUM = 256  # bytes


@dataclasses.dataclass(frozen=True)
class Message:
    """One step for every process: `op` (score, generate, stop), its JSON-able `meta`, and its
    arrays {name: numpy array}, the same on every process once shared."""

    op: str
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    arrays: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def is_leader() -> bool:
    return jax.process_index() == 0


def share(message: Message | None) -> Message:
    """Process 0's `message` on every process (the others pass None). Arrays must be int32 or
    float32: the broadcast sums over processes in JAX's default (32-bit) types."""
    leader = is_leader()
    if leader:
        if message is None:
            raise ValueError("process 0 shares a message; the others pass None")
        for name, array in message.arrays.items():
            if array.dtype not in (np.int32, np.float32):
                raise ValueError(f"array {name!r} is {array.dtype}; share int32 or float32")
        header = json.dumps({
            "op": message.op, "meta": message.meta,
            "arrays": {name: [list(array.shape), array.dtype.name]
                       for name, array in message.arrays.items()},
        }).encode()
        # Padded (JSON allows trailing spaces) to few sizes: each size compiles a broadcast.
        header = header.ljust(-(-len(header) // HEADER_QUANTUM) * HEADER_QUANTUM)
        size = np.array([len(header)], np.int32)
        header_bytes = np.frombuffer(header, np.uint8).astype(np.int32)
    else:
        size = np.zeros((1,), np.int32)
    size = int(np.asarray(multihost_utils.broadcast_one_to_all(size, is_source=leader))[0])
    if not leader:
        header_bytes = np.zeros((size,), np.int32)
    header_bytes = np.asarray(
        multihost_utils.broadcast_one_to_all(header_bytes, is_source=leader))
    described = json.loads(header_bytes.astype(np.uint8).tobytes().decode())
    if leader:
        arrays = message.arrays
    else:
        arrays = {name: np.zeros(shape, dtype)
                  for name, (shape, dtype) in described["arrays"].items()}
    if arrays:
        arrays = {name: np.asarray(value) for name, value in
                  multihost_utils.broadcast_one_to_all(arrays, is_source=leader).items()}
    return Message(described["op"], described["meta"], arrays)
