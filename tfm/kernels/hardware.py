"""What tfm knows about the hardware it runs on: accelerators' peak FLOP/s, this host's CPU
(model, bf16 units, instruction sets) and its measured matmul speed."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

# Dense bf16 peak FLOP/s per device (vendor figures, no sparsity), matched as case-insensitive
# substrings of jax's `device.device_kind`; the longest matching key wins (so "TPU v5 lite",
# v5e's device kind, beats "TPU v5", v5p's, and "H100 PCIe" beats "H100").
PEAK_FLOPS: dict[str, float] = {
    "H100": 989e12,  # SXM
    "H100 PCIe": 756e12,
    "H200": 989e12,
    "A100": 312e12,
    "V100": 125e12,
    "NVIDIA L4": 121e12,
    "NVIDIA L40S": 362e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5": 459e12,  # v5p
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
}
# On-chip vector memory (VMEM) of one TensorCore, bytes, matched like PEAK_FLOPS: what Mosaic
# lets one kernel allocate, found by compiling a kernel with a scratch buffer for each target
# (libtpu 0.0.42.1): a v5p refuses 65 MiB, "would exceed memory (size=67108864)", half a
# v5e's or v6e's 128 MiB; a v4 refuses 31 MiB of 16 MiB.
VMEM_BYTES: dict[str, int] = {
    "TPU v4": 16 * 2**20,
    "TPU v5 lite": 128 * 2**20,  # v5e
    "TPU v5e": 128 * 2**20,
    "TPU v5": 64 * 2**20,  # v5p
    "TPU v5p": 64 * 2**20,
    "TPU v6 lite": 128 * 2**20,  # v6e
    "TPU v6e": 128 * 2**20,
}
DEFAULT_VMEM_BYTES = 16 * 2**20  # an unknown TPU: the smallest known
CPU_BENCHMARK_SIZE = 2048


def by_device_kind(table: dict[str, Any], device_kind: str) -> Any:
    """The entry of `table` whose key is the longest case-insensitive substring of
    `device_kind` (jax's `device.device_kind`), None if no key is."""
    kind = device_kind.lower()
    matches = [key for key in table if key.lower() in kind]
    return table[max(matches, key=len)] if matches else None


def vmem_bytes(device_kind: str) -> int:
    """VMEM of one TensorCore of the chip `device_kind` (e.g. "TPU v5 lite"), bytes;
    DEFAULT_VMEM_BYTES for a chip not in VMEM_BYTES."""
    found = by_device_kind(VMEM_BYTES, device_kind)
    return DEFAULT_VMEM_BYTES if found is None else found


@dataclasses.dataclass(frozen=True)
class Chip:
    """One accelerator chip's published figures: dense bf16 peak FLOP/s, HBM bytes and HBM
    bandwidth (bytes/s), and where they come from."""

    name: str
    peak_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    source: str


CHIPS: dict[str, Chip] = {
    chip.name: chip
    for chip in (
        Chip("TPU v4", 275e12, 32 * 2**30, 1200e9, "cloud.google.com/tpu/docs/v4"),
        Chip("TPU v5e", 197e12, 16e9, 819e9, "cloud.google.com/tpu/docs/v5e"),
        Chip("TPU v5p", 459e12, 95e9, 2765e9, "cloud.google.com/tpu/docs/v5p"),
        Chip("TPU v6e", 918e12, 32e9, 1640e9, "cloud.google.com/tpu/docs/v6e"),
        Chip("H100 SXM", 989e12, 80e9, 3.35e12, "NVIDIA H100 Tensor Core GPU datasheet"),
        Chip("A100 SXM 80GB", 312e12, 80e9, 2.039e12, "NVIDIA A100 Tensor Core GPU datasheet"),
    )
}


def hardware_line(chip_name: str | None) -> str:
    """One line naming a chip's figures and their source (compiled, not measured)."""
    if chip_name is None:
        return "this host's CPU: compiled for it, no roofline (tfm has no CPU peak table)"
    chip = CHIPS[chip_name]
    return (f"{chip.name}: {chip.peak_flops / 1e12:.0f} TFLOP/s bf16, {chip.hbm_bytes / 1e9:.1f} "
            f"GB HBM at {chip.hbm_bandwidth / 1e9:.0f} GB/s ({chip.source}); figures are "
            "compiled, not measured")


def cpu_features() -> dict[str, Any]:
    """This host's CPU model and whether it computes bfloat16 natively (AMX or AVX512-BF16
    units); without them XLA and torch emulate bf16, which then runs slower than float32."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:  # not Linux: unknown
        pass
    native = sorted(flags & {"amx_bf16", "avx512_bf16"})
    return {
        "model": model,
        "cores": os.cpu_count(),
        "bf16_native": bool(native),
        "bf16_units": native or ["none: bfloat16 is emulated (slower than float32)"],
        "isa": sorted(flags & {"avx2", "avx512f", "amx_tile", "fma"}),
    }


def cpu_line(info: dict[str, Any]) -> str:
    """"CPU: <model>, <cores> cores; bf16 units: <units>" from `cpu_features()`, for reports."""
    return f"CPU: {info['model']}, {info['cores']} cores; bf16 units: " + ", ".join(
        info["bf16_units"]
    )


def bf16_warning(dtype: str, platform: str = "cpu") -> str | None:
    """A one-line warning when a model computing in `dtype` runs in bfloat16 on a CPU without
    bf16 units (`platform`: where it runs)."""
    if dtype != "bfloat16" or platform != "cpu":
        return None
    features = cpu_features()
    if features["bf16_native"]:
        return None
    return (
        f"model.dtype='bfloat16' on a CPU without bfloat16 units ({features['model']}: no AMX "
        "or AVX512-BF16): bf16 is emulated here and runs slower than float32; use "
        "model.dtype='float32' for speed on this machine"
    )


def _cache_path() -> Path:
    root = os.environ.get("TFM_CACHE_DIR") or Path.home() / ".cache" / "tfm"
    return Path(root) / "peak_flops.json"


def measure_matmul_flops(
    dtype: Any = jnp.float32, size: int = CPU_BENCHMARK_SIZE, repeats: int = 5,
    device: jax.Device | None = None,
) -> float:
    """Best-of-`repeats` FLOP/s of a [size, size] x [size, size] matmul on `device` (float32
    accumulation, as training matmuls ask for)."""
    device = device or jax.devices()[0]
    a = jax.device_put(jnp.ones((size, size), dtype), device)
    b = jax.device_put(jnp.ones((size, size), dtype), device)
    matmul = jax.jit(
        lambda a, b: jax.lax.dot(
            a, b, precision=jax.lax.Precision.DEFAULT, preferred_element_type=jnp.float32
        )
    )
    matmul(a, b).block_until_ready()  # compile
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(a, b).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def device_peak_flops(device: jax.Device | None = None, dtype: Any = jnp.bfloat16) -> float | None:
    """Peak FLOP/s of one device. Accelerators: the dense bf16 figure from PEAK_FLOPS whatever
    `dtype` (MFU is quoted against it by convention); None for an unknown accelerator. CPU: the
    host's matmul speed in `dtype`, measured once per CPU model and cached in $TFM_CACHE_DIR
    (default ~/.cache/tfm)/peak_flops.json, divided by the number of local CPU devices (so
    simulated devices share the host and `mfu(..., num_devices=jax.device_count(), ...)` stays
    right)."""
    device = device or jax.devices()[0]
    if device.platform != "cpu":
        return by_device_kind(PEAK_FLOPS, device.device_kind)
    dtype_name = jnp.dtype(dtype).name
    # The CPU model is part of the key: a home directory can outlive the machine under it.
    key = f"{device.device_kind}/{cpu_features()['model']}/{os.cpu_count()}cpus/{dtype_name}"
    path = _cache_path()
    try:
        cache = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        cache = {}
    if key not in cache:
        cache[key] = measure_matmul_flops(dtype, device=device)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        tmp.replace(path)  # atomic: concurrent readers never see half a file
    return cache[key] / len(jax.local_devices(backend="cpu"))
