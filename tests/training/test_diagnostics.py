"""tfm.training.diagnostics: attention entropy and distance against a naive numpy loop, their
closed forms, per-layer norms against numpy, the names a tiny training run logs (and its losses,
unchanged by diagnostics), the report's plots and the config check."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import synthetic_lm
from tfm.checks import ConfigError
from tfm.nn.config import ModelConfig
from tfm.nn.models import EncoderDecoder, stack_layer_params
from tfm.sweeps import report, sweep
from tfm.training import diagnostics, metrics, train
from tfm.training.config import TrainConfig


def random_weights(rng, batch, heads, q_len, kv_len):
    """Softmax rows with some keys masked to exactly 0: [batch, heads, q_len, kv_len]."""
    logits = rng.normal(size=(batch, heads, q_len, kv_len))
    logits[..., -2:] = -np.inf
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)).astype(np.float32)


def naive_stats(weights, query_positions, key_positions, valid):
    """(entropy, distance) per head by loops over every real query."""
    batch, heads, q_len, kv_len = weights.shape
    entropy, distance = np.zeros(heads), np.zeros(heads)
    for h in range(heads):
        ents, dists = [], []
        for b in range(batch):
            for i in range(q_len):
                if not valid[b, i]:
                    continue
                p = weights[b, h, i]
                ents.append(-sum(x * math.log(x) for x in p if x > 0))
                dists.append(sum(p[k] * abs(query_positions[b, i] - key_positions[b, k])
                                 for k in range(kv_len)))
        entropy[h], distance[h] = np.mean(ents), np.mean(dists)
    return entropy, distance


def test_entropy_and_distance_match_a_naive_loop_with_padding():
    rng = np.random.default_rng(0)
    weights = random_weights(rng, batch=3, heads=4, q_len=5, kv_len=7)
    query_positions = rng.integers(0, 10, size=(3, 5))
    key_positions = rng.integers(0, 10, size=(3, 7))
    valid = np.ones((3, 5), bool)
    valid[0, 3:] = False  # padded queries, whatever their weights, do not count
    valid[2, 1] = False
    weights[0, :, 3:] = 1e3  # garbage in padded rows
    expected_entropy, expected_distance = naive_stats(
        weights, query_positions, key_positions, valid)
    np.testing.assert_allclose(
        diagnostics.attention_entropy(weights, valid), expected_entropy, rtol=1e-5)
    np.testing.assert_allclose(
        diagnostics.attention_distance(weights, query_positions, key_positions, valid),
        expected_distance, rtol=1e-5)


@pytest.mark.parametrize("num_keys", [1, 3, 8])
def test_uniform_attention_over_n_keys_has_entropy_log_n(num_keys):
    weights = np.zeros((2, 3, 4, 10), np.float32)
    weights[..., :num_keys] = 1.0 / num_keys
    entropy = diagnostics.attention_entropy(weights, np.ones((2, 4), bool))
    np.testing.assert_allclose(entropy, np.full(3, math.log(num_keys)), atol=1e-6)


def test_one_hot_attention_on_key_j_has_distance_abs_i_minus_j():
    q_len = kv_len = 6
    positions = np.arange(q_len)[None]
    for j in range(kv_len):
        weights = np.zeros((1, 2, q_len, kv_len), np.float32)
        weights[..., j] = 1.0
        for i in range(q_len):  # one real query at a time
            valid = np.arange(q_len)[None] == i
            distance = diagnostics.attention_distance(weights, positions, positions, valid)
            np.testing.assert_allclose(distance, [abs(i - j)] * 2)
        entropy = diagnostics.attention_entropy(weights, np.ones((1, q_len), bool))
        np.testing.assert_array_equal(entropy, [0.0, 0.0])


def tiny_seq2seq():
    config = ModelConfig(vocab_size=16, d_model=16, num_heads=2, d_ff=32, num_encoder_layers=2,
                         num_decoder_layers=3, position_scheme="alibi",
                         attention_backend="reference")
    model = EncoderDecoder(config)
    source, target = jnp.array([[3, 4, 5, 6, 2]]), jnp.array([[1, 7, 8]])
    params = jax.jit(model.init)(jax.random.PRNGKey(0), source, target)["params"]
    return config, model, params, source, target


def test_layer_norms_are_numpy_norms_of_each_layer_unrolled_or_scanned():
    _, _, params, _, _ = tiny_seq2seq()
    norms = diagnostics.layer_norms(params)
    expected = {}
    for stack, layers in (("encoder", 2), ("decoder", 3)):
        for i in range(layers):
            leaves = jax.tree.leaves(params[stack]["stack"][f"layer_{i}"])
            expected[f"{stack}/layer_{i}"] = np.sqrt(
                sum(np.sum(np.asarray(x, np.float64) ** 2) for x in leaves))
    assert set(norms) == set(expected)
    for name, value in expected.items():
        np.testing.assert_allclose(norms[name], value, rtol=1e-5)
    stacked = stack_layer_params(jax.tree.map(np.asarray, params))
    assert "layers" in stacked["decoder"]["stack"]
    scanned = diagnostics.layer_norms(stacked)
    for name, value in expected.items():
        np.testing.assert_allclose(scanned[name], value, rtol=1e-5)
    unstacked = diagnostics.unstack_layers(stacked)
    assert jax.tree.structure(unstacked) == jax.tree.structure(params)


def test_attention_stats_cover_encoder_and_decoder_self_attention():
    _, model, params, source, target = tiny_seq2seq()
    batch = {
        "source": source, "inputs": target,
        "source_positions": jnp.arange(5)[None], "source_segment_ids": jnp.ones((1, 5), int),
        "positions": jnp.arange(3)[None], "segment_ids": jnp.ones((1, 3), int),
    }
    stats = diagnostics.attention_stats(model, "seq2seq", params, batch)
    expected = {f"{kind}/{stack}/layer_{i}"
                for kind in ("attention_entropy", "attention_distance")
                for stack, layers in (("encoder", 2), ("decoder", 3)) for i in range(layers)}
    assert set(stats) == expected
    assert all(value.shape == (2,) for value in stats.values())
    # the decoder is causal: query 0 sees one key (entropy 0), so the mean is below log(3)
    assert float(stats["attention_entropy/decoder/layer_0"].max()) < math.log(3)
    # unchanged output: sowing the weights does not change the model
    plain = model.apply({"params": params}, source, target)
    sown, _ = model.apply({"params": params}, source, target, mutable=["intermediates"])
    np.testing.assert_allclose(sown, plain, atol=1e-6)


def lm_config(data_dir, diagnostics_every: int, scan_layers: bool = False):
    config = synthetic_lm.get_config("runlocal")
    config.model.update(d_model=32, num_heads=2, d_ff=64, num_decoder_layers=2,
                        scan_layers=scan_layers, position_scheme="alibi")
    config.data.update(data_dir=str(data_dir), batch_size=8, num_train_examples=128,
                       num_eval_examples=8, eval_batch_size=8)
    config.optimizer.update(total_steps=4, warmup_steps=1)
    config.train.update(num_steps=4, log_every=1, eval_every=4, checkpoint_every=4,
                        progress_bar=False, diagnostics_every=diagnostics_every)
    config.eval.update(max_generation_examples=0, splits=("validation",))
    return config


def test_a_tiny_run_logs_every_layer_and_head_and_the_same_losses(tmp_path):
    """Scanned layers here (a norm per slice of the stacked axis); the loss of every step is
    bit for bit the loss without diagnostics."""
    train.train_and_evaluate(lm_config(tmp_path / "data", 2, scan_layers=True), tmp_path / "on")
    train.train_and_evaluate(lm_config(tmp_path / "data", 0, scan_layers=True), tmp_path / "off")
    records = metrics.read_metrics(tmp_path / "on")
    logged = [r for r in records if any(k.startswith("diagnostics/") for k in r)]
    assert [r["step"] for r in logged] == [2, 4]
    names = {f"diagnostics/{kind}/decoder/layer_{i}/head_{h}"
             for kind in ("attention_entropy", "attention_distance")
             for i in range(2) for h in range(2)}
    names |= {f"diagnostics/{kind}/decoder/layer_{i}"
              for kind in ("param_norm", "grad_norm", "update_norm") for i in range(2)}
    for record in logged:
        assert set(record) - {"step"} == names
        assert all(math.isfinite(v) for v in record.values())
        assert record["diagnostics/param_norm/decoder/layer_0"] > 0
    losses = lambda workdir: [(r["step"], r["train_loss"])  # noqa: E731
                              for r in metrics.read_metrics(workdir) if "train_loss" in r]
    assert losses(tmp_path / "on") == losses(tmp_path / "off")
    assert len(losses(tmp_path / "off")) == 4
    assert not any(k.startswith("diagnostics/") for r in metrics.read_metrics(tmp_path / "off")
                   for k in r)


def test_report_plots_each_family_per_scheme(tmp_path):
    runs = sweep.make_runs("configs/synthetic_lm.py",
                           sweep.sweep("model.position_scheme", ["rope", "alibi"]), tmp_path)
    records = {}
    for run in runs:
        run.workdir.mkdir(parents=True)
        scale = 1.0 if run.overrides["model.position_scheme"] == "rope" else 3.0
        values = {f"diagnostics/attention_distance/decoder/layer_{i}/head_{h}": scale * (i + h)
                  for i in range(2) for h in range(4)}
        values |= {f"diagnostics/param_norm/decoder/layer_{i}": 10.0 + i for i in range(2)}
        lines = [{"step": 2, "train_loss": 2.0, **{k: 0.0 for k in values}},
                 {"step": 4, **values}, {"step": 4, "eval_loss": 1.0}]
        (run.workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        records[run.index] = {**run.manifest(), "status": "done"}
        (run.workdir / sweep.RUN_FILE).write_text(json.dumps(records[run.index]))
    sweep.write_manifest(tmp_path, runs, records)
    result = report.write_report(tmp_path, ["eval_loss"])
    for family in ("attention_distance", "param_norm"):
        path = tmp_path / f"diagnostics_{family}.png"
        assert path in result["files"] and path.read_bytes()[:4] == b"\x89PNG"
    finished = [{**run, "final": report.final_metrics(tmp_path / run["name"])}
                for run in report.find_runs(tmp_path)]
    table = report.diagnostics_table(finished, ["model.position_scheme"], "attention_distance")
    assert table["alibi"]["decoder/layer_1"][3] == 12.0  # the last step's value, 3 * (1 + 3)
    assert table["rope"]["decoder/layer_0"][2] == 2.0


@pytest.mark.parametrize("value", [-1, 1.5, True, "2"])
def test_bad_diagnostics_every_names_the_field(value):
    with pytest.raises(ConfigError, match=r"train\.diagnostics_every=.* must be an integer >= 0"):
        TrainConfig(diagnostics_every=value)
