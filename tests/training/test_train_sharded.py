"""The training loop's own pieces (tfm.training.train.setup, state_shardings, init_state,
jit_steps) on
8 simulated CPU devices (tests/conftest.py) against one device of the same process.

What is compared, on a tiny encoder-decoder (configs/synthetic_seq2seq.py:runlocal, d_model 32,
4 heads, d_ff 64, 1+1 layers, batch 8 x 16 tokens, float32, dropout 0):
- 3 train steps from the same initial state on the same batches under meshes data=8, fsdp=8 and
  data=2 x fsdp=2 x tensor=2 give the one-device losses within 1e-5 relative, and the same
  parameters within 1e-5 absolute (attention key biases excepted: their gradient is zero
  in exact arithmetic, so Adam steps them by the sign of rounding noise);
- the train state's params and Adam mu/nu really are sharded as the rules say (spec and the
  shape each device holds);
- greedy decoding (tfm.decode.generate.translate) with params sharded over 2 x 2 x 2 gives the
  one-device tokens exactly and scores within 1e-5;
- a mesh that does not match the device count, a batch the batch axes do not divide, and a
  tensor axis that divides neither num_heads nor d_ff fail in setup, before anything compiles.

Dropout is 0 here, so no random bits enter the steps; with dropout the masks do not depend on the
sharding either, because jax_threefry_partitionable is on (asserted below).
"""

import math

import jax
import numpy as np
import optax
import pytest

from configs import synthetic_seq2seq
from tfm.checks import ConfigError
from tfm.decode import generate
from tfm.parallel import sharding
from tfm.training import train
from tfm.training.experiment import init_state, setup, state_shardings

MESHES = {
    "data8": {"data": 8, "fsdp": 1, "tensor": 1},
    "fsdp8": {"data": 1, "fsdp": 8, "tensor": 1},
    "2x2x2": {"data": 2, "fsdp": 2, "tensor": 2},
}
ONE_DEVICE = {"data": 1, "fsdp": 1, "tensor": 1}
NUM_STEPS = 3
# LLVM optimisation level 0: 2-4x faster CPU compiles. It changes code generation only, not the
# HLO passes (SPMD partitioning, fusion) under test.
FAST_COMPILE = {"xla_backend_optimization_level": 0}


def tiny_config(data_dir, mesh):
    config = synthetic_seq2seq.get_config("runlocal")
    config.model.update(d_model=32, num_heads=4, d_ff=64, num_encoder_layers=1,
                        num_decoder_layers=1)
    config.data.update(batch_size=8, eval_batch_size=8, seq_len=16, num_train_examples=200,
                       num_eval_examples=16, train_lengths=(1, 8), eval_lengths=(9, 12),
                       data_dir=str(data_dir))
    config.mesh.update(mesh)
    return config


def experiment(data_dir, mesh, devices=None):
    return setup(tiny_config(data_dir, mesh), data_dir / "workdir", devices=devices)


def run_steps(exp, state, host_batches):
    """Loss (token mean) of each step, and the final state."""
    _, shardings = state_shardings(exp)
    train_fn, _ = train.jit_steps(exp, shardings)
    batches = [sharding.shard_batch(batch, exp.mesh, rules=exp.rules) for batch in host_batches]
    compiled = train_fn.lower(state, batches[0]).compile(FAST_COMPILE)
    losses = []
    for batch in batches:
        state, metrics = compiled(state, batch)
        losses.append(float(metrics["loss_sum"]) / float(metrics["weight_sum"]))
    return losses, state


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("sharded")


@pytest.fixture(scope="module")
def initial_state(data_dir):
    """The train state initialised directly sharded over 2 x 2 x 2 (init_state, as the loop
    does), fetched to the host; every run below starts from it."""
    exp = experiment(data_dir, MESHES["2x2x2"])
    _, shardings = state_shardings(exp)
    state = init_state(exp, shardings)
    query = state.params["encoder"]["stack"]["layer_0"]["self_attention"]["query"]["kernel"]
    assert query.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
    assert query.addressable_shards[0].data.shape == (16, 2, 8)
    return jax.device_get(state)


@pytest.fixture(scope="module")
def host_batches(data_dir):
    exp = experiment(data_dir, ONE_DEVICE, jax.devices()[:1])
    iterator = exp.data.train_iterator()
    return [next(iterator) for _ in range(NUM_STEPS)]


@pytest.fixture(scope="module")
def one_device_run(data_dir, initial_state, host_batches):
    exp = experiment(data_dir, ONE_DEVICE, jax.devices()[:1])
    assert exp.mesh.size == 1
    _, shardings = state_shardings(exp)
    losses, state = run_steps(exp, jax.device_put(initial_state, shardings), host_batches)
    return losses, jax.device_get(state)


def test_dropout_masks_do_not_depend_on_sharding():
    assert jax.config.jax_threefry_partitionable


def adam_states(opt_state):
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    return [s for s in jax.tree.leaves(opt_state, is_leaf=is_adam) if is_adam(s)]


def expected_spec(names):
    """The default rules by hand: embed -> fsdp, heads/mlp/vocab -> tensor, others replicated."""
    table = {"embed": "fsdp", "heads": "tensor", "kv_heads": "tensor", "mlp": "tensor",
             "vocab": "tensor"}
    return jax.sharding.PartitionSpec(*(table.get(name) for name in names))


# Logical names of a few parameters (from tfm/nn/layers.py) whose specs and shard shapes are
# checked.
CHECKED = {
    ("encoder", "stack", "layer_0", "self_attention", "query", "kernel"):
        ("embed", "heads", "head_dim"),
    ("decoder", "stack", "layer_0", "cross_attention", "out", "kernel"):
        ("heads", "head_dim", "embed"),
    ("decoder", "stack", "layer_0", "feed_forward", "wi", "kernel"): ("embed", "mlp"),
    ("encoder", "stack", "layer_0", "feed_forward", "wo", "kernel"): ("mlp", "embed"),
    ("embed", "embedding"): ("vocab", "embed"),
    ("decoder", "stack", "final_norm", "layer_norm", "scale"): ("embed",),
}


def lookup(tree, path):
    for key in path:
        tree = tree[key]
    return tree


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_training_matches_one_device(mesh_name, data_dir, initial_state, host_batches,
                                             one_device_run):
    exp = experiment(data_dir, MESHES[mesh_name])
    sizes = dict(exp.mesh.shape)
    assert exp.mesh.size == 8 and sizes == {"context": 1, **MESHES[mesh_name]}
    _, shardings = state_shardings(exp)
    losses, state = run_steps(exp, jax.device_put(initial_state, shardings), host_batches)

    ref_losses, ref_state = one_device_run
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert int(state.step) == NUM_STEPS
    got = jax.tree_util.tree_flatten_with_path(jax.device_get(state.params))[0]
    for (path, value), expected in zip(got, jax.tree.leaves(ref_state.params), strict=True):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        if name.endswith("key/bias"):
            # Exactly zero gradient (softmax ignores a constant added to every key's logit):
            # Adam turns the rounding noise of each layout into lr-sized steps of either sign.
            continue
        np.testing.assert_allclose(value, expected, rtol=0, atol=1e-5, err_msg=name)

    # Parameters and both Adam moments are laid out as the rules say, on every device.
    (adam,) = adam_states(state.opt_state)
    for path, names in CHECKED.items():
        spec = expected_spec(names)
        for leaf in (lookup(state.params, path), lookup(adam.mu, path), lookup(adam.nu, path)):
            assert leaf.sharding.spec == spec, (path, leaf.sharding.spec)
            shard = tuple(
                dim // (sizes[axis] if axis else 1)
                for dim, axis in zip(leaf.shape, spec, strict=True)
            )
            assert all(s.data.shape == shard for s in leaf.addressable_shards), path
    # Every moment follows its parameter, leaf by leaf.
    for moments in (adam.mu, adam.nu):
        for param, moment in zip(jax.tree.leaves(state.params), jax.tree.leaves(moments),
                                 strict=True):
            assert moment.sharding == param.sharding
    # Under fsdp=8 a device holds an eighth of every leaf with a d_model ("embed") axis, and those
    # are almost all parameters (not: the q/k/v biases [heads, head_dim] and FFN biases [d_ff]).
    if mesh_name == "fsdp8":
        params = jax.tree.leaves(state.params)
        split = ["fsdp" in p.sharding.spec for p in params]
        held = sum(math.prod(p.addressable_shards[0].data.shape) for p in params)
        assert held == sum(p.size // 8 if s else p.size for p, s in zip(params, split, strict=True))
        assert sum(p.size for p, s in zip(params, split, strict=True) if s) > 0.95 * sum(
            p.size for p in params)


def test_decoding_under_a_mesh_equals_one_device(data_dir, one_device_run):
    _, trained = one_device_run
    exp = experiment(data_dir, MESHES["2x2x2"])
    _, shardings = state_shardings(exp)
    sharded_params = jax.device_put(trained.params, shardings.params)
    sources, _ = exp.data.eval_texts("validation")
    tokens, lengths = generate.pad_batch([exp.data.encode_prompt(s) for s in sources[:4]])

    def decode(params):
        output = generate.translate(params, exp.model_config, tokens, lengths, method="greedy",
                                    max_new_tokens=6)
        return jax.device_get(output.tokens), jax.device_get(output.scores)

    one_device = jax.device_put(trained.params, jax.devices()[0])
    ref_tokens, ref_scores = decode(one_device)
    got_tokens, got_scores = decode(sharded_params)
    np.testing.assert_array_equal(got_tokens, ref_tokens)
    np.testing.assert_allclose(got_scores, ref_scores, rtol=1e-5, atol=1e-5)
    assert (ref_tokens > 0).any()  # something was decoded


@pytest.mark.parametrize(
    "mesh, changes, match",
    [
        ({"data": 3}, {}, "mesh sizes data=3 x fsdp=1 x context=1 x tensor=1 = 3 do not "
                          "match the 8 available devices"),
        ({"data": 2, "fsdp": 2, "tensor": 4}, {}, "= 16 do not match the 8 available devices"),
        ({"data": 8}, {"batch_size": 12},
         r"batch_size=12 is not divisible by mesh.data=8 x mesh.fsdp=1 = 8"),
        ({"data": 1, "fsdp": 1, "tensor": 8}, {},
         r"model.num_heads=4 is not divisible by mesh.tensor=8 = 8"),
        ({"data": 1, "fsdp": 4, "tensor": 2}, {"d_ff": 65},
         r"model.d_ff=65 is not divisible by mesh.tensor=2 = 2"),
    ],
)
def test_bad_sizes_fail_in_setup(data_dir, mesh, changes, match, monkeypatch):
    def no_compiling(*args, **kwargs):
        raise AssertionError("setup must not compile")

    config = tiny_config(data_dir, {"data": 1, "fsdp": 1, "tensor": 1})
    config.mesh.update(mesh)
    if "batch_size" in changes:
        config.data.batch_size = changes["batch_size"]
    if "d_ff" in changes:
        config.model.d_ff = changes["d_ff"]
    monkeypatch.setattr(jax, "jit", no_compiling)
    with pytest.raises(ConfigError, match=match):
        setup(config, data_dir / "bad")
