"""Where a training step's time and memory go: a jax.profiler trace of chosen steps
(`train.profile_start`, `train.profile_steps`) and the compiled train step's memory per device.

The trace is what TensorBoard's profile plugin (xprof) and ui.perfetto.dev read:
`WORKDIR/profile/plugins/profile/<time>/<host>.xplane.pb` and `<host>.trace.json.gz`, each step
inside a `StepTraceAnnotation("train", step_num=step)`. The memory figures come from XLA's
`memory_analysis()` of the compiled step (what `./launch.sh compile` reports too) and, where the
device keeps them (GPU, TPU; not CPU), its allocator's statistics.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np


def bytes_per_device(abstract: Any) -> int:
    """Bytes one device holds of a tree of arrays or ShapeDtypeStructs with shardings."""
    total = 0
    for leaf in jax.tree.leaves(abstract):
        where = getattr(leaf, "sharding", None)
        shape = where.shard_shape(leaf.shape) if where is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def step_memory(compiled: Any, abstract_state: Any) -> dict[str, int]:
    """A compiled train step's memory per device, in bytes: parameters and optimizer state (from
    the state's shapes and shardings), and XLA's figures for temporaries, arguments and what
    the step needs in all (arguments + outputs - donated + temporaries) where it has them."""
    memory = compiled.memory_analysis()
    figures = {
        "params_bytes": bytes_per_device(abstract_state.params),
        "optimizer_bytes": bytes_per_device(abstract_state.opt_state),
    }
    if memory is None:  # a backend without the analysis
        return figures
    return {
        **figures,
        "temp_bytes": memory.temp_size_in_bytes,
        "argument_bytes": memory.argument_size_in_bytes,
        "needed_bytes": (memory.argument_size_in_bytes + memory.output_size_in_bytes
                         - memory.alias_size_in_bytes + memory.temp_size_in_bytes),
    }


def format_bytes(size: float) -> str:
    """1234567 -> '1.23 MB' (decimal units, as XLA's and the chips' figures are quoted)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(size) >= scale:
            return f"{size / scale:.2f} {unit}"
    return f"{int(size)} B"


def device_memory(device: jax.Device) -> dict[str, int] | None:
    """The allocator's bytes in use, peak and limit on `device`; None where the device keeps no
    statistics (a CPU)."""
    stats = device.memory_stats()
    if not stats or "bytes_in_use" not in stats:
        return None
    return {key: int(stats[key]) for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
            if key in stats}


def memory_line(figures: dict[str, int], device_figures: dict[str, int] | None) -> str:
    """One console line: the step's compiled memory per device and, if given, the device's."""
    line = (f"train step memory per device (compiled): parameters "
            f"{format_bytes(figures['params_bytes'])}, optimizer state "
            f"{format_bytes(figures['optimizer_bytes'])}, ")
    if "temp_bytes" in figures:
        line += (f"temporaries {format_bytes(figures['temp_bytes'])}; needs "
                 f"{format_bytes(figures['needed_bytes'])}")
    else:
        line += "temporaries unknown (no memory analysis on this backend)"
    if device_figures:
        line += f"; device memory in use {format_bytes(device_figures['bytes_in_use'])}"
        if "bytes_limit" in device_figures:
            line += f" of {format_bytes(device_figures['bytes_limit'])}"
        if "peak_bytes_in_use" in device_figures:
            line += f" (peak {format_bytes(device_figures['peak_bytes_in_use'])})"
    return line


class MemoryOnFirstCall:
    """A jitted train step whose first call compiles it through `.lower(...).compile()`, reports
    its memory, then runs. jax (0.10) keeps that executable for the call, so the step still
    compiles once (tests/training/test_profile.py counts)."""

    def __init__(self, jitted: Any, abstract_state: Any, report: Callable[[str], None]) -> None:
        self.jitted, self.abstract_state = jitted, abstract_state
        self.report: Callable[[str], None] | None = report

    def __call__(self, *args: Any) -> Any:
        if self.report is not None:
            report, self.report = self.report, None  # once, even if the line fails
            figures = step_memory(self.jitted.lower(*args).compile(), self.abstract_state)
            report(memory_line(figures, device_memory(jax.local_devices()[0])))
        return self.jitted(*args)


class StepTrace:
    """A jax.profiler trace of steps [start, start + num_steps) into `directory`; a run resumed
    inside that window traces its remaining steps, one resumed past it nothing. Call `stop()`
    in a `finally`: a run that ends or fails inside the window still closes its trace."""

    def __init__(self, directory: Path, start: int | None, num_steps: int) -> None:
        self.directory = directory
        self.window = range(0) if start is None else range(start, start + num_steps)
        self.active = False

    def annotate(self, step: int) -> jax.profiler.StepTraceAnnotation:
        """The context of step `step` (the state's step before it); starts the trace first
        when `step` is in the window."""
        if step in self.window and not self.active:
            self.directory.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.directory))
            self.active = True
        return jax.profiler.StepTraceAnnotation("train", step_num=step)

    def step_done(self, step: int, outputs: Any) -> None:
        """After step `step` was dispatched: at the window's end, waits for its `outputs` (so
        the trace holds the step's device work, not just its dispatch) and stops."""
        if self.active and step + 1 >= self.window.stop:
            jax.block_until_ready(outputs)
            self.stop()

    def stop(self) -> None:
        if self.active:
            self.active = False
            jax.profiler.stop_trace()
