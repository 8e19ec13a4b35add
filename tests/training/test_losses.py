import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.training import losses
from tfm.training.losses import smoothed_target_entropy

# Jitted once per shape: checks they trace, and is much faster than op-by-op dispatch.
cross_entropy = jax.jit(losses.cross_entropy, static_argnames="label_smoothing")
weighted_metrics = jax.jit(losses.weighted_metrics)

RNG = np.random.default_rng(0)
LOGITS = RNG.normal(size=(2, 3, 5)).astype(np.float32)  # [B=2, T=3, V=5]
TARGETS = np.array([[1, 4, 0], [2, 2, 3]], np.int32)
WEIGHTS = np.array([[1, 1, 0], [1, 0.5, 1]], np.float32)


def _numpy_reference(logits, targets, weights, eps):
    logits = logits.astype(np.float64)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    vocab = logits.shape[-1]
    q = np.full(logits.shape, eps / vocab)
    np.put_along_axis(q, targets[..., None], 1 - eps + eps / vocab, axis=-1)
    loss = -(q * log_probs).sum(-1)
    nll = -np.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
    entropy = -(q * np.log(np.where(q > 0, q, 1.0))).sum(-1)  # 0 log 0 = 0
    correct = log_probs.argmax(-1) == targets
    return {
        "loss_sum": (weights * loss).sum(),
        "kl_sum": (weights * (loss - entropy)).sum(),
        "nll_sum": (weights * nll).sum(),
        "correct_sum": (weights * correct).sum(),
        "weight_sum": weights.sum(),
    }


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_matches_numpy_reference(eps):
    sums = cross_entropy(jnp.asarray(LOGITS), jnp.asarray(TARGETS), jnp.asarray(WEIGHTS),
                         label_smoothing=eps)
    expected = _numpy_reference(LOGITS, TARGETS, WEIGHTS, eps)
    for key, value in expected.items():
        np.testing.assert_allclose(float(sums[key]), value, rtol=1e-5, err_msg=key)


def test_label_smoothing_by_hand_on_two_classes():
    # V=2, logits (0, 0): p = (1/2, 1/2); q = (1 - eps + eps/2, eps/2) = (0.95, 0.05) for eps=0.1.
    sums = cross_entropy(jnp.zeros((1, 1, 2)), jnp.zeros((1, 1), jnp.int32), jnp.ones((1, 1)),
                         label_smoothing=0.1)
    np.testing.assert_allclose(float(sums["loss_sum"]), np.log(2), rtol=1e-6)
    entropy = -(0.95 * np.log(0.95) + 0.05 * np.log(0.05))
    np.testing.assert_allclose(smoothed_target_entropy(2, 0.1), entropy, rtol=1e-12)
    np.testing.assert_allclose(float(sums["kl_sum"]), np.log(2) - entropy, rtol=1e-5)
    # Logits (3, 0): -log p = (log(1 + e^-3), 3 + log(1 + e^-3)).
    sums = cross_entropy(jnp.array([[[3.0, 0.0]]]), jnp.zeros((1, 1), jnp.int32),
                         jnp.ones((1, 1)), label_smoothing=0.1)
    base = np.log1p(np.exp(-3.0))
    np.testing.assert_allclose(float(sums["loss_sum"]), 0.95 * base + 0.05 * (3 + base), rtol=1e-5)
    np.testing.assert_allclose(float(sums["nll_sum"]), base, rtol=1e-5)


def test_eps_zero_is_plain_nll():
    sums = cross_entropy(jnp.asarray(LOGITS), jnp.asarray(TARGETS), jnp.asarray(WEIGHTS))
    assert float(sums["loss_sum"]) == float(sums["nll_sum"]) == float(sums["kl_sum"])


def test_padding_changes_nothing():
    base = cross_entropy(jnp.asarray(LOGITS), jnp.asarray(TARGETS), jnp.asarray(WEIGHTS),
                         label_smoothing=0.1)
    logits, targets = LOGITS.copy(), TARGETS.copy()
    logits[0, 2] = 1e4 * RNG.normal(size=5)  # weight-0 position: garbage logits and target
    targets[0, 2] = 3
    changed = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(WEIGHTS),
                            label_smoothing=0.1)
    for key in base:
        assert float(base[key]) == float(changed[key]), key


def test_accuracy_counts_only_weighted_tokens():
    logits = np.full((1, 4, 3), -5.0, np.float32)
    predictions = [0, 1, 2, 0]
    for t, p in enumerate(predictions):
        logits[0, t, p] = 5.0
    targets = np.array([[0, 1, 0, 1]], np.int32)  # right, right, wrong, wrong
    weights = np.array([[1, 0, 1, 0]], np.float32)  # counts: right (t0), wrong (t2)
    sums = cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(weights))
    assert float(sums["correct_sum"]) == 1.0 and float(sums["weight_sum"]) == 2.0
    assert float(weighted_metrics(sums)["accuracy"]) == 0.5


def test_bf16_logits_give_float32_loss():
    logits = jnp.asarray(LOGITS, jnp.bfloat16)
    sums = cross_entropy(logits, jnp.asarray(TARGETS), jnp.asarray(WEIGHTS), label_smoothing=0.1)
    assert all(v.dtype == jnp.float32 for v in sums.values())
    expected = _numpy_reference(np.asarray(logits.astype(jnp.float32)), TARGETS, WEIGHTS, 0.1)
    np.testing.assert_allclose(float(sums["loss_sum"]), expected["loss_sum"], rtol=1e-5)


def test_weighted_metrics_divide_once_and_guard_zero():
    first = cross_entropy(jnp.asarray(LOGITS[:1]), jnp.asarray(TARGETS[:1]),
                          jnp.asarray(WEIGHTS[:1]))
    second = cross_entropy(jnp.asarray(LOGITS[1:]), jnp.asarray(TARGETS[1:]),
                           jnp.asarray(WEIGHTS[1:]))
    total = {k: first[k] + second[k] for k in first}
    metrics = weighted_metrics(total)
    expected = _numpy_reference(LOGITS, TARGETS, WEIGHTS, 0.0)
    np.testing.assert_allclose(float(metrics["nll"]), expected["nll_sum"] / WEIGHTS.sum(),
                               rtol=1e-5)
    np.testing.assert_allclose(float(metrics["perplexity"]), np.exp(float(metrics["nll"])),
                               rtol=1e-6)
    empty = weighted_metrics({k: 0.0 * v for k, v in total.items()})
    assert float(empty["loss"]) == 0.0 and float(empty["perplexity"]) == 1.0
    assert not np.isnan(float(empty["accuracy"]))


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="targets"):
        losses.cross_entropy(jnp.zeros((1, 2, 3)), jnp.zeros((1, 3), jnp.int32), jnp.ones((1, 3)))
