"""Token cross-entropy with label smoothing, returned as weighted sums, and `loss_sums`, the
train and eval steps' loss of a model on a batch (from its logits, or fused with its output
layer).

Sums (not means) let the caller add them across micro-batches, eval batches and devices and
divide once (`weighted_metrics`), so every token counts the same however the batches fall.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm import kernels
from tfm.kernels import fused_cross_entropy
from tfm.nn.config import ModelConfig, loss_backend_for
from tfm.nn.families import get_family
from tfm.nn.models import output_projection


def smoothed_target_entropy(vocab_size: int, label_smoothing: float) -> float:
    """Entropy of the smoothed target q = (1 - eps) * onehot + eps / V: the least loss
    any model can reach under label smoothing."""
    eps = label_smoothing
    if eps == 0.0:
        return 0.0
    on, off = 1.0 - eps + eps / vocab_size, eps / vocab_size
    return -(on * math.log(on) + (vocab_size - 1) * off * math.log(off))


def cross_entropy(
    logits: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    label_smoothing: float = 0.0,
) -> dict[str, jax.Array]:
    """Weighted token cross-entropy sums.

    logits: [batch, length, vocab] (any float dtype; log_softmax runs in float32)
    targets: [batch, length] int; weights: [batch, length] (0 for padding, which then affects
    nothing). Label smoothing (Szegedy et al. 2016; Vaswani et al. 2017 sec. 5.4) trains
    against q = (1 - eps) * onehot(target) + eps / V, i.e. eps spread uniformly over ALL V
    classes, the true one included (tensor2tensor instead spreads eps over the V - 1 others).

    Returns float32 scalars:
      loss_sum: sum_t w_t * H(q_t, p_t), the smoothed loss to optimise (= nll_sum at eps=0);
      kl_sum: loss_sum minus its minimum, w * H(q): sum_t w_t * KL(q_t || p_t);
      nll_sum: sum_t w_t * -log p_t(target), unsmoothed, for perplexity;
      correct_sum: sum_t w_t * [argmax p_t == target]; weight_sum: sum_t w_t.
    """
    _check_inputs("cross_entropy", "logits [B,T,V]", logits, targets, weights, label_smoothing)
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(log_probs, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]
    return _sums(nll, log_probs.mean(axis=-1), jnp.argmax(log_probs, axis=-1) == targets,
                 weights, logits.shape[-1], label_smoothing)


def _check_inputs(function: str, first: str, array: jax.Array, targets: jax.Array,
                  weights: jax.Array, label_smoothing: float) -> None:
    """ValueError unless `array` is [B, T, ...] over targets and weights [B, T] and
    label_smoothing is in [0, 1)."""
    if array.shape[:-1] != targets.shape or targets.shape != weights.shape:
        name = first.split()[0]
        raise ValueError(
            f"{function} needs {first}, targets [B,T], weights [B,T]; got {name} "
            f"{array.shape}, targets {targets.shape}, weights {weights.shape}"
        )
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing={label_smoothing!r} must be in [0, 1)")


def _sums(
    nll: jax.Array,  # [batch, length] -log p(target)
    mean_log_prob: jax.Array,  # [batch, length] mean over the vocabulary of log p
    correct: jax.Array,  # [batch, length] bool, argmax == target
    weights: jax.Array,  # [batch, length]
    vocab_size: int,
    label_smoothing: float,
) -> dict[str, jax.Array]:
    """The weighted sums `cross_entropy` returns, from per-token figures."""
    weights = weights.astype(jnp.float32)
    # H(q, p) = (1 - eps) * nll + eps * mean_v(-log p_v).
    loss = (1.0 - label_smoothing) * nll - label_smoothing * mean_log_prob
    weight_sum = weights.sum()
    loss_sum = (weights * loss).sum()
    return {
        "loss_sum": loss_sum,
        "kl_sum": loss_sum - weight_sum * smoothed_target_entropy(vocab_size, label_smoothing),
        "nll_sum": (weights * nll).sum(),
        "correct_sum": (weights * correct.astype(jnp.float32)).sum(),
        "weight_sum": weight_sum,
    }


def fused_cross_entropy_sums(
    hidden: jax.Array,
    table: jax.Array,
    bias: jax.Array | None,
    targets: jax.Array,
    weights: jax.Array,
    *,
    label_smoothing: float = 0.0,
) -> dict[str, jax.Array]:
    """`cross_entropy`'s sums of the logits hidden @ table.T + bias, computed by one Pallas
    kernel (tfm.kernels.fused_cross_entropy) that never writes the logits.

    hidden: [batch, length, d_model] (compute dtype); table: [vocab, d_model] (cast to hidden's
    dtype); bias: [vocab] or None; targets, weights: [batch, length]. Same values as
    `cross_entropy` up to summation order; accuracy counts the first largest logit, as argmax.
    """
    _check_inputs("fused_cross_entropy_sums", "hidden [B,T,D]", hidden, targets, weights,
                  label_smoothing)
    vocab_size = table.shape[0]
    stats = fused_cross_entropy.softmax_statistics(hidden, table, bias, targets)
    # mean_v(log p_v) = mean_v(logits) - lse.
    return _sums(stats.lse - stats.target_logit, stats.logit_sum / vocab_size - stats.lse,
                 stats.argmax == targets, weights, vocab_size, label_smoothing)


def weighted_metrics(sums: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """Per-token means from (accumulated) `cross_entropy` sums: loss, kl, nll, perplexity
    (exp of the mean unsmoothed nll) and accuracy; all 0 (perplexity 1) when weight_sum is 0."""
    weight_sum = jnp.asarray(sums["weight_sum"], jnp.float32)
    safe = jnp.where(weight_sum > 0, weight_sum, 1.0)

    def mean(key: str) -> jax.Array:
        return jnp.where(weight_sum > 0, jnp.asarray(sums[key], jnp.float32) / safe, 0.0)

    nll = mean("nll_sum")
    metrics = {"loss": mean("loss_sum"), "nll": nll, "perplexity": jnp.exp(nll)}
    metrics["accuracy"] = mean("correct_sum")
    if "kl_sum" in sums:
        metrics["kl"] = mean("kl_sum")
    return metrics


def uses_fused_loss(config: ModelConfig) -> bool:
    """Whether `config.loss_backend` picks the fused cross-entropy kernel on the platform being
    compiled for ("auto": tfm.nn.config.loss_backend_for)."""
    backend = config.loss_backend
    if backend == "auto":
        backend = loss_backend_for(kernels.platform(), config.vocab_size)
    return backend == "fused"


def loss_sums(
    model: nn.Module,
    params: Any,
    batch: Mapping[str, jax.Array],
    weights: jax.Array,  # [batch, len]
    *,
    mode: str,
    deterministic: bool,
    label_smoothing: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """The cross-entropy sums of a batch against batch["targets"]: from the
    logits, or with the fused loss (ModelConfig.loss_backend) from the model's last hidden
    states and its output layer, without logits in memory."""
    config = model.config
    family = get_family(mode)
    if not uses_fused_loss(config):
        logits = family.logits(model, params, batch, deterministic=deterministic,
                               dropout_rng=dropout_rng)
        return cross_entropy(logits, batch["targets"], weights,
                                    label_smoothing=label_smoothing)
    hidden = family.logits(model, params, batch, deterministic=deterministic,
                           dropout_rng=dropout_rng, return_hidden=True)
    table, bias = output_projection(params, config)
    return fused_cross_entropy_sums(hidden, table, bias, batch["targets"], weights,
                                           label_smoothing=label_smoothing)
