"""Profiling a run (tfm/training/profiling.py): the jax.profiler trace of train.profile_start ..
profile_start + profile_steps - 1 under WORKDIR/profile/, stopped however the run ends, and the
compiled train step's memory line, logged once without compiling the step a second time."""

from __future__ import annotations

import contextlib
import gzip
import json
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_collections
import pytest

from configs import synthetic_lm
from tfm.checks import ConfigError
from tfm.training import profiling, train
from tfm.training.experiment import parse_config, setup, state_shardings


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


def tiny_lm_config(data_dir: Path, num_steps: int, **train_overrides):
    """A decoder-only model small enough that a run takes seconds."""
    config = synthetic_lm.get_config("runlocal")
    config.model.update(d_model=32, num_heads=2, d_ff=64, num_decoder_layers=1)
    config.data.update(data_dir=str(data_dir), batch_size=8, num_train_examples=64,
                       num_eval_examples=8)
    config.optimizer.update(total_steps=num_steps, warmup_steps=1)
    config.train.update(num_steps=num_steps, log_every=num_steps, eval_every=0,
                        checkpoint_every=num_steps, progress_bar=False, **train_overrides)
    config.eval.update(max_batches=1, max_generation_examples=2)
    return config


def traced_steps(workdir: Path) -> list[int]:
    """The step numbers of the "train" step annotations in WORKDIR/profile's Perfetto traces."""
    steps = []
    for path in sorted((workdir / "profile").rglob("*.trace.json.gz")):
        events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
        steps += [int(e["args"]["step_num"]) for e in events if e.get("name") == "train"]
    return sorted(steps)


@contextlib.contextmanager
def train_step_compilations() -> Iterator[list[str]]:
    """The XLA compilations (or persistent-cache loads) of functions named train_step."""
    names: list[str] = []

    def listener(event: str, duration: float, fun_name: str = "", **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and "train_step" in fun_name:
            names.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def test_trace_holds_the_chosen_steps_and_memory_is_logged_once(data_dir, tmp_path, capsys):
    config = tiny_lm_config(data_dir, num_steps=6, profile_start=2, profile_steps=2)
    with train_step_compilations() as compiled:
        train.train_and_evaluate(config, tmp_path)
    assert len(compiled) == 1, compiled  # the memory analysis reused the step's compile
    planes = list((tmp_path / "profile").rglob("*.xplane.pb"))
    assert len(planes) == 1 and planes[0].stat().st_size > 0
    assert traced_steps(tmp_path) == [2, 3]

    lines = [ln for ln in capsys.readouterr().out.splitlines() if "train step memory" in ln]
    assert len(lines) == 1, lines
    abstract, _ = state_shardings(setup(config, tmp_path / "again"))
    params = profiling.format_bytes(profiling.bytes_per_device(abstract.params))
    optimizer = profiling.format_bytes(profiling.bytes_per_device(abstract.opt_state))
    assert f"parameters {params}, optimizer state {optimizer}, temporaries " in lines[0]
    assert "device memory" not in lines[0]  # a CPU keeps no allocator statistics


def test_trace_is_closed_when_training_fails_inside_its_window(
    data_dir, tmp_path, monkeypatch
):
    config = tiny_lm_config(data_dir, num_steps=6, profile_start=1, profile_steps=4)
    original, calls = train.sharding.shard_batch, [0]

    def shard_batch(host_batch, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:  # step 2, inside the window
            raise RuntimeError("input pipeline broke")
        return original(host_batch, *args, **kwargs)

    monkeypatch.setattr(train.sharding, "shard_batch", shard_batch)
    with pytest.raises(RuntimeError, match="input pipeline broke"):
        train.train_and_evaluate(config, tmp_path)
    assert traced_steps(tmp_path) == [1, 2]  # step 2's annotation closed by the error
    jax.profiler.start_trace(str(tmp_path / "next"))  # no trace is left running
    jax.profiler.stop_trace()


def test_trace_window_past_the_last_step_and_a_resume_inside_it(tmp_path):
    """A run that ends inside the window closes the trace; one resumed inside traces the rest."""
    double = jax.jit(lambda x: 2 * x)
    x = jnp.ones(4)

    def run(steps: range, directory: Path) -> None:
        trace = profiling.StepTrace(directory / "profile", start=2, num_steps=3)
        try:
            for step in steps:
                with trace.annotate(step):
                    out = double(x)
                trace.step_done(step, out)
        finally:
            trace.stop()

    run(range(0, 3), tmp_path / "ends_early")  # steps 0-2: the trace holds step 2 only
    run(range(3, 8), tmp_path / "resumed")  # resumed at 3: steps 3 and 4
    run(range(5, 7), tmp_path / "resumed_past")  # past the window: no trace
    assert traced_steps(tmp_path / "ends_early") == [2]
    assert traced_steps(tmp_path / "resumed") == [3, 4]
    assert not (tmp_path / "resumed_past" / "profile").exists()


def test_memory_line_with_device_statistics():
    figures = dict(params_bytes=1_500_000, optimizer_bytes=3_000_000, temp_bytes=2_500,
                   needed_bytes=4_502_500)
    device = dict(bytes_in_use=6_000_000_000, peak_bytes_in_use=7_100_000_000,
                  bytes_limit=80_000_000_000)
    assert profiling.memory_line(figures, device) == (
        "train step memory per device (compiled): parameters 1.50 MB, optimizer state 3.00 MB, "
        "temporaries 2.50 kB; needs 4.50 MB; device memory in use 6.00 GB of 80.00 GB "
        "(peak 7.10 GB)")
    assert profiling.memory_line(figures, None).endswith("needs 4.50 MB")


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("profile_start", -1, "must be an integer >= 0 (or None: no trace)"),
        ("profile_start", 2.5, "must be an integer >= 0"),
        ("profile_start", "10", "must be an integer >= 0"),
        ("profile_steps", 0, "must be an integer >= 1"),
        ("profile_steps", True, "must be an integer >= 1"),
    ],
)
def test_bad_profile_values_name_the_field(data_dir, field, value, allowed):
    values = tiny_lm_config(data_dir, num_steps=2).to_dict()
    values["train"][field] = value  # past ml_collections' type check, as a config file could
    with pytest.raises(ConfigError) as error:
        parse_config(ml_collections.ConfigDict(values))
    message = str(error.value)
    assert message.startswith(f"train.{field}={value!r} {allowed}") and "\n" not in message
