import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from tfm.checks import ConfigError
from tfm.training import optim


def test_paper_schedule_by_hand():
    schedule = optim.paper_schedule(512, 4000)
    # count c -> step c + 1; lrate = 512^-0.5 * min(step^-0.5, step * 4000^-1.5).
    expected = {
        0: 512**-0.5 * 1 * 4000**-1.5,  # step 1: warmup branch
        3999: 512**-0.5 * 4000**-0.5,  # step 4000: the peak, both branches equal
        15999: 512**-0.5 * 16000**-0.5,  # step 16000: decay branch
    }
    for count, value in expected.items():
        np.testing.assert_allclose(float(schedule(count)), value, rtol=1e-6)
    np.testing.assert_allclose(float(schedule(3999)), 0.000698771, rtol=1e-5)
    values = np.array([float(schedule(c)) for c in (3990, 3998, 3999, 4000, 4010)])
    assert values.argmax() == 2  # peak exactly at step == warmup
    np.testing.assert_allclose(
        float(optim.paper_schedule(512, 4000, multiplier=2.0)(0)), 2 * expected[0], rtol=1e-6
    )


def test_cosine_endpoints_and_midpoint():
    schedule = optim.warmup_cosine(1.0, warmup_steps=10, total_steps=110, end_fraction=0.1)
    np.testing.assert_allclose(float(schedule(0)), 0.1, rtol=1e-6)  # step 1 of 10
    np.testing.assert_allclose(float(schedule(9)), 1.0, rtol=1e-6)  # step 10: peak
    np.testing.assert_allclose(float(schedule(59)), 0.1 + 0.9 * 0.5, rtol=1e-6)  # halfway
    np.testing.assert_allclose(float(schedule(109)), 0.1, rtol=1e-6)  # step 110: the end
    np.testing.assert_allclose(float(schedule(10_000)), 0.1, rtol=1e-6)  # held after


def test_rsqrt_linear_and_constant():
    schedule = optim.warmup_rsqrt(2.0, warmup_steps=100)
    np.testing.assert_allclose(float(schedule(49)), 1.0, rtol=1e-6)
    np.testing.assert_allclose(float(schedule(99)), 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(schedule(399)), 2.0 * math.sqrt(100 / 400), rtol=1e-6)
    warm = optim.linear_warmup(3.0, 4)
    np.testing.assert_allclose([float(warm(c)) for c in range(6)], [0.75, 1.5, 2.25, 3, 3, 3])
    assert float(optim.constant(0.5)(123)) == 0.5


def _params():
    return {
        "dense": {"kernel": jnp.ones((3, 2)), "bias": jnp.ones((2,))},
        "norm": {"scale": jnp.ones((2,))},
        "scanned": {"bias": jnp.ones((4, 2)), "kernel": jnp.ones((4, 2, 2))},
    }


def test_decay_mask_excludes_biases_and_scales():
    mask = optim.decay_mask(_params())
    assert mask == {
        "dense": {"kernel": True, "bias": False},
        "norm": {"scale": False},
        "scanned": {"bias": False, "kernel": True},
    }


def test_adam_paper_matches_optax_adam_with_paper_hyperparameters():
    tx, schedule = optim.make_optimizer({"name": "adam_paper", "warmup_steps": 10}, d_model=16)
    ref = optax.adam(optim.paper_schedule(16, 10), b1=0.9, b2=0.98, eps=1e-9)
    params = _params()
    grads = jax.tree.map(lambda p: jnp.arange(p.size, dtype=jnp.float32).reshape(p.shape), params)
    state, ref_state = tx.init(params), ref.init(params)
    update, ref_update = jax.jit(tx.update), jax.jit(ref.update)
    for _ in range(3):
        updates, state = update(grads, state, params)
        ref_updates, ref_state = ref_update(grads, ref_state, params)
        jax.tree.map(np.testing.assert_array_equal, updates, ref_updates)


def test_weight_decay_only_on_masked_leaves():
    tx, _ = optim.make_optimizer(
        {"name": "adamw", "schedule": "constant", "learning_rate": 0.1, "warmup_steps": 0,
         "weight_decay": 0.5}
    )
    params = _params()
    zeros = jax.tree.map(jnp.zeros_like, params)  # Adam part is exactly 0 with zero gradients
    updates, _ = jax.jit(tx.update)(zeros, tx.init(params), params)
    assert np.allclose(updates["dense"]["kernel"], -0.1 * 0.5)
    assert np.allclose(updates["scanned"]["kernel"], -0.1 * 0.5)
    for leaf in (updates["dense"]["bias"], updates["norm"]["scale"], updates["scanned"]["bias"]):
        assert np.all(np.asarray(leaf) == 0)


def test_clipping_caps_the_global_norm():
    grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([[12.0]])}  # global norm 13
    params = jax.tree.map(jnp.zeros_like, grads)
    for clip, scale in ((1.0, 1 / 13), (100.0, 1.0)):  # clipped; under the cap: untouched
        tx, _ = optim.make_optimizer(
            {"name": "adam", "schedule": "constant", "learning_rate": 1.0, "warmup_steps": 0,
             "grad_clip_norm": clip}
        )
        _, state = jax.jit(tx.update)(grads, tx.init(params), params)
        adam_state = state[1][0]  # chain(clip, adamw); adamw = chain(scale_by_adam, ...)
        # Adam's moments saw the clipped gradient g * min(1, clip / |g|).
        seen = jax.tree.map(lambda m: m / (1 - 0.9), adam_state.mu)
        np.testing.assert_allclose(float(optax.tree.norm(seen)), 13 * scale, rtol=1e-5)
        np.testing.assert_allclose(seen["a"], np.array([3.0, 4.0]) * scale, rtol=1e-5)


def test_multisteps_equals_one_step_on_the_mean_gradient():
    config = {"name": "adam", "schedule": "constant", "learning_rate": 0.1, "warmup_steps": 0}
    accum, _ = optim.make_optimizer({**config, "grad_accum_steps": 3})
    plain, _ = optim.make_optimizer(config)
    params = {"w": jnp.array([1.0, -2.0, 0.5])}
    micro = [jnp.array([1.0, 2.0, 3.0]), jnp.array([-4.0, 0.5, 0.0]), jnp.array([0.3, 0.3, 9.0])]
    state = accum.init(params)
    update = jax.jit(accum.update)
    p = params
    for i, g in enumerate(micro):
        updates, state = update({"w": g}, state, p)
        if i < 2:
            assert np.all(np.asarray(updates["w"]) == 0)  # nothing applied mid-accumulation
        p = optax.apply_updates(p, updates)
    mean = sum(micro) / 3
    ref_updates, _ = jax.jit(plain.update)({"w": mean}, plain.init(params), params)
    np.testing.assert_allclose(p["w"], params["w"] + ref_updates["w"], rtol=1e-6)
    # Numbers: the first Adam step is -lr * m_hat / (sqrt(v_hat) + eps) = -0.1 * sign(mean).
    np.testing.assert_allclose(p["w"], params["w"] - 0.1 * np.sign(mean), rtol=1e-5)


@pytest.mark.parametrize(
    "config, fragment",
    [
        ({"name": "sgd"}, "optimizer.name='sgd'"),
        ({"lr": 1.0}, "optimizer.lr is unknown; known optimizer fields"),
        ({"schedule": "linear"}, "optimizer.schedule='linear'"),
        ({"name": "adamw", "schedule": "cosine", "learning_rate": 1e-3}, "optimizer.total_steps"),
        ({"name": "adamw"}, "optimizer.learning_rate"),
        ({"b2": 1.5}, "optimizer.b2=1.5"),
        ({"grad_accum_steps": 0}, "optimizer.grad_accum_steps=0"),
        ({"warmup_steps": 0}, "optimizer.warmup_steps=0"),
        ({"weight_decay": 0.1}, "name='adamw'"),
        ({"grad_clip_norm": -1.0}, "optimizer.grad_clip_norm=-1.0"),
    ],
)
def test_bad_config_errors(config, fragment):
    with pytest.raises(ConfigError) as info:
        optim.make_optimizer(config, d_model=16)
    assert fragment in str(info.value)


def test_paper_schedule_needs_d_model_and_defaults_resolve():
    with pytest.raises(ConfigError, match="d_model"):
        optim.make_optimizer({})
    values = optim.resolve_optimizer_config({"name": "adam_paper"})
    assert (values["schedule"], values["b1"], values["b2"], values["eps"]) == (
        "paper", 0.9, 0.98, 1e-9)
    assert values["learning_rate"] == 1.0
    config = ml_collections.ConfigDict({"name": "adamw", "schedule": "rsqrt",
                                        "learning_rate": 1e-3, "warmup_steps": 10})
    tx, schedule = optim.make_optimizer(config)
    np.testing.assert_allclose(float(schedule(9)), 1e-3, rtol=1e-6)
