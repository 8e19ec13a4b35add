"""./launch.sh compile: the train step compiled for a target, with per-chip memory, FLOPs and a
roofline. The CPU target runs everywhere; TPU targets need libtpu (`pip install -e ".[tpu]"`),
and their tests skip without it:

    pip install -e ".[dev,tpu]" && python -m pytest tests/training/test_compile_report.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from configs import synthetic_lm, synthetic_seq2seq
from tfm.checks import ConfigError
from tfm.kernels.hardware import CHIPS
from tfm.training import compile_report

ROOT = Path(__file__).resolve().parents[2]
HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
HAS_CUDA_PLUGIN = importlib.util.find_spec("jax_cuda12_plugin") is not None


def _config(data_dir: Path, **model):
    config = synthetic_lm.get_config("runlocal")
    config.model.update({**dict(d_model=32, num_heads=2, d_ff=64, num_decoder_layers=2), **model})
    config.data.update(data_dir=str(data_dir), batch_size=8, num_train_examples=64,
                       num_eval_examples=8)
    return config


def test_largest_arrays_reads_shapes_from_program_text():
    program = ("%a = f32[8,12,1024,1024]{3,2,1,0} fusion(...)\n%b = bf16[50304,768] param\n"
               "%c = f32[8,12,1024,1024] add(%a, %a)\n%d = s32[] constant(0)")
    arrays = compile_report.largest_arrays(program, count=2)
    assert arrays == [("f32[8,12,1024,1024]", 4 * 8 * 12 * 1024 * 1024, 2),
                      ("bf16[50304,768]", 2 * 50304 * 768, 1)]


def test_score_arrays_are_those_ending_in_length_by_length():
    program = ("%a = f32[8,12,1024,1024]{3,2,1,0} fusion(...)\n%b = bf16[1024,1024] param\n"
               "%c = f32[8,1024,768] add(%x, %y)\n%d = pred[8,1,1024,1024] compare(%e, %f)")
    assert compile_report.score_arrays(program, 1024) == [
        "bf16[1024,1024]", "f32[8,12,1024,1024]", "pred[8,1,1024,1024]"]
    assert compile_report.score_arrays(program, 768) == []


def test_roofline_is_the_slower_of_compute_and_traffic():
    chip = CHIPS["TPU v5e"]
    report = {"needed_bytes": 20e9, "compiled_flops_per_chip": 197e12 * 0.01,
              "bytes_per_chip": 819e9 * 0.03, "analytic_flops_per_chip": 197e12 * 0.009}
    figures = compile_report._roofline(report, chip)
    assert not figures["fits"] and figures["overflow_bytes"] == pytest.approx(4e9)
    assert figures["bound"] == "memory"
    assert figures["roofline_seconds"] == pytest.approx(0.03)
    assert figures["roofline_mfu"] == pytest.approx(0.3)
    # MFU counts model FLOPs without the causal half of the attention matrix (a causal
    # kernel skips it), beside tfm.training.flops' full count.
    causal = {**report, "compiled_flops_per_chip": 197e12 * 0.05,
              "analytic_flops_per_chip": 197e12 * 0.08, "model_flops_per_chip": 197e12 * 0.045}
    figures = compile_report._roofline(causal, chip)
    assert figures["bound"] == "compute"
    assert figures["roofline_mfu"] == pytest.approx(0.9)
    assert figures["roofline_mfu_full_attention"] == pytest.approx(1.6)


def test_cpu_target_compiles_and_counts_like_the_formula(tmp_path):
    report = compile_report.compile_for(_config(tmp_path / "data"), tmp_path / "run", "cpu")
    assert report["platform"] == "cpu" and report["attention_backend"] == "cpu"
    assert report["params_bytes"] > 0 and report["optimizer_bytes"] >= 2 * report["params_bytes"]
    assert report["temp_bytes"] > 0 and "fits" not in report  # no CPU memory table
    decode = report["decode"]  # the LM generates: its decode loop compiled too
    assert decode["method"] == "greedy" and decode["temp_bytes"] > 0  # the config's method
    assert decode["params_bytes"] == report["params_bytes"]
    assert "decode loop (greedy, " in compile_report.format_report(report)
    if report.get("compiled_flops_per_chip"):
        ratio = report["compiled_flops_per_chip"] / report["analytic_flops_per_chip"]
        assert 0.5 < ratio < 2.0, ratio


@pytest.mark.parametrize("only, skipped", [("decode", "compile_report"),
                                           ("train", "decode_report")])
def test_one_part_alone_compiles_only_that_part(tmp_path, monkeypatch, only, skipped):
    """`compile --decode_only`: the decode loop's figures as the whole report has them;
    `--train_only`: the whole report's train-step figures, no "decode" entry. The other part
    is not compiled (it would raise here); both flags at once, one error."""
    config = _config(tmp_path / "data")
    whole = compile_report.compile_for(config, tmp_path / "run", "cpu")

    def not_this_part(*args, **kwargs):
        raise AssertionError(f"--{only}_only compiled {skipped}")

    monkeypatch.setattr(compile_report, skipped, not_this_part)
    path = tmp_path / f"{only}.json"
    text, failure = compile_report.run(config, tmp_path / "run", "cpu", str(path),
                                       **{f"{only}_only": True})
    report = json.loads(path.read_text())
    assert failure is None
    if only == "decode":
        assert set(report) == {"target", "chips", "platform", "decode"}
        assert report["decode"] == whole["decode"]
        assert "the decode loop alone" in text
        assert compile_report.format_decode(whole["decode"]) in text
    else:
        assert "decode" not in report and "decode loop" not in text
        for key in ("needed_bytes", "temp_bytes", "compiled_flops_per_chip", "bytes_per_chip"):
            assert report.get(key) == whole.get(key), key
    with pytest.raises(compile_report.ConfigError, match="--decode_only and --train_only"):
        compile_report.run(config, tmp_path / "run", "cpu", train_only=True, decode_only=True)


def test_flops_are_counted_under_the_targets_mesh(tmp_path, monkeypatch):
    """The FLOP count traces the model (jax.eval_shape); outside the target's mesh its
    attention backend saw this host's platform, and cuDNN refused h100-8 on a CPU host."""
    count, platforms = compile_report.flops.flops_per_token, []

    def recording(*args, **kwargs):
        mesh = jax.sharding.get_abstract_mesh()
        platforms.append(None if mesh.empty else mesh.abstract_device.platform)
        return count(*args, **kwargs)

    monkeypatch.setattr(compile_report.flops, "flops_per_token", recording)
    compile_report.train_report(_config(tmp_path / "data"), tmp_path / "run", "cpu")
    assert platforms == ["cpu"]


def test_remat_policy_override_reaches_the_report(tmp_path):
    """`./launch.sh compile CONFIG --target T --config.model.remat=NAME` (README "Memory")."""
    result = subprocess.run(
        ["./launch.sh", "compile", "configs/synthetic_lm.py:runlocal", "--target", "cpu",
         "--config.model.remat=dots_saveable", "--config.model.num_decoder_layers=1",
         f"--config.data.data_dir={tmp_path / 'data'}", "--workdir", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 0, result.stderr
    assert ("), attention_backend='cpu', loss_backend='reference', remat='dots_saveable', "
            in result.stdout)


def test_unknown_target_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="--target='v9-1' is unknown; choose one of: cpu, v4-8"):
        compile_report.target_devices("v9-1")
    result = subprocess.run(
        ["./launch.sh", "compile", "configs/synthetic_lm.py:runlocal", "--target", "v9-1",
         "--workdir", str(tmp_path / "run")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(
        "tfm.main compile: ConfigError: --target='v9-1' is unknown")


@pytest.mark.skipif(HAS_LIBTPU, reason="libtpu is installed")
def test_tpu_target_without_libtpu_names_the_extra():
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[tpu\]"'):
        compile_report.target_devices("v5e-4")


@pytest.mark.skipif(HAS_CUDA_PLUGIN, reason="the CUDA plugin is installed")
def test_gpu_target_without_the_plugin_names_the_extra():
    with pytest.raises(ConfigError, match=r'pip install -e "\.\[gpu\]"'):
        compile_report.target_devices("h100-8")


@pytest.mark.skipif(not HAS_CUDA_PLUGIN or not os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK"),
                    reason='needs pip install -e ".[gpu]" and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1')
def test_gpu_target_compiles_with_cudnn_and_reports_memory_only(tmp_path):
    config = _config(tmp_path / "data", d_model=64, num_heads=2, dtype="bfloat16")
    report = compile_report.compile_for(config, tmp_path / "run", "h100-8")
    assert report["chips"] == 8 and report["platform"] == "gpu"
    assert report["attention_backend"] == "cudnn" and report["fits"]
    assert "compiled_flops_per_chip" not in report  # XLA:GPU gives no cost analysis


@pytest.mark.skipif(not HAS_CUDA_PLUGIN or not os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK"),
                    reason='needs pip install -e ".[gpu]" and JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1')
@pytest.mark.parametrize("scheme", ["t5_bias", "alibi"])
def test_gpu_target_compiles_bias_schemes_with_the_triton_flex_kernel(tmp_path, scheme):
    """T5's and ALiBi's biases go to the flex kernel on GPU (Triton), train step and decode
    loop, with no [.., T, T] array."""
    config = _config(tmp_path / "data", d_model=64, num_heads=2, dtype="bfloat16",
                     position_scheme=scheme)
    config.data.update(seq_len=256, eval_seq_len=256)
    config.model.max_len = 256
    report = compile_report.compile_for(config, tmp_path / "run", "h100-8")
    assert report["attention_backend"] == "flex" and report["fits"] and report["decode"]["fits"]
    assert not report["score_arrays"]


@pytest.mark.skipif(not HAS_LIBTPU, reason='needs libtpu: pip install -e ".[tpu]"')
def test_tpu_target_reports_memory_flops_and_roofline(tmp_path):
    config = _config(tmp_path / "data")
    config.data.update(seq_len=256, eval_seq_len=256)  # rows of two splash blocks
    report = compile_report.compile_for(config, tmp_path / "run", "v5e-4")
    assert report["chips"] == 4 and report["platform"] == "tpu"
    assert report["attention_backend"] == "splash"  # no CPU kernels for a TPU mesh
    short = compile_report.compile_for(_config(tmp_path / "data"), tmp_path / "short", "v5e-4")
    assert short["attention_backend"] == "reference"  # 64-token rows: one block, no kernel
    assert report["fits"] and report["roofline_seconds"] > 0
    assert 0 < report["roofline_mfu"] <= 1
    ratio = report["compiled_flops_per_chip"] / report["analytic_flops_per_chip"]
    assert 0.5 < ratio < 2.0, ratio


@pytest.mark.parametrize("target", [
    "cpu", pytest.param("v5e-4", marks=pytest.mark.skipif(
        not HAS_LIBTPU, reason='needs libtpu: pip install -e ".[tpu]"'))])
def test_breakdown_sums_to_the_compilers_bytes_and_names_the_model_parts(tmp_path, target):
    """--breakdown: the instructions' bytes add up to XLA's total within a few percent, and
    the attention, FFN and optimizer each own some of them. On TPU the sum is checked on
    GPT-2 small (docs/performance.md: 98.5% of XLA's total with data=8, 95.2% with fsdp=8);
    a model this small is mostly tile padding and tiny operations, which XLA's TPU cost
    analysis counts by rules of its own (the sum there is 30-40% of its total)."""
    report = compile_report.compile_for(_config(tmp_path / "data"), tmp_path / "run", target,
                                        breakdown=True)
    breakdown = report["breakdown"]
    if target == "cpu":
        assert breakdown["total_bytes"] == pytest.approx(report["bytes_per_chip"], rel=0.05)
    else:
        assert 0 < breakdown["total_bytes"] <= report["bytes_per_chip"]
    for group in ("attention", "ffn", "optimizer", "embedding/loss"):
        assert breakdown["groups"][group]["bytes"] > 0, (group, breakdown["groups"])
    assert breakdown["groups"]["ffn"]["flops"] > 0
    assert "where the bytes go:" in compile_report.format_report(report)


@pytest.mark.skipif(not HAS_LIBTPU, reason='needs libtpu: pip install -e ".[tpu]"')
def test_a_step_that_does_not_fit_is_one_line(tmp_path):
    """A 3B-parameter model on a 16 GB v5e: the compiler refuses it, or the report says it does
    not fit; either way one line naming the target (launch.sh prints it and exits 1)."""
    config = _config(tmp_path / "data", d_model=8192, d_ff=32768, num_heads=64,
                     num_decoder_layers=4)
    text, failure = compile_report.run(config, tmp_path / "run", "v5e-4")
    assert failure is not None and "\n" not in failure, (text, failure)
    assert failure.startswith("--target=v5e-4 does not fit")



# Mosaic's verdict on a kernel whose tiles exceed VMEM, as libtpu 0.0.42.1 words it (shortened).
VMEM_OOM = """RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:
Ran out of memory in memory space vmem while allocating on stack for %tfm_cross_entropy_statist\
ics.1 = (f32[8192,1]{1,0:T(8,128)S(1)}) custom-call(%bitcast.24), custom_call_target="tpu_custom\
_call", metadata={op_name="jit(loss)/jvp()/shard_map/tfm_cross_entropy_statistics/pallas_call" \
stack_frame_id=37}. Scoped allocation with size 66.00M and limit 64.00M exceeded scoped vmem lim\
it by 2.00M. It should not be possible to run out of scoped vmem -
See https://openxla.org/xla/errors/error_1001 for more details."""


# The same from XLA (v5p, d_model 1,600: the register allocator's spills), shortened.
VMEM_FULL = ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory "
             "space vmem. Used 65.86M of 63.94M vmem. Exceeded vmem capacity by 1.92M.\n\n"
             "  1. Size: 16.33M\n     XLA label: register allocator spill slots in HLO :: "
             "transpose_jvp_tfm_cross_entropy_table_grad__.1\n  2. Size: 13.00M\n     "
             'Operator: op_name="jit(loss)/transpose(jvp(tfm_cross_entropy_table_grad))/'
             'pallas_call"\n     Shape: f32[2048,1600]{1,0:T(8,128)}')


def test_out_of_memory_is_one_line_naming_the_kernel_whose_tiles_do_not_fit():
    """HBM: the compiler's line as it is; VMEM (whose first line names nothing): which Pallas
    kernel, also inside jvp(...) and transpose(...), how much it asked and, for the fused
    loss, the way round it; any other error: None (raised by the caller)."""
    instead = "; --config.model.loss_backend=reference computes the loss without it"
    line = compile_report.out_of_memory_line(RuntimeError(VMEM_OOM))
    assert line == ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: the Pallas kernel "
                    "tfm_cross_entropy_statistics needs 66.00M of on-chip memory (VMEM) where "
                    "64.00M is allowed: its tiles are too large for this chip" + instead)
    line = compile_report.out_of_memory_line(RuntimeError(VMEM_FULL))
    assert line == (VMEM_FULL.splitlines()[0] + " the Pallas kernel "
                    "tfm_cross_entropy_table_grad needs 65.86M of on-chip memory (VMEM) where "
                    "63.94M is allowed: its tiles are too large for this chip" + instead)
    flex = VMEM_OOM.replace("tfm_cross_entropy_statistics", "flex_forward")
    assert compile_report.out_of_memory_line(RuntimeError(flex)).endswith(
        "the Pallas kernel flex_forward needs 66.00M of on-chip memory (VMEM) where 64.00M is "
        "allowed: its tiles are too large for this chip")
    hbm = "XlaRuntimeError: RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm.\nmore"
    assert compile_report.out_of_memory_line(RuntimeError(hbm)) == hbm.splitlines()[0]
    assert compile_report.out_of_memory_line(ValueError("shapes differ")) is None

SCHEMES = ("none", "sinusoidal", "learned", "rope", "relative", "t5_bias", "alibi")


@pytest.mark.skipif(not HAS_LIBTPU, reason='needs libtpu: pip install -e ".[tpu]"')
@pytest.mark.parametrize("mode", ["lm", "seq2seq"])
def test_every_position_scheme_compiles_for_tpu_on_a_data_fsdp_mesh(tmp_path, mode):
    """Each scheme's train step and decode loop compile for a v5e 2x2 slice with data x fsdp
    sharding; where
    a fused kernel serves the scheme (splash; flex for ALiBi and T5's biases), the compiled step
    holds no [.., T, T] array."""
    length = 256
    for scheme in SCHEMES:
        source = synthetic_lm if mode == "lm" else synthetic_seq2seq
        config = source.get_config("runlocal")
        config.model.update(d_model=64, num_heads=2, d_ff=128, position_scheme=scheme,
                            relative_values=False, max_len=length, dtype="bfloat16")
        config.data.update(data_dir=str(tmp_path / "data" / mode), batch_size=8,
                           seq_len=length, num_train_examples=16, num_eval_examples=8)
        config.mesh.update(data=2, fsdp=2)
        # conftest asks for float32 matmul precision everywhere; Mosaic refuses it on bf16
        # operands (splash), as it would in a user's process that set it.
        with jax.default_matmul_precision("default"):
            report = compile_report.compile_for(config, tmp_path / scheme, "v5e-4")
        assert report["fits"] and report["decode"]["fits"], scheme  # train step, decode loop
        backend = {"relative": "reference", "t5_bias": "flex", "alibi": "flex"}.get(
            scheme, "splash")
        assert report["attention_backend"] == backend, scheme
        assert bool(report["score_arrays"]) == (backend == "reference"), (
            scheme, report["score_arrays"])


@pytest.mark.skipif(not HAS_LIBTPU, reason='needs libtpu: pip install -e ".[tpu]"')
@pytest.mark.parametrize("scheme", ["t5_bias", "alibi"])
def test_at_8192_tokens_flex_needs_less_than_one_score_matrix(tmp_path, scheme):
    """A bias scheme at 8,192 tokens on v5e: with flex attention the step's temporaries stay
    below the size of one [batch, heads, T, T] float32 buffer, which the reference needs many
    of (so the check can fail: the reference's temporaries exceed it)."""
    length, heads = 8192, 4
    config = synthetic_lm.get_config("runlocal")
    config.model.update(d_model=128, num_heads=heads, d_ff=256, num_decoder_layers=2,
                        position_scheme=scheme, max_len=length, dtype="bfloat16")
    config.data.update(data_dir=str(tmp_path / "data"), batch_size=4, seq_len=length,
                       eval_seq_len=length, num_train_examples=8, num_eval_examples=4)
    one_score_matrix = 1 * heads * length * length * 4  # one row per chip: 1.07 GB
    config.model.attention_backend = "flex"
    with jax.default_matmul_precision("default"):
        report = compile_report.compile_for(config, tmp_path / "flex", "v5e-4")
    assert report["temp_bytes"] < one_score_matrix, report["temp_bytes"]
    assert not report["score_arrays"]
    config.model.attention_backend = "reference"
    with jax.default_matmul_precision("default"):
        text, failure = compile_report.run(config, tmp_path / "reference", "v5e-4")
    if failure is None:  # fits the chip (ALiBi's fixed bias): read its temporaries
        reference_temporaries = float(re.search(r"temporaries ([0-9.]+) GB", text).group(1))
        assert reference_temporaries * 1e9 > one_score_matrix, text
    else:  # does not fit (T5's bias and its gradient): the compiler says how much it wanted
        temporaries = re.search(r"temporaries \(([0-9.]+)G\)", failure)
        assert temporaries and float(temporaries.group(1)) * 2**30 > one_score_matrix, failure


@pytest.mark.skipif(not HAS_LIBTPU, reason='needs libtpu: pip install -e ".[tpu]"')
def test_largest_batch_search_compiles_both_sides_of_the_answer(tmp_path, monkeypatch):
    """--largest_batch with real compiles for v5e-4, on a chip made small enough that a tiny
    model fills it at a few dozen rows: the batch reported fits, the multiple above does not,
    both as compiled (not as the line guessed)."""
    import dataclasses

    config = _config(tmp_path / "data")
    config.data.num_train_examples = 1024
    needed = {rows: compile_report.train_report(_with_batch(config, rows), tmp_path / "run",
                                                "v5e-4")["needed_bytes"] for rows in (8, 16)}
    capacity = needed[8] + 5.5 * (needed[16] - needed[8])
    small_v5e = dataclasses.replace(CHIPS["TPU v5e"], hbm_bytes=capacity)
    monkeypatch.setitem(CHIPS, "TPU v5e", small_v5e)
    result = compile_report.largest_batch(config, tmp_path / "run", "v5e-4")
    largest, above = result["largest"], result["smallest_not"]
    assert above == largest + 4, result["tried"]
    assert result["tried"][largest] <= capacity < (result["tried"][above] or float("inf"))
    assert result["report"]["needed_bytes"] == result["tried"][largest]
    assert 16 < largest < 200  # the capacity was set between those


def _with_batch(config, rows):
    trial = config.copy_and_resolve_references()
    trial.data.batch_size = rows
    return trial
