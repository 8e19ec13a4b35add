"""Context parallelism in the model (tfm/nn/context_split.py, tfm/parallel/sharding.py's
context axis) on 8 simulated CPU devices: a tiny decoder-only LM's loss and every parameter
gradient under mesh.context = 2, 4 (all_gather, ring) equal the run on one device in float32
(relative 1e-5), for RoPE, ALiBi, T5 and learned positions, plain and packed rows (documents
crossing the chunk boundaries) with padding, and a local window."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_model import TINY_LM

from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM
from tfm.parallel import sharding

LENGTH = 16
SEGMENTS = np.array([[1] * LENGTH, [1] * 5 + [2] * 7 + [3] * 2 + [0] * 2], np.int32)


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, TINY_LM["vocab_size"], size=(2, LENGTH + 1)).astype(np.int32)
    positions = np.zeros_like(SEGMENTS)
    for t in range(1, LENGTH):
        same = SEGMENTS[:, t] == SEGMENTS[:, t - 1]
        positions[:, t] = np.where(same, positions[:, t - 1] + 1, 0)
    # Next-token targets are shifted on the whole row, before any split.
    return dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], positions=positions,
                segment_ids=SEGMENTS, weights=(SEGMENTS > 0).astype(np.float32))


def _loss_and_grads(config, context, batch, params):
    model = DecoderLM(config)
    run = jax.jit(jax.value_and_grad(functools.partial(_loss_sum, model)))
    if context == 1:
        return run(params, batch)
    mesh = sharding.make_mesh({"data": 1, "fsdp": 1, "context": context, "tensor": 1},
                              devices=jax.devices()[:context])
    with sharding.sharding_context(mesh):
        return run(params, batch)


def _loss_sum(model, params, batch):
    logits = model.apply({"params": params}, batch["inputs"], positions=batch["positions"],
                         segment_ids=batch["segment_ids"])
    log_probs = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(log_probs, batch["targets"][..., None], axis=-1)[..., 0]
    return jnp.sum(nll * batch["weights"])


@pytest.mark.parametrize("scheme, strategy, context, window", [
    ("rope", "ring", 4, None),
    ("alibi", "all_gather", 2, 3),
    ("t5_bias", "ring", 2, 5),
    ("learned", "all_gather", 4, None),
])
def test_context_parallel_loss_and_gradients_equal_one_device(scheme, strategy, context,
                                                              window):
    config = ModelConfig(**{**TINY_LM, "num_decoder_layers": 1}, position_scheme=scheme,
                         context_parallel=strategy, local_window=window,
                         attention_backend="reference")
    batch = {key: jnp.asarray(value) for key, value in _batch().items()}
    params = nn.meta.unbox(DecoderLM(config).init(jax.random.key(0), batch["inputs"])["params"])
    want_loss, want_grads = _loss_and_grads(config, 1, batch, params)
    got_loss, got_grads = _loss_and_grads(config, context, batch, params)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-5)
    # Relative to the largest gradient: some are zero but for rounding (a key bias shifts
    # every logit of a query alike, which the softmax ignores).
    scale = max(float(jnp.max(jnp.abs(leaf))) for leaf in jax.tree.leaves(want_grads))
    for (path, got), want in zip(jax.tree_util.tree_leaves_with_path(got_grads),
                                 jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got / scale, want / scale, rtol=1e-5, atol=1e-5,
                                   err_msg=jax.tree_util.keystr(path))
