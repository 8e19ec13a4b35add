import json

import grain
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.training.checkpoint import (
    Checkpointer,
    CheckpointError,
    average_checkpoints,
    no_readable_step_error,
    write_averaged_checkpoint,
)

CONFIG = json.dumps({"model": {"d_model": 16, "num_heads": 2, "norm": {"eps": 1e-6}},
                     "optimizer": {"learning_rate": 1.0}})


def _state(seed: float) -> dict:
    rng = np.random.default_rng(int(seed))
    return {
        "params": {"w": jnp.asarray(rng.normal(size=(3, 4)), jnp.float32),
                   "b": jnp.asarray(rng.normal(size=(4,)), jnp.bfloat16)},
        "step": jnp.asarray(int(seed), jnp.int32),
    }


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                        state)


def _assert_bitwise(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    assert jax.tree.map(lambda x: x.dtype, a) == jax.tree.map(lambda x: x.dtype, b)


def test_round_trip_is_bitwise(tmp_path):
    state = _state(7)
    with Checkpointer(tmp_path / "ckpt", max_to_keep=2) as checkpointer:
        assert checkpointer.save(7, state, config_json=CONFIG)
        checkpointer.wait()
        assert checkpointer.latest_step() == 7
        assert not checkpointer.save(7, _state(8), config_json=CONFIG)  # never overwrites
    with Checkpointer(tmp_path / "ckpt", max_to_keep=2) as checkpointer:  # a fresh process
        restored = checkpointer.restore(abstract_state=_abstract(state), config_json=CONFIG)
        assert checkpointer.saved_config() == json.loads(CONFIG)
    _assert_bitwise(restored, state)
    assert restored["params"]["w"].sharding == state["params"]["w"].sharding


def test_keeps_last_k_plus_best(tmp_path):
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 3.0, 5: 6.0, 6: 7.0}
    directory = tmp_path / "ckpt"
    with Checkpointer(directory, max_to_keep=2, keep_best_metric="loss") as checkpointer:
        for step in (1, 2, 3, 4):
            checkpointer.save(step, _state(step), config_json=CONFIG,
                              metrics={"loss": losses[step]})
        checkpointer.wait()
        assert checkpointer.all_steps() == [2, 3, 4]  # latest two + the best (loss 1.0)
        assert checkpointer.best_step() == 2
    with Checkpointer(directory, max_to_keep=2, keep_best_metric="loss") as checkpointer:
        for step in (5, 6):  # after a restart the metrics of old steps are still known
            checkpointer.save(step, _state(step), config_json=CONFIG,
                              metrics={"loss": losses[step]})
        checkpointer.wait()
        assert checkpointer.all_steps() == [2, 5, 6]
    assert sorted(p.name for p in directory.iterdir() if p.name.isdigit()) == ["2", "5", "6"]
    with Checkpointer(tmp_path / "max", max_to_keep=1, keep_best_metric="acc",
                      best_mode="max") as checkpointer:
        for step, acc in ((1, 0.2), (2, 0.9), (3, 0.5), (4, 0.4)):
            checkpointer.save(step, _state(step), config_json=CONFIG, metrics={"acc": acc})
        checkpointer.wait()
        assert checkpointer.all_steps() == [2, 4]


def test_save_interval_and_force(tmp_path):
    with Checkpointer(tmp_path, max_to_keep=None, save_interval_steps=10,
                      async_save=False) as checkpointer:
        saved = [s for s in (1, 5, 10, 15, 20) if checkpointer.save(s, _state(s),
                                                                   config_json=CONFIG)]
        assert checkpointer.save(23, _state(23), config_json=CONFIG, force=True)
        assert saved == [1, 10, 20]  # the first save of an empty directory always happens
        assert checkpointer.all_steps() == [1, 10, 20, 23]


def test_model_config_mismatch_names_fields(tmp_path):
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        checkpointer.save(1, _state(1), config_json=CONFIG)
        changed = json.loads(CONFIG)
        changed["model"]["d_model"] = 32
        changed["model"]["norm"]["eps"] = 1e-5
        changed["model"]["rope_base"] = 10.0
        changed["optimizer"]["learning_rate"] = 2.0  # not a model field: allowed
        with pytest.raises(ValueError) as info:
            checkpointer.restore(config_json=json.dumps(changed))
        message = str(info.value)
        assert str(tmp_path / "ckpt" / "1") in message
        assert "model.d_model: saved 16, current 32" in message
        assert "model.norm.eps: saved 1e-06, current 1e-05" in message
        # A field the checkpoint predates counts as its default (ModelConfig's 10000.0).
        assert "model.rope_base: saved 10000.0, current 10.0" in message
        assert "learning_rate" not in message
        del changed["model"]
        changed["model"] = json.loads(CONFIG)["model"]
        checkpointer.restore(config_json=json.dumps(changed))  # optimizer change only: fine
        changed["model"]["embedding_init_stddev"] = None  # a newer field, at its default: fine
        checkpointer.restore(config_json=json.dumps(changed))
        # Implementation choices (resolved per platform: a TPU run's fused loss, restored on a
        # CPU) may change.
        changed["model"].update(loss_backend="fused", attention_backend="cpu", remat="full")
        checkpointer.restore(config_json=json.dumps(changed))


# A failed tensorstore read leaves an orbax callback that fires on a closed event loop.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_or_missing_checkpoint_messages(tmp_path):
    directory = tmp_path / "ckpt"
    with Checkpointer(directory) as checkpointer:
        with pytest.raises(FileNotFoundError, match=str(directory)):
            checkpointer.restore()
        checkpointer.save(1, _state(1), config_json=CONFIG)
        checkpointer.save(2, _state(2), config_json=CONFIG)
        checkpointer.wait()
        with pytest.raises(FileNotFoundError, match=r"available steps: \[1, 2\]"):
            checkpointer.restore(3)
    (directory / "2" / "state" / "manifest.ocdbt").unlink()
    with Checkpointer(directory) as checkpointer:
        with pytest.raises(CheckpointError) as info:
            checkpointer.restore(abstract_state=_abstract(_state(2)))
        assert str(directory / "2") in str(info.value) and "[1]" in str(info.value)
        _assert_bitwise(checkpointer.restore(1, abstract_state=_abstract(_state(1))), _state(1))


def test_averaging_equals_numpy_mean(tmp_path):
    directory, output = tmp_path / "ckpt", tmp_path / "avg"
    states = {step: _state(step) for step in (1, 2, 3, 4)}
    with Checkpointer(directory, max_to_keep=None) as checkpointer:
        for step, state in states.items():
            checkpointer.save(step, state, config_json=CONFIG)
    averaged, steps = average_checkpoints(directory, _abstract(states[1]), last_k=3)
    assert steps == [2, 3, 4]
    expected_w = np.mean([np.asarray(states[s]["params"]["w"]) for s in steps], axis=0)
    np.testing.assert_allclose(np.asarray(averaged["params"]["w"]), expected_w, rtol=1e-6)
    expected_b = np.mean([np.asarray(states[s]["params"]["b"], np.float32) for s in steps], 0)
    assert averaged["params"]["b"].dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(averaged["params"]["b"], np.float32), expected_b,
                               rtol=1e-2)
    assert int(averaged["step"]) == 4  # integers come from the newest step
    chosen, _ = average_checkpoints(directory, steps=[1, 3])
    np.testing.assert_allclose(
        np.asarray(chosen["params"]["w"]),
        (np.asarray(states[1]["params"]["w"]) + np.asarray(states[3]["params"]["w"])) / 2,
        rtol=1e-6)
    with pytest.raises(FileNotFoundError, match="9"):
        average_checkpoints(directory, steps=[1, 9])

    assert write_averaged_checkpoint(directory, output, _abstract(states[1]), last_k=3) == 4
    with Checkpointer(output) as checkpointer:
        _assert_bitwise(checkpointer.restore(abstract_state=_abstract(states[1]),
                                             config_json=CONFIG), averaged)
        assert checkpointer.saved_config()["averaged_steps"] == [2, 3, 4]


def test_grain_iterator_round_trip(tmp_path):
    dataset = grain.MapDataset.range(100).seed(3).shuffle().batch(2).to_iter_dataset()
    iterator = iter(dataset)
    for _ in range(5):
        next(iterator)
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        checkpointer.save(5, _state(5), data_state=iterator, config_json=CONFIG)
        expected = [next(iterator) for _ in range(4)]  # advancing during the async save is fine
        checkpointer.wait()
    fresh = iter(dataset)
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        checkpointer.restore(data_iterator=fresh)
    for want in expected:
        np.testing.assert_array_equal(next(fresh), want)
    assert not np.array_equal(expected[0], next(iter(dataset)))  # not just the start again


def test_unevaluated_save_with_keep_best_metric_logs_no_warning(tmp_path, caplog):
    """orbax warned "Requested `tracked_metric`; did not provide metrics." for every save of an
    unevaluated step (intended: only evaluated steps compete for the best)."""
    with caplog.at_level("INFO"):
        with Checkpointer(tmp_path / "ckpt", keep_best_metric="loss") as checkpointer:
            checkpointer.save(1, _state(1), config_json=CONFIG, force=True)
            checkpointer.wait()
    assert checkpointer.all_steps() == [1]
    assert not [r for r in caplog.records if "tracked_metric" in r.getMessage()]


def test_set_aside_moves_a_step_out_and_never_overwrites(tmp_path):
    with Checkpointer(tmp_path / "ckpt", max_to_keep=None) as checkpointer:
        for round_ in range(2):
            checkpointer.save(3, _state(3 + round_), config_json=CONFIG, force=True)
            checkpointer.wait()
            assert checkpointer.set_aside(3) == tmp_path / "ckpt_corrupt" / ("3", "3.1")[round_]
            assert checkpointer.all_steps() == []
    assert sorted(p.name for p in (tmp_path / "ckpt_corrupt").iterdir()) == ["3", "3.1"]


def test_a_failed_restore_silences_only_the_closed_event_loop_reports(tmp_path):
    """After a failed read, tensorstore's late callbacks each printed a traceback ("Event loop is
    closed") on the console; those are dropped, any other unraisable error still reaches the
    previous hook."""
    import sys
    import types

    directory = tmp_path / "ckpt"
    with Checkpointer(directory) as checkpointer:
        checkpointer.save(1, _state(1), config_json=CONFIG)
        checkpointer.wait()
    (directory / "1" / "state" / "manifest.ocdbt").unlink()
    reported = []
    previous = sys.unraisablehook
    sys.unraisablehook = reported.append
    try:
        with Checkpointer(directory) as checkpointer, pytest.raises(CheckpointError):
            checkpointer.restore(abstract_state=_abstract(_state(1)))
        for error in (RuntimeError("Event loop is closed"), RuntimeError("other")):
            sys.unraisablehook(types.SimpleNamespace(exc_value=error))
    finally:
        sys.unraisablehook = previous
    assert [str(u.exc_value) for u in reported if isinstance(u, types.SimpleNamespace)] == [
        "other"]


def test_asyncio_reports_of_abandoned_orbax_reads_are_dropped_and_no_others():
    """asyncio's "Future exception was never retrieved" for a failed orbax read is dropped in
    both forms seen (tensorstore's spec; a truncated file's OCDBT read error), other records of
    the asyncio logger are kept."""
    import logging

    from tfm.training.checkpoint import _drop_abandoned_orbax_futures

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("asyncio", logging.ERROR, __file__, 1, message, None, None)

    never = "Future exception was never retrieved\nfuture: <Future finished exception="
    dropped = [never + "ValueError('... TensorStore spec ...')>",
               never + "ValueError('OUT_OF_RANGE: Error reading \"params.x/0.0.0\" in OCDBT "
                       "database at local file \"/run/checkpoints/4/state/\"')>"]
    kept = [never + "ValueError('a bug of the user')>", "Task was destroyed but it is pending!"]
    assert [_drop_abandoned_orbax_futures(record(m)) for m in dropped + kept] == [
        False, False, True, True]


def test_abandoned_orbax_reads_are_not_reported(tmp_path, monkeypatch):
    """A failed restore leaves orbax's other reads suspended; when collected, each one's
    `except BaseException` turned close()'s GeneratorExit into an Exception carrying
    tensorstore's whole spec: "Exception ignored in: <coroutine object
    _read_array_index_and_device_put>", ~65 lines apiece, ~1,300 for a truncated file. Those
    are dropped from the first restore on; other unraisable errors still reach the previous hook.
    The coroutine here is orbax's own, suspended in its read."""
    import gc
    import sys
    import types

    import tensorstore as ts
    from orbax.checkpoint._src.serialization import limits, serialization

    class Pending:
        def __await__(self):
            yield

    async def read_that_never_ends(**kwargs):
        await Pending()

    monkeypatch.setattr(serialization, "_read_shard", read_that_never_ends)
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        checkpointer.save(1, _state(1), config_json=CONFIG)
        checkpointer.wait()
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    with Checkpointer(tmp_path / "ckpt") as checkpointer:
        checkpointer.saved_config(1)  # any restore installs the filter
    read = serialization._read_array_index_and_device_put(
        [jax.devices()[0]], (slice(0, 4, 1),), ts.array(np.zeros(4, np.float32)),
        global_shape=(4,), new_shard_shape=(4,), dtype=np.float32,
        byte_limiter=limits.get_byte_limiter(None), strict=True, dll=None, memory_kind=None)
    read.send(None)  # suspended inside the read, as when a sibling read fails
    del read
    gc.collect()
    sys.unraisablehook(types.SimpleNamespace(exc_value=RuntimeError("other"), object=None))
    assert [str(u.exc_value) for u in reported] == ["other"]


def test_no_readable_step_error_lists_each_step_and_what_to_do(tmp_path):
    """Every step unreadable: one error naming each step tried with its reason in one line (not
    tensorstore's spec), none of them offered as available, and what to do."""
    directory = tmp_path / "run" / "checkpoints"
    # Larger than what ocdbt stores inline in its index, and incompressible.
    state = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(64, 256)), jnp.float32)}
    with Checkpointer(directory) as checkpointer:
        for step in (1, 2):
            checkpointer.save(step, state, config_json=CONFIG)
        checkpointer.wait()
    for path in directory.glob("*/state/ocdbt.process_0/d/*"):
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    failures = []
    with Checkpointer(directory) as checkpointer:
        for step in (2, 1):
            with pytest.raises(CheckpointError) as info:
                checkpointer.restore(step, abstract_state=_abstract(state))
            failures.append(info.value)
    assert [(error.step, error.reason.split(":")[0]) for error in failures] == [
        (2, "ValueError"), (1, "ValueError")]
    message = str(no_readable_step_error(directory, failures))
    assert "\n" not in message and "TensorStore" not in message, message
    assert message.startswith(
        f"no checkpoint in {directory} could be read (corrupt or incomplete?); tried step 2 "
        "(ValueError: OUT_OF_RANGE: Error reading")
    assert "; step 1 (ValueError: OUT_OF_RANGE: Error reading" in message
    assert "OCDBT database at local file" not in message  # the step's folder, given once
    assert message.endswith(
        f"Nothing was moved or deleted. To start over, train with another --workdir (or move "
        f"{tmp_path / 'run'} aside), or move these step folders elsewhere: {directory / '2'}, "
        f"{directory / '1'}")
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]  # nothing moved


def test_a_tuple_field_compares_as_config_json_holds_it():
    """A run saved before a tuple-valued model field existed (rope_long_factor) resumes: the
    field's default () equals the [] config.json writes; a real change is still reported."""
    from tfm.training.checkpoint import model_differences

    before = {"model": {"d_model": 4}}
    assert model_differences(before, {"model": {"d_model": 4, "rope_long_factor": []}}) == []
    assert model_differences({"model": {"rope_long_factor": [1.0]}},
                             {"model": {"rope_long_factor": (1.0,)}}) == []
    assert model_differences({"model": {"rope_long_factor": [1.0]}},
                             {"model": {"rope_long_factor": (2.0,)}}) == [
        "model.rope_long_factor: saved [1.0], current [2.0]"]


def test_evaluation_may_change_how_positions_are_scaled_and_training_may_not():
    from tfm.training.checkpoint import EVAL_TIME, model_differences

    saved = {"model": {"d_model": 4, "rope_scaling": "none"}}
    current = {"model": {"d_model": 4, "rope_scaling": "yarn", "rope_scaling_factor": 4.0,
                         "attention_log_length": 256}}
    assert model_differences(saved, current, EVAL_TIME) == []
    assert model_differences(saved, current) == [
        "model.attention_log_length: saved 0, current 256",
        "model.rope_scaling: saved 'none', current 'yarn'",
        "model.rope_scaling_factor: saved 1.0, current 4.0"]
    assert model_differences(saved, {"model": {"d_model": 8}}, EVAL_TIME) == [
        "model.d_model: saved 4, current 8"]
