"""`./launch.sh compile CONFIG --target NAME`: compile a config's train step (and, for configs
that generate, its decode loop) for an accelerator
this machine does not have (jax compiles for TPU topologies without the chips, given libtpu:
`pip install -e ".[tpu]"`), and report per chip what it needs and how fast it can be.

The report: parameter, optimizer-state and temporary memory per chip and whether the step fits
the chip's HBM; FLOPs per step (the compiler's cost analysis beside tfm.training.flops'
analytic count) and bytes of memory traffic; a roofline step time (the larger of FLOPs / peak
and bytes / bandwidth) and the MFU it implies; the largest arrays of the compiled program;
the bytes of its collectives per kind (tfm.training.collectives: all-gather against ring
under context parallelism).
These are compiled, not measured, figures. XLA counts a scanned (`model.scan_layers=True`)
body once, so its FLOPs and bytes then cover one layer: the report says so.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import jax
import numpy as np

from tfm.checks import ConfigError
from tfm.kernels.hardware import CHIPS, Chip, hardware_line
from tfm.parallel import sharding
from tfm.training import batch_search, collectives, flops, hlo_breakdown, profiling
from tfm.training.experiment import Experiment, setup, state_shardings
from tfm.training.train import jit_steps


@dataclasses.dataclass(frozen=True)
class Target:
    """A machine to compile for: its platform, its chip (hardware.CHIPS) and the keyword
    arguments of `jax.experimental.topologies.get_topology_desc` that describe its chips."""

    name: str
    platform: str
    chip: str | None  # None: this host's CPU
    topology: tuple[tuple[str, Any], ...] = ()


def _gpu(name: str, chip: str, description: str, count: int) -> Target:
    """`count` GPUs on one host, described by a GpuTargetConfig text in gpu_targets/."""
    return Target(name, "cuda", chip, (
        ("target_config", description), ("topology", f"1x1x{count}"),
    ))


def _tpu(name: str, chip: str, topology: str, config: str, host: tuple[int, int, int]) -> Target:
    return Target(name, "tpu", chip, (
        ("topology_name", topology), ("chip_config_name", config),
        ("chips_per_host_bounds", host), ("num_slices", 1),
    ))


# Names as in MaxText's compile topologies. v4-N / v5p-N count TensorCores (2 per chip, one
# "megacore" device each chip); v5e-N / v6e-N count chips.
TARGETS: dict[str, Target] = {
    target.name: target
    for target in (
        Target("cpu", "cpu", None),
        _tpu("v4-8", "TPU v4", "v4:2x2x1", "megacore", (2, 2, 1)),
        _tpu("v5p-8", "TPU v5p", "v5:2x2x1", "megacore", (2, 2, 1)),
        _tpu("v5e-4", "TPU v5e", "v5e:2x2", "default", (2, 2, 1)),
        _tpu("v5e-8", "TPU v5e", "v5e:2x4", "default", (2, 4, 1)),
        _tpu("v5e-256", "TPU v5e", "v5e:16x16", "default", (2, 2, 1)),
        _tpu("v6e-8", "TPU v6e", "v6e:2x4", "default", (2, 4, 1)),
        _gpu("h100-8", "H100 SXM", "h100-80gb.txtpb", 8),
        _gpu("a100-8", "A100 SXM 80GB", "a100-80gb.txtpb", 8),
    )
}


# GpuTargetConfig texts of the GPU targets (what get_topology_desc needs to compile for a GPU
# without one).
GPU_TARGETS = Path(__file__).resolve().parents[1] / "kernels" / "gpu_targets"

# Attention backends whose Pallas kernels declare no cost estimate (XLA counts their operand
# and output bytes, not their FLOPs).
UNCOSTED_KERNELS = ("splash",)


def target_devices(name: str) -> tuple[Target, list[jax.Device]]:
    """The target called `name` and its devices (ConfigError naming what is missing)."""
    if name not in TARGETS:
        raise ConfigError(f"--target={name!r} is unknown; choose one of: {', '.join(TARGETS)}")
    target = TARGETS[name]
    if target.platform == "cpu":
        return target, jax.devices("cpu")
    from jax.experimental import topologies

    arguments = dict(target.topology)
    if target.platform == "cuda":
        arguments["target_config"] = (GPU_TARGETS / arguments["target_config"]).read_text()
    try:
        description = topologies.get_topology_desc(platform=target.platform, **arguments)
    except Exception as error:  # noqa: BLE001 - libtpu missing or the topology unknown to it
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        needs = ('libtpu: pip install -e ".[tpu]"' if target.platform == "tpu" else
                 'the CUDA plugin (pip install -e ".[gpu]") and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 '
                 "set before jax starts, as ./launch.sh compile does")
        raise ConfigError(
            f"--target={name}: cannot describe its chips here ({first}); compiling for "
            f"{target.platform.upper()} needs {needs}"
        ) from None
    return target, list(description.devices)


def _abstract_batch(experiment: Experiment) -> dict[str, jax.ShapeDtypeStruct]:
    """One training batch's shapes and dtypes, placed as the train step takes it."""
    where = sharding.batch_sharding(experiment.mesh, experiment.rules)
    batch = next(iter(experiment.data.train_iterator()))
    return {key: jax.ShapeDtypeStruct(np.shape(value), np.asarray(value).dtype, sharding=where)
            for key, value in batch.items()}


_ARRAY = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([0-9,]+)\]")
_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
             "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}


def largest_arrays(program: str, count: int = 5) -> list[tuple[str, int, int]]:
    """(shape, bytes, how often it appears) of the largest array shapes in compiled HLO text."""
    shapes = Counter(match.group(0) for match in _ARRAY.finditer(program))
    sized = [(shape, _ITEMSIZE[shape.split("[")[0]] * math.prod(
        int(d) for d in shape.split("[")[1][:-1].split(",")), seen)
        for shape, seen in shapes.items()]
    return sorted(sized, key=lambda item: -item[1])[:count]


def score_arrays(program: str, seq_len: int) -> list[str]:
    """The distinct array shapes in compiled HLO text that end in [seq_len, seq_len]: attention
    scores or masks written out whole (a fused kernel leaves none)."""
    square = (str(seq_len), str(seq_len))
    return sorted({match.group(0) for match in _ARRAY.finditer(program)
                   if tuple(match.group(2).split(",")[-2:]) == square})


def _cost(compiled: Any) -> dict[str, float] | None:
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else None
    return None if not cost else {key: float(value) for key, value in cost.items()
                                  if key in ("flops", "bytes accessed")}


def compile_report(experiment: Experiment, target: Target, breakdown: bool = False
                   ) -> dict[str, Any]:
    """Compiles `experiment`'s train step for its mesh (the target's devices) and returns the
    per-chip figures (see the module docstring); bytes are bytes, times are seconds.
    breakdown: also where the bytes and FLOPs go (tfm.training.hlo_breakdown), under
    "breakdown"."""
    abstract, shardings = state_shardings(experiment)
    jit_train, _ = jit_steps(experiment, shardings)
    batch = _abstract_batch(experiment)
    compiled = jit_train.lower(abstract, batch).compile()
    program = compiled.as_text()
    chips = experiment.mesh.devices.size
    model_config, data = experiment.model_config, experiment.data
    seq_len = batch["inputs"].shape[1]
    source_len = batch["source"].shape[1] if "source" in batch else None
    tokens = batch["inputs"].shape[0] * seq_len
    # The count traces the model (jax.eval_shape) under the target's abstract mesh, so its
    # attention backend sees the target's platform, not this host's (cuDNN refuses the CPU).
    with jax.sharding.use_abstract_mesh(experiment.mesh.abstract_mesh):
        analytic = flops.flops_per_token(model_config, seq_len, data.mode, source_len) * tokens
    # Pallas kernels that declare no cost (splash) are invisible to XLA's FLOP count: add
    # the attention core's analytic FLOPs for them.
    # The decoder's self-attention is causal: half its [T, T] matrix is never needed (a causal
    # kernel skips it; tfm.training.flops counts it all).
    causal_half = 0.5 * flops.attention_core_flops(model_config, seq_len,
                                                   model_config.num_decoder_layers) * tokens
    kernel = 0.0
    if model_config.attention_backend in UNCOSTED_KERNELS:  # what the kernel does
        kernel = flops.attention_flops_per_token(model_config, seq_len, data.mode,
                                                 source_len) * tokens - causal_half
    report: dict[str, Any] = {
        "target": target.name, "chips": chips, "platform": experiment.platform,
        "attention_backend": model_config.attention_backend,
        "loss_backend": model_config.loss_backend, "remat": model_config.remat,
        "tokens_per_step": tokens, "tokens_per_chip": tokens // chips,
        **profiling.step_memory(compiled, abstract),
        "analytic_flops_per_chip": analytic / chips,
        "model_flops_per_chip": (analytic - causal_half) / chips,
        "kernel_flops_per_chip": kernel / chips,
        "scanned_layers": model_config.scan_layers,
        "largest_arrays": largest_arrays(program),
        "score_arrays": score_arrays(program, seq_len),
        "collectives": collectives.collective_bytes(program),
    }
    if breakdown:
        report["breakdown"] = hlo_breakdown.breakdown(program)
    cost = _cost(compiled)
    if cost is not None:
        report.update(compiled_flops_per_chip=cost.get("flops") + kernel / chips,
                      bytes_per_chip=cost.get("bytes accessed"))
    chip = CHIPS.get(target.chip) if target.chip else None
    if chip is not None:
        report.update(_roofline(report, chip))
    return report


def decode_report(experiment: Experiment, target: Target) -> dict[str, Any]:
    """Compiles `experiment`'s generation loop (the `generate` section's method and
    max_new_tokens; an LM continues prompts of half the training rows, an encoder-decoder
    translates training-length sources) for one training batch of rows, parameters placed as
    the train step's; returns its memory per chip and, where the compiler gives one, its cost
    (XLA counts a while loop's body once: prefill plus one decoding step)."""
    from tfm.decode import generate

    abstract, shardings = state_shardings(experiment)
    batch = _abstract_batch(experiment)
    rows, seq_len = batch["inputs"].shape
    decode = experiment.generate.decode_config(experiment.mode)
    config = experiment.model_config
    replicated = jax.sharding.NamedSharding(experiment.mesh, jax.sharding.PartitionSpec())
    rows_where = batch["inputs"].sharding  # rows split over the data axes, as in training
    lengths = jax.ShapeDtypeStruct((rows,), np.int32, sharding=jax.sharding.NamedSharding(
        experiment.mesh, jax.sharding.PartitionSpec(rows_where.spec[0])))
    rng = jax.ShapeDtypeStruct((2,), np.uint32, sharding=replicated)
    params = jax.tree.map(
        lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
        abstract.params, shardings.params)
    special = generate.special_ids(experiment.data.tokenizer, experiment.mode)
    if experiment.family.reads_source:
        source_len = batch["source"].shape[1]
        if decode.max_new_tokens is None:
            decode = dataclasses.replace(decode, max_new_tokens=source_len + decode.extra_len)
        tokens = jax.ShapeDtypeStruct((rows, source_len), np.int32, sharding=rows_where)
        loop = jax.jit(generate._translate_jit.__wrapped__, static_argnums=(4, 5, 6, 7))
        arguments = (params, tokens, lengths, rng, config,
                     decode, special["bos_id"], special["eos_id"])
        shape = f"{rows} x {source_len}-token sources, up to {decode.max_new_tokens} new tokens"
    else:
        prompt_len = max(1, seq_len // 2)
        decode = dataclasses.replace(
            decode, max_new_tokens=min(decode.max_new_tokens or seq_len, seq_len - prompt_len))
        tokens = jax.ShapeDtypeStruct((rows, prompt_len), np.int32, sharding=rows_where)
        loop = jax.jit(generate._lm_generate_jit.__wrapped__, static_argnums=(4, 5, 6))
        arguments = (params, tokens, lengths, rng, config,
                     decode, special["eos_id"])
        shape = f"{rows} x {prompt_len}-token prompts, {decode.max_new_tokens} new tokens"
    with sharding.sharding_context(experiment.mesh, experiment.rules):
        compiled = loop.lower(*arguments).compile()
    memory = compiled.memory_analysis()
    report: dict[str, Any] = {"method": decode.method, "shape": shape,
                              "params_bytes": profiling.bytes_per_device(abstract.params)}
    if memory is not None:
        report.update(temp_bytes=memory.temp_size_in_bytes, needed_bytes=(
            memory.argument_size_in_bytes + memory.output_size_in_bytes
            - memory.alias_size_in_bytes + memory.temp_size_in_bytes))
    cost = _cost(compiled)
    if cost is not None:
        report.update(flops_per_chip=cost.get("flops"), bytes_per_chip=cost.get("bytes accessed"))
    chip = CHIPS.get(target.chip) if target.chip else None
    if chip is not None and "needed_bytes" in report:
        report["fits"] = report["needed_bytes"] <= chip.hbm_bytes
    return report


def _roofline(report: dict[str, Any], chip: Chip) -> dict[str, Any]:
    """HBM fit and, where the compiler gave a cost analysis, the roofline step time and MFU."""
    figures: dict[str, Any] = {
        "chip": chip.name, "hbm_bytes": chip.hbm_bytes,
        "fits": report["needed_bytes"] <= chip.hbm_bytes,
        "overflow_bytes": max(0, report["needed_bytes"] - chip.hbm_bytes),
    }
    if report.get("compiled_flops_per_chip") is None or report.get("bytes_per_chip") is None:
        return figures
    compute_s = report["compiled_flops_per_chip"] / chip.peak_flops
    memory_s = report["bytes_per_chip"] / chip.hbm_bandwidth
    step_s = max(compute_s, memory_s)
    # Model FLOPs: tfm.training.flops' count without the causal half of the decoder's attention
    # matrix (no kernel needs it), the same for every backend; the full count is kept beside.
    useful = report.get("model_flops_per_chip", report["analytic_flops_per_chip"])
    figures.update(compute_seconds=compute_s, memory_seconds=memory_s, roofline_seconds=step_s,
                   bound="memory" if memory_s > compute_s else "compute",
                   roofline_mfu=useful / (step_s * chip.peak_flops),
                   roofline_mfu_full_attention=report["analytic_flops_per_chip"] / (
                       step_s * chip.peak_flops))
    return figures


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f} GB"


def format_report(report: dict[str, Any]) -> str:
    """The report as lines for a terminal."""
    lines = [
        f"target {report['target']}: {report['chips']} x {report.get('chip', 'CPU')} "
        f"({report['platform']}), attention_backend={report['attention_backend']!r}, "
        f"loss_backend={report.get('loss_backend', 'reference')!r}, "
        f"remat={report['remat']!r}, "
        f"{report['tokens_per_chip']:,} tokens per chip per step",
        f"memory per chip: parameters {_gb(report['params_bytes'])}, optimizer state "
        f"{_gb(report['optimizer_bytes'])}, temporaries {_gb(report['temp_bytes'])}; "
        f"needs {_gb(report['needed_bytes'])}"
        + (f" of {_gb(report['hbm_bytes'])} HBM: "
           + ("fits" if report["fits"] else f"DOES NOT FIT (over by "
                                             f"{_gb(report['overflow_bytes'])})")
           if "fits" in report else ""),
    ]
    if report.get("compiled_flops_per_chip") is None:
        lines.append("this target's compiler gives no cost analysis: memory only")
    else:
        lines.append(
            f"FLOPs per chip per step: compiled {report['compiled_flops_per_chip']:.3e}"
            + (f" (of which {report['kernel_flops_per_chip']:.3e} are the attention kernel's, "
               "counted by tfm.training.flops, the decoder's causal half: splash declares no "
               "cost)"
               if report.get("kernel_flops_per_chip") else "")
            + f", analytic (tfm.training.flops) {report['analytic_flops_per_chip']:.3e}; "
            f"memory traffic {_gb(report['bytes_per_chip'])}")
        if report.get("scanned_layers"):
            lines.append("model.scan_layers=True: XLA counts the scanned layer once, so the "
                         "compiled FLOPs and bytes cover one layer")
    if "roofline_seconds" in report:
        lines.append(
            f"roofline: compute {report['compute_seconds'] * 1e3:.1f} ms, memory "
            f"{report['memory_seconds'] * 1e3:.1f} ms -> {report['bound']}-bound step "
            f"{report['roofline_seconds'] * 1e3:.1f} ms, MFU at most "
            f"{100 * report['roofline_mfu']:.1f}%"
            + ("" if report["roofline_mfu_full_attention"] == report["roofline_mfu"] else
               f" ({100 * report['roofline_mfu_full_attention']:.1f}% counting the whole causal "
               "attention matrix, as tfm.training.flops does)"))
    if "collectives" in report:
        lines.append(collectives.format_collectives(report["collectives"]))
    lines.append("[.., T, T] arrays (attention scores or masks): "
                 + (", ".join(report["score_arrays"]) or "none"))
    lines.append("largest arrays: " + "; ".join(
        f"{shape} ({size / 1e9:.2f} GB) x{seen}" for shape, size, seen in report["largest_arrays"]))
    if report.get("decode") is not None:
        lines.append(format_decode(report["decode"]))
    if "breakdown" in report:
        lines.append(hlo_breakdown.format_breakdown(report["breakdown"],
                                                    report.get("bytes_per_chip")))
    lines.append(hardware_line(report.get("chip")))
    return "\n".join(lines)


def _write_json(report: dict[str, Any], json_path: str | None) -> None:
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1, default=str) + "\n")


def format_decode(decode: dict[str, Any]) -> str:
    """The decode loop's line of a report."""
    if "refused" in decode:
        return f"decode loop: DOES NOT FIT ({decode['refused']})"
    needs = (f"temporaries {_gb(decode['temp_bytes'])}; needs {_gb(decode['needed_bytes'])}"
             + ("" if "fits" not in decode else ": fits" if decode["fits"] else ": DOES NOT FIT")
             if "needed_bytes" in decode else "no memory analysis")
    cost = ("" if decode.get("bytes_per_chip") is None else
            f"; {decode['flops_per_chip']:.3e} FLOPs and {_gb(decode['bytes_per_chip'])} of "
            "traffic per chip for the prefill plus one step (XLA counts a loop body once)")
    return (f"decode loop ({decode['method']}, {decode['shape']}): parameters "
            f"{_gb(decode['params_bytes'])}, {needs}{cost}")


def run(
    config: Any, workdir: Any, target_name: str, json_path: str | None = None,
    largest_batch: bool = False, breakdown: bool = False, decode_only: bool = False,
    train_only: bool = False,
) -> tuple[str, str | None]:
    """What `./launch.sh compile` prints: (the report's lines, or "" when the compiler refused
    the step; one line saying why the step does not fit, or None). Writes the report to
    `json_path` when given. largest_batch: search `data.batch_size` for the largest train step
    that fits (tfm.training.batch_search) and report that one. breakdown: the report also
    lists where the step's bytes and FLOPs go (tfm.training.hlo_breakdown). decode_only: the
    decode loop alone (`decode_for`). train_only: the train step alone (for a change that
    cannot touch decoding)."""
    if decode_only and train_only:
        raise ConfigError("compile: --decode_only and --train_only exclude each other; "
                          "give neither for the train step and the decode loop")
    if largest_batch:
        return _run_search(config, workdir, target_name, json_path)
    if decode_only:
        report = decode_for(config, workdir, target_name)
        _write_json(report, json_path)
        text = (f"target {report['target']}: {report['chips']} chips ({report['platform']}), "
                f"the decode loop alone (--decode_only)\n{format_decode(report['decode'])}")
        fits = report["decode"].get("fits") is not False
        return text, None if fits else f"--target={target_name} does not fit: the decode loop"
    try:
        report = compile_for(config, workdir, target_name, breakdown, decode=not train_only)
    except Exception as error:  # the compiler's own out-of-memory verdict, in one line
        line = out_of_memory_line(error)
        if line is None:
            raise
        return "", f"--target={target_name} does not fit: {line}"
    _write_json(report, json_path)
    decode = report.get("decode") or {}
    if report.get("fits") is not False and decode.get("fits") is False:
        why = decode.get("refused") or (
            f"it needs {decode['needed_bytes'] / 1e9:.2f} GB per chip, over the "
            f"{report['hbm_bytes'] / 1e9:.1f} GB of HBM of a {report['chip']}")
        return format_report(report), (
            f"--target={target_name} does not fit: the train step does, the decode loop "
            f"does not: {why}")
    if report.get("fits") is False:
        return format_report(report), (
            f"--target={target_name} does not fit: the step needs "
            f"{report['needed_bytes'] / 1e9:.2f} GB per chip, over the "
            f"{report['hbm_bytes'] / 1e9:.1f} GB of HBM of a {report['chip']}")
    return format_report(report), None


def train_report(config: Any, workdir: Any, target_name: str) -> dict[str, Any]:
    """Sets up `config` with its mesh over `target_name`'s devices and compiles its train
    step alone; returns the report. Raises ConfigError before compiling for a bad target."""
    target, devices = target_devices(target_name)
    return compile_report(setup(config, workdir, devices=devices), target)


def compile_for(config: Any, workdir: Any, target_name: str, breakdown: bool = False,
                decode: bool = True) -> dict[str, Any]:
    """Sets up `config` with its mesh over `target_name`'s devices and compiles its train
    step (and, for configs that generate and unless `decode` is False, its decode loop);
    returns the report. Raises ConfigError before compiling for a bad target."""
    target, devices = target_devices(target_name)
    experiment = setup(config, workdir, devices=devices)
    report = compile_report(experiment, target, breakdown)
    if decode and (experiment.family.reads_source or experiment.generate.decode.max_new_tokens):
        report["decode"] = _decode_or_refusal(experiment, target)
    return report


def _decode_or_refusal(experiment: Experiment, target: Target) -> dict[str, Any]:
    """decode_report, or the compiler's out-of-memory verdict on the loop, in one line."""
    try:
        return decode_report(experiment, target)
    except Exception as error:
        line = out_of_memory_line(error)
        if line is None:
            raise
        return {"fits": False, "refused": line}


def out_of_memory_line(error: Exception) -> str | None:
    """The compiler's out-of-memory verdict in one line (None for any other error). Where a
    Pallas kernel's tiles exceed the chip's on-chip memory (VMEM: Mosaic's
    CompileTimeScopedVmemOom, whose first line names neither, or XLA's "memory space vmem"),
    the line says which kernel, by how much, and for the fused loss's kernels, how to do
    without them."""
    text = str(error)
    lines = [line.strip() for line in text.splitlines()]
    first = next((line for line in lines if "RESOURCE_EXHAUSTED" in line), None)
    if first is None or not ("VmemOom" in first or "memory space vmem" in first):
        return first
    # the kernel's name, inside whatever transformations made the call: jvp(...), transpose(...)
    kernel = re.search(r'op_name="[^"]*?([\w.-]+)\)*/pallas_call"', text)
    size = (re.search(r"Scoped allocation with size (\S+) and limit (\S+) exceeded", text)
            or re.search(r"Used (\S+) of (\S+) vmem", text))
    where = f"the Pallas kernel {kernel.group(1)}" if kernel else "a Pallas kernel"
    needs = (f" needs {size.group(1)} of on-chip memory (VMEM) where {size.group(2)} is "
             f"allowed" if size else " needs more on-chip memory (VMEM) than allowed")
    instead = ("; --config.model.loss_backend=reference computes the loss without it"
               if kernel and kernel.group(1).startswith("tfm_cross_entropy") else "")
    return f"{first} {where}{needs}: its tiles are too large for this chip{instead}"


def decode_for(config: Any, workdir: Any, target_name: str) -> dict[str, Any]:
    """`compile --decode_only`: compile_for's decode loop alone, no train step (for a change
    to decoding: a minute here, where the step takes several)."""
    target, devices = target_devices(target_name)
    experiment = setup(config, workdir, devices=devices)
    return {"target": target.name, "chips": experiment.mesh.devices.size,
            "platform": experiment.platform, "decode": _decode_or_refusal(experiment, target)}


def largest_batch(config: Any, workdir: Any, target_name: str,
                  on_try: Any = None) -> dict[str, Any]:
    """batch_search.search over `target_name`'s chip memory, in multiples of its chip count,
    compiling with train_report. Raises ConfigError for a target without a memory size."""
    target, devices = target_devices(target_name)
    chip = CHIPS.get(target.chip) if target.chip else None
    if chip is None:
        raise ConfigError(f"--largest_batch needs a target with a known memory size; "
                          f"{target_name!r} has none")
    return batch_search.search(config, workdir, target_name, chip.hbm_bytes, len(devices),
                               train_report, on_try)


def _run_search(config: Any, workdir: Any, target_name: str,
                json_path: str | None) -> tuple[str, str | None]:
    """`run` with --largest_batch: the search's line, then the report at the batch found."""

    def on_try(rows: int, needed: float | None) -> None:  # progress: compiles take minutes
        verdict = "refused by the compiler" if needed is None else f"needs {needed / 1e9:.2f} GB"
        print(f"batch_size={rows}: {verdict}", file=sys.stderr, flush=True)

    result = largest_batch(config, workdir, target_name, on_try)
    line = batch_search.summary(result, target_name)
    _write_json(result, json_path)
    if result["largest"] is None:
        return "", f"--target={target_name} does not fit: {line}"
    return line + "\n" + format_report(result["report"]), None
