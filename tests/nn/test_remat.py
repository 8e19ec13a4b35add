"""Rematerialisation policies (tfm/nn/remat.py): the loss, the gradients and cached decoding are
those without remat under every policy, scanned or unrolled; the old True / False still work;
a bad name or an offload the platform cannot do is one ConfigError naming model.remat."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from decode_cases import EXTRA_LEN, MAX_NEW, PAD, PROMPT_LENGTHS, PROMPTS, SOURCE, random_params
from decode_cases import TINY as DECODE_TINY
from jax.extend import core as jax_core
from tiny_model import TINY

from configs import synthetic_lm
from tfm.checks import ConfigError
from tfm.decode.generate import lm_generate, translate
from tfm.nn import remat
from tfm.nn.config import ModelConfig
from tfm.nn.models import DecoderLM, EncoderDecoder, stack_layer_params
from tfm.training.experiment import parse_config

POLICIES = [name for name in remat.CHOICES if name != "none"]


def test_choices_are_the_documented_policies():
    assert remat.CHOICES == (
        "none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable", "offload")


@pytest.mark.parametrize("value, name", [(True, "full"), (False, "none"),
                                         ("dots_saveable", "dots_saveable")])
def test_old_bool_values_map_to_policy_names(value, name):
    assert ModelConfig(remat=value).remat == name
    config = synthetic_lm.get_config("runlocal")
    config.model.remat = value  # a config file written when remat was a bool
    assert parse_config(config).model.remat == name


def test_bad_name_is_one_config_error_naming_the_field_and_choices():
    config = synthetic_lm.get_config("runlocal")
    config.model.remat = "everything"
    with pytest.raises(ConfigError) as error:
        parse_config(config)
    assert str(error.value) == (
        "model.remat='everything' is unknown; choose one of: none, full, dots_saveable, "
        "dots_with_no_batch_dims_saveable, offload")


def test_offload_needs_a_platform_with_its_own_device_memory():
    for platform in ("tpu", "gpu"):
        remat.check_platform("offload", platform)
    for name in remat.CHOICES[:-1]:
        remat.check_platform(name, "cpu")
    with pytest.raises(ConfigError, match=r"^model.remat='offload' moves saved activations to "
                       r"host memory, which needs a tpu or gpu \(on cpu .*choose one of: none, "
                       r"full, dots_saveable, dots_with_no_batch_dims_saveable$"):
        remat.check_platform("offload", "cpu")


# ------------------------------------------------------------------- loss and gradients


def _checkpoint_policies(jaxpr: jax_core.Jaxpr) -> list:
    """The policy of every jax.checkpoint in `jaxpr`, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "remat2":
            found.append(eqn.params["policy"])
        for value in eqn.params.values():
            for inner in value if isinstance(value, tuple | list) else [value]:
                if isinstance(inner, jax_core.ClosedJaxpr | jax_core.Jaxpr):
                    found += _checkpoint_policies(getattr(inner, "jaxpr", inner))
    return found


@pytest.mark.parametrize("scan, blocks", [(False, 3), (True, 2)], ids=["unrolled", "scanned"])
def test_each_block_is_checkpointed_with_the_named_policy(scan, blocks):
    """One encoder and two decoder blocks: three checkpoints unrolled, one per scanned stack."""
    ids = jnp.ones((1, 4), jnp.int32)
    for name in remat.CHOICES:
        config = ModelConfig(**{**TINY, "num_encoder_layers": 1, "scan_layers": scan,
                                "remat": name})
        model = EncoderDecoder(config)
        params = jax.eval_shape(model.init, jax.random.PRNGKey(0), ids, ids)["params"]
        jaxpr = jax.make_jaxpr(lambda p, model=model: model.apply({"params": p}, ids, ids))(params)
        want = [] if name == "none" else [remat.policy(name)] * blocks
        assert _checkpoint_policies(jaxpr.jaxpr) == want, name


def _loss_and_grads(config: ModelConfig, params):
    """The compiled training loss (dropout on) and its gradients for a fixed batch of
    EncoderDecoder: call it with `params`."""
    model = EncoderDecoder(config)
    source = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 3, config.vocab_size)
    targets = jax.random.randint(jax.random.PRNGKey(2), (2, 6), 3, config.vocab_size)
    inputs = jnp.concatenate([jnp.ones((2, 1), jnp.int32), targets[:, :-1]], axis=1)

    def loss(params):
        logits = model.apply({"params": params}, source, inputs, deterministic=False,
                             rngs={"dropout": jax.random.PRNGKey(3)})
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return jax.jit(jax.value_and_grad(loss)).lower(params).compile()


def _init(config: ModelConfig):
    ids = jnp.ones((1, 4), jnp.int32)
    return nn.meta.unbox(EncoderDecoder(config).init(jax.random.PRNGKey(0), ids, ids)["params"])


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_loss_and_gradients_are_unchanged_by_every_policy(scan):
    config = ModelConfig(**{**TINY, "num_encoder_layers": 1, "dropout_rate": 0.1,
                            "scan_layers": scan})
    params = _init(config)
    loss, grads = _loss_and_grads(config, params)(params)
    for name in POLICIES:
        remat_loss, remat_grads = _loss_and_grads(config.replace(remat=name), params)(params)
        np.testing.assert_allclose(remat_loss, loss, rtol=1e-6, err_msg=name)
        jax.tree.map(lambda a, b, name=name: np.testing.assert_allclose(
            a, b, rtol=1e-5, atol=1e-6, err_msg=name), remat_grads, grads)


def test_the_less_a_policy_saves_the_more_the_step_recomputes():
    """Compiled FLOPs of the training step rise as policies save less. The reference backend:
    the CPU backend's dense layers have their own backward pass (tfm/kernels/cpu_dense.py),
    whose matmuls the dot policies do not see."""
    config = ModelConfig(**{**TINY, "num_encoder_layers": 1, "attention_backend": "reference"})
    params = _init(config)
    flops = {name: _loss_and_grads(config.replace(remat=name), params).cost_analysis()["flops"]
             for name in remat.CHOICES}
    assert (flops["none"] < flops["dots_saveable"] < flops["dots_with_no_batch_dims_saveable"]
            < flops["full"]), flops
    assert flops["offload"] < flops["full"], flops  # on CPU it moves nothing, but saves


# ------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_cached_greedy_decoding_is_unchanged_by_every_policy(scan):
    """The unrolled case once failed: remat traced the layer index that picks a layer's cache
    slots (TracerIntegerConversionError)."""
    config = ModelConfig(**{**DECODE_TINY, "position_scheme": "rope", "scan_layers": scan,
                            "num_encoder_layers": 0})
    params = random_params(DecoderLM(config.replace(scan_layers=False)), PROMPTS)
    params = stack_layer_params(params) if scan else params
    expected = lm_generate(params, config, PROMPTS, PROMPT_LENGTHS, max_new_tokens=MAX_NEW)
    assert len({tuple(row) for row in np.asarray(expected.tokens)}) > 1
    for name in POLICIES:
        output = lm_generate(params, config.replace(remat=name), PROMPTS, PROMPT_LENGTHS,
                             max_new_tokens=MAX_NEW)
        np.testing.assert_array_equal(output.tokens, expected.tokens, err_msg=name)
        np.testing.assert_array_equal(output.lengths, expected.lengths, err_msg=name)


def test_cached_translation_with_cross_attention_is_unchanged_by_remat():
    config = ModelConfig(**{**DECODE_TINY, "position_scheme": "sinusoidal"})
    params = random_params(EncoderDecoder(config), SOURCE, SOURCE)
    source_lengths = (SOURCE != PAD).sum(axis=1)
    outputs = [
        translate(params, config.replace(remat=name), SOURCE, source_lengths, method="beam",
                  beam_size=2, extra_len=EXTRA_LEN)
        for name in ("none", "full")
    ]
    np.testing.assert_array_equal(outputs[1].tokens, outputs[0].tokens)
    np.testing.assert_allclose(outputs[1].scores, outputs[0].scores, rtol=1e-6)
