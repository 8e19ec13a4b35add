"""Tests for tfm/parallel/sharding.py on 8 simulated CPU devices (tests/conftest.py sets the flag).

Sharded results are compared with a single-device run at rtol/atol 1e-5 in float32.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from tfm.checks import ConfigError, field_prefix
from tfm.nn.config import ModelConfig
from tfm.parallel import sharding

MESHES = {
    "data8": {"data": 8, "fsdp": 1, "tensor": 1},
    "fsdp8": {"data": 1, "fsdp": 8, "tensor": 1},
    "2x2x2": {"data": 2, "fsdp": 2, "tensor": 2},
}


def ramp_init(key, shape, dtype=jnp.float32):
    """Distinct deterministic values per element (cheap to compile, unlike threefry)."""
    del key
    return jnp.sin(jnp.arange(math.prod(shape), dtype=dtype) + 1.0).reshape(shape)


def boxed(logical_names):
    return nn.with_logical_partitioning(ramp_init, logical_names)


def test_eight_devices():
    assert jax.device_count() == 8


# ----------------------------------------------------------------------------- mesh config


def test_validate_fills_minus_one():
    assert sharding.validate_mesh_config({"data": -1}, 8) == {"data": 8, "fsdp": 1, "context": 1,
                                                              "tensor": 1}
    config = ml_collections.ConfigDict({"data": 2, "fsdp": -1, "tensor": 2})
    assert sharding.validate_mesh_config(config, 8) == {"data": 2, "fsdp": 2, "context": 1,
                                                        "tensor": 2}
    assert sharding.validate_mesh_config({"data": 1, "context": -1}, 8)["context"] == 8
    assert sharding.validate_mesh_config({"data": 1, "fsdp": 1, "tensor": -1}, 8)["tensor"] == 8


@pytest.mark.parametrize(
    "config, match",
    [
        ({"data": 3, "fsdp": 1, "tensor": 1},
         "mesh sizes data=3 x fsdp=1 x context=1 x tensor=1 = 3 do not match the 8 available "
         "devices"),
        ({"data": -1, "fsdp": -1}, "mesh.data and mesh.fsdp are both -1"),
        ({"data": -1, "tensor": 3}, r"mesh.data=-1 cannot fill the 8 available devices"),
        ({"data": 0}, r"mesh.data=0 must be >= 1"),
        ({"data": 2.0}, r"mesh.data=2.0 must be an integer"),
        ({"data": -1, "pipeline": 2}, r"mesh.pipeline is unknown"),
    ],
)
def test_validate_errors(config, match):
    with pytest.raises(ConfigError, match=match):
        sharding.validate_mesh_config(config, 8)


def test_make_mesh_shape_names_and_devices():
    mesh = sharding.make_mesh({"data": 2, "fsdp": -1, "tensor": 2})
    assert mesh.axis_names == ("data", "fsdp", "context", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "context": 1, "tensor": 2}
    assert mesh.axis_types == (AxisType.Auto,) * 4
    assert sorted(d.id for d in mesh.devices.ravel()) == list(range(8))
    single = sharding.make_mesh({"data": -1}, devices=jax.devices()[:1])
    assert single.devices.shape == (1, 1, 1, 1)
    with pytest.raises(ConfigError, match="do not match the 1 available devices"):
        sharding.make_mesh({"data": 2}, devices=jax.devices()[:1])


def test_granule_split_puts_hosts_on_data_first():
    sizes = {"data": 2, "fsdp": 4, "context": 1, "tensor": 2}
    assert sharding._split_over_granules(sizes, 2) == ([2, 1, 1, 1], [1, 4, 1, 2])
    assert sharding._split_over_granules({"data": 1, "fsdp": 8, "context": 1, "tensor": 1},
                                         4) == ([1, 4, 1, 1], [1, 2, 1, 1])
    with pytest.raises(ConfigError, match="cannot be laid out over 3 hosts"):
        sharding._split_over_granules(sizes, 3)


# ----------------------------------------------------------------------------- rules


def test_resolve_rules_overrides_in_place():
    rules = sharding.resolve_rules([("embed", None), ("heads", ["tensor", "fsdp"])])
    assert dict(rules)["embed"] is None
    assert dict(rules)["heads"] == ("tensor", "fsdp")
    assert [name for name, _ in rules] == [name for name, _ in sharding.DEFAULT_LOGICAL_RULES]
    assert sharding.resolve_rules(None) == sharding.DEFAULT_LOGICAL_RULES
    with pytest.raises(ConfigError, match=r"logical_axis_rules\[0\] names logical axis 'emb'"):
        sharding.resolve_rules([("emb", "fsdp")])
    with pytest.raises(ConfigError, match=r"logical_axis_rules\[1\] maps 'mlp' to mesh axis 'x'"):
        sharding.resolve_rules([("embed", None), ("mlp", "x")])


def test_activation_rules_give_batch_priority():
    # [batch, length, embed]: batch takes data x fsdp, so embed cannot also take fsdp; the
    # sequence splits over context (context parallelism).
    spec = nn.logical_to_mesh_axes(("batch", "length", "embed"), sharding.DEFAULT_LOGICAL_RULES)
    assert spec == P(("data", "fsdp"), "context", None)
    spec = nn.logical_to_mesh_axes(("batch", "length", "vocab"), sharding.DEFAULT_LOGICAL_RULES)
    assert spec == P(("data", "fsdp"), "context", "tensor")


# ----------------------------------------------------------------------------- params


class TinyModel(nn.Module):
    """Params with the contract's logical names, plus one unboxed (replicated) param."""

    @nn.compact
    def __call__(self, tokens):  # tokens: [batch, length] int32
        embedding = self.param("embedding", nn.with_logical_partitioning(
            nn.initializers.normal(1.0), ("vocab", "embed")), (16, 16))  # one random param
        query = self.param("query", boxed(("embed", "heads", "head_dim")), (16, 4, 4))
        w_in = self.param("w_in", boxed(("embed", "mlp")), (16, 32))
        b_in = self.param("b_in", boxed(("mlp",)), (32,))
        w_out = self.param("w_out", boxed(("mlp", "embed")), (32, 16))
        scale = self.param("scale", ramp_init, (16,))
        x = embedding[tokens] * scale  # [batch, length, embed]
        x = x + jnp.einsum("btd,dnh->btnh", x, query).reshape(x.shape)
        return jax.nn.relu(x @ w_in + b_in) @ w_out


# Hand-written from DEFAULT_LOGICAL_RULES: embed->fsdp, vocab/heads/mlp->tensor, head_dim->None.
EXPECTED_SPECS = {
    "embedding": P("tensor", "fsdp"),
    "query": P("fsdp", "tensor", None),
    "w_in": P("fsdp", "tensor"),
    "b_in": P("tensor"),
    "w_out": P("tensor", "fsdp"),
    "scale": P(),
}


def _shard_shape(shape, spec, sizes):
    """Per-device shape: each dim divided by the product of its mesh axes."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    out = []
    for dim, axes in zip(shape, spec, strict=True):
        axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
        out.append(dim // math.prod(sizes[a] for a in axes))
    return tuple(out)


@pytest.fixture(scope="module")
def tiny_reference():
    tokens = jnp.zeros((8, 4), jnp.int32)
    variables = jax.jit(TinyModel().init)(jax.random.key(0), tokens)
    return tokens, jax.tree.map(np.asarray, nn.unbox(variables)["params"])


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_param_shardings_follow_rules(mesh_name, tiny_reference):
    tokens, reference = tiny_reference
    mesh = sharding.make_mesh(MESHES[mesh_name])
    sizes = dict(mesh.shape)
    model = TinyModel()
    abstract = jax.eval_shape(model.init, jax.random.key(0), tokens)
    shardings = sharding.param_shardings(abstract, mesh)
    variables = jax.jit(model.init, out_shardings=shardings)(jax.random.key(0), tokens)
    params = nn.unbox(variables)["params"]
    for name, spec in EXPECTED_SPECS.items():
        array = params[name]
        assert shardings["params"][name].spec == spec, name
        assert array.sharding.spec == spec, name
        assert array.addressable_shards[0].data.shape == _shard_shape(array.shape, spec, sizes)
        for shard in array.addressable_shards:
            np.testing.assert_allclose(np.asarray(shard.data), reference[name][shard.index],
                                       rtol=1e-6)
        # Sharding must not change the values the initializer draws.
        np.testing.assert_allclose(np.asarray(array), np.asarray(reference[name]), rtol=1e-6)
    # The same tree shards the optimizer state of boxed params (mu/nu like the params).
    opt_state = jax.eval_shape(optax.adam(1e-3).init, abstract["params"])
    opt_shardings = sharding.param_shardings(opt_state, mesh)
    assert opt_shardings[0].mu["w_in"].spec == EXPECTED_SPECS["w_in"]
    assert opt_shardings[0].count.spec == P()


def test_shard_shapes_spot_check():
    # Independent of _shard_shape: the embedding [16, 16] on fsdp=8 is [16, 2] per device.
    mesh = sharding.make_mesh(MESHES["fsdp8"])
    tokens = jnp.zeros((8, 4), jnp.int32)
    abstract = jax.eval_shape(TinyModel().init, jax.random.key(0), tokens)
    shardings = sharding.param_shardings(abstract, mesh)
    assert shardings["params"]["embedding"].shard_shape((16, 16)) == (16, 2)
    assert shardings["params"]["query"].shard_shape((16, 4, 4)) == (2, 4, 4)


# ----------------------------------------------------------------------------- training step


class RegressionMLP(nn.Module):
    @nn.compact
    def __call__(self, x):  # x: [batch, embed] -> [batch, embed]
        w1 = self.param("w1", nn.with_logical_partitioning(ramp_init, ("embed", "mlp")), (8, 16))
        b1 = self.param("b1", nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)), (16,))
        w2 = self.param("w2", nn.with_logical_partitioning(ramp_init, ("mlp", "embed")), (16, 8))
        hidden = sharding.constrain(jax.nn.relu(x @ w1 + b1), ("batch", "mlp"))
        return hidden @ w2


def _train(mesh, steps=3, learning_rate=0.05):
    """SGD on y = x @ A; returns per-step losses and the final params (as numpy)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 8)).astype(np.float32)
    y = (x @ rng.normal(size=(8, 8))).astype(np.float32)
    model = RegressionMLP()
    abstract = jax.eval_shape(model.init, jax.random.key(1), x)
    param_sharding = sharding.param_shardings(abstract, mesh)["params"]
    data_sharding = sharding.batch_sharding(mesh)

    def loss_fn(params, batch):
        prediction = model.apply({"params": params}, batch["x"])
        return jnp.mean((prediction - batch["y"]) ** 2)

    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads), loss

    with sharding.sharding_context(mesh):
        init = jax.jit(lambda key: nn.unbox(model.init(key, x))["params"],
                       out_shardings=param_sharding)
        params = init(jax.random.key(1))
        step = jax.jit(step, in_shardings=(param_sharding, data_sharding),
                       out_shardings=(param_sharding, sharding.replicated(mesh)))
        batch = sharding.shard_batch({"x": x, "y": y}, mesh)
        losses = []
        for _ in range(steps):
            params, loss = step(params, batch)
            losses.append(float(loss))
    assert params["w1"].sharding == param_sharding["w1"]
    return np.array(losses), jax.tree.map(np.asarray, params)


@pytest.fixture(scope="module")
def single_device_run():
    return _train(sharding.make_mesh({"data": 1}, devices=jax.devices()[:1]))


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_sharded_training_matches_single_device(mesh_name, single_device_run):
    losses, params = _train(sharding.make_mesh(MESHES[mesh_name]))
    reference_losses, reference_params = single_device_run
    assert reference_losses[-1] < reference_losses[0]  # it trains
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-5, atol=1e-5)
    for name in reference_params:
        np.testing.assert_allclose(params[name], reference_params[name], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- checks


def _model(**changes):
    base = dict(vocab_size=32, d_model=16, num_heads=4, d_ff=32, num_encoder_layers=1,
                num_decoder_layers=1)
    return ModelConfig(**{**base, **changes})


def test_check_divisibility_passes_for_good_sizes():
    sharding.check_divisibility(_model(), {"data": 2, "fsdp": 2, "tensor": 2}, batch_size=8)
    sharding.check_divisibility(_model(), sharding.make_mesh(MESHES["fsdp8"]), batch_size=8)


@pytest.mark.parametrize(
    "changes, mesh, batch_size, match",
    [
        ({}, {"data": 2, "fsdp": 4, "tensor": 1}, 12,
         r"batch_size=12 is not divisible by mesh.data=2 x mesh.fsdp=4 = 8"),
        ({"num_heads": 2}, {"data": 1, "fsdp": 1, "tensor": 4}, 8,
         r"model.num_heads=2 is not divisible by mesh.tensor=4 = 4.*'heads'"),
        ({"num_kv_heads": 1}, {"data": 4, "fsdp": 1, "tensor": 2}, 8,
         r"model.num_kv_heads=1 is not divisible by mesh.tensor=2.*'kv_heads' to None"),
        ({"d_ff": 36, "num_heads": 8}, {"data": 1, "fsdp": 1, "tensor": 8}, 8,
         r"model.d_ff=36 .*'mlp'"),
        ({"d_model": 12, "num_heads": 2}, {"data": 1, "fsdp": 8, "tensor": 1}, 8,
         r"model.d_model=12 is not divisible by mesh.fsdp=8"),
        ({"vocab_size": 30}, {"data": 2, "fsdp": 1, "tensor": 4}, 8, r"model.vocab_size=30"),
    ],
)
def test_check_divisibility_errors(changes, mesh, batch_size, match):
    with pytest.raises(ConfigError, match=match):
        sharding.check_divisibility(_model(**changes), mesh, batch_size)


def test_check_divisibility_respects_rule_overrides():
    rules = sharding.resolve_rules([("kv_heads", None)])
    sharding.check_divisibility(_model(num_kv_heads=1), {"data": 4, "fsdp": 1, "tensor": 2}, 8,
                                rules)


class OddModel(nn.Module):
    names: tuple = ("embed", "mlp")

    @nn.compact
    def __call__(self, x):  # x: [batch, 8]
        kernel = self.param("kernel", nn.with_logical_partitioning(ramp_init, self.names), (8, 6))
        return x @ kernel


def test_param_divisibility_error_names_the_path():
    mesh = sharding.make_mesh({"data": 1, "fsdp": 2, "tensor": 4})
    x = jnp.zeros((2, 8))
    abstract = jax.eval_shape(nn.Sequential([OddModel()]).init, jax.random.key(0), x)
    with pytest.raises(ConfigError, match=r"parameter params/layers_0/kernel has shape \(8, 6\): "
                       r"dimension 1 \('mlp', size 6\) is sharded over mesh.tensor=4 = 4"):
        sharding.param_shardings(abstract, mesh)
    # Mapping mlp to None makes it legal.
    rules = sharding.resolve_rules([("mlp", None)])
    assert sharding.param_shardings(abstract, mesh, rules)["params"]["layers_0"]["kernel"].spec \
        == P("fsdp", None)


def test_unknown_logical_name_is_an_error():
    mesh = sharding.make_mesh({"data": -1})
    abstract = jax.eval_shape(OddModel(names=("emebd", "mlp")).init, jax.random.key(0),
                              jnp.zeros((2, 8)))
    with pytest.raises(ValueError, match=r"parameter params/kernel uses logical axis name 'emebd'"):
        sharding.param_shardings(abstract, mesh)


# ----------------------------------------------------------------------------- batches


def test_shard_batch_global_array():
    mesh = sharding.make_mesh(MESHES["2x2x2"])
    host = {
        "inputs": np.arange(8 * 4, dtype=np.int32).reshape(8, 4),
        "example_weights": np.linspace(0, 1, 8).astype(np.float32),
    }
    batch = sharding.shard_batch(host, mesh)
    inputs = batch["inputs"]
    assert inputs.shape == (8, 4) and inputs.dtype == np.int32
    assert inputs.sharding.spec == P(("data", "fsdp"))
    assert batch["example_weights"].sharding.spec == P(("data", "fsdp"))
    # 4 batch shards of 2 rows, each replicated over tensor: device d holds rows of its index.
    for shard in inputs.addressable_shards:
        assert shard.data.shape == (2, 4)
        np.testing.assert_array_equal(np.asarray(shard.data), host["inputs"][shard.index])
    np.testing.assert_array_equal(np.asarray(inputs), host["inputs"])
    with pytest.raises(ValueError, match=r"batch\['inputs'\] with local shape \(6, 4\)"):
        sharding.shard_batch({"inputs": host["inputs"][:6]}, mesh)


# ----------------------------------------------------------------------------- activations


def test_constrain_sets_activation_sharding():
    mesh = sharding.make_mesh(MESHES["2x2x2"])
    x = jnp.arange(8 * 4, dtype=jnp.float32).reshape(8, 4)
    # No mesh and no rules: a no-op, usable in single-device code.
    np.testing.assert_array_equal(sharding.constrain(x, ("batch", "mlp")), x)
    with sharding.sharding_context(mesh):
        out = jax.jit(lambda v: sharding.constrain(v * 2, ("batch", "mlp")))(x)
        with pytest.raises(ValueError, match="logical axis name 'hiden'"):
            jax.jit(lambda v: sharding.constrain(v, ("batch", "hiden")))(x)
    assert out.sharding.spec == P(("data", "fsdp"), "tensor")
    np.testing.assert_array_equal(np.asarray(out), 2 * np.asarray(x))


def test_cpu_devices_hint_names_a_device_count_the_batch_allows():
    hint = sharding.cpu_devices_hint(12, 1, "cpu", 1, cores=2)
    assert "--devices_per_process 2" in hint and "2-core" in hint
    # 8 cores, batch 12 with 2 microbatches: 6 devices x 2 microbatches divide 12, 7 and 8 not.
    assert "--devices_per_process 6" in sharding.cpu_devices_hint(12, 2, "cpu", 1, cores=8)
    assert "--devices_per_process 3" in sharding.cpu_devices_hint(12, 2, "cpu", 1, cores=5)
    assert "--devices_per_process 8" in sharding.cpu_devices_hint(64, 1, "cpu", 1, cores=32)
    assert sharding.cpu_devices_hint(7, 1, "cpu", 1, cores=4) is None  # no split divides 7
    assert sharding.cpu_devices_hint(12, 1, "cpu", 2, cores=2) is None  # already split
    assert sharding.cpu_devices_hint(12, 1, "cpu", 1, cores=1) is None
    assert sharding.cpu_devices_hint(12, 1, "gpu", 1, cores=16) is None


# ----------------------------------------------------------------------------- context


def _decoder(**fields):
    values = dict(vocab_size=32, num_layers=1, d_model=16, num_heads=2, d_ff=32,
                  attention_backend="reference")
    return ModelConfig.decoder_only(**{**values, **fields})


@pytest.mark.parametrize(
    "fields, seq_len, match",
    [
        ({"position_scheme": "relative", "context_parallel": "ring"}, 16,
         r"model.position_scheme='relative' with model.context_parallel='ring' with "
         r"mesh.context=4: .* use context_parallel='all_gather'"),
        ({"attention_backend": "cpu"}, 16,
         r"model.attention_backend='cpu' with mesh.context=4: .* use 'auto', 'reference' or "
         r"'flex'"),
        ({"attention_dropout_rate": 0.1}, 16,
         r"model.attention_dropout_rate=0.1 with mesh.context=4: .* set it to 0"),
        ({}, 12, r"data.seq_len=12 with mesh.context=4: .* use a multiple of 8"),
    ],
)
def test_context_parallelism_refuses_what_it_cannot_run(fields, seq_len, match):
    sizes = {"data": 2, "fsdp": 1, "context": 4, "tensor": 1}
    with pytest.raises(ConfigError, match=match):
        sharding.check_context(_decoder(**fields), sizes, seq_len)
    sharding.check_context(_decoder(**fields), {**sizes, "context": 1}, seq_len)  # no split


def test_context_parallelism_accepts_every_position_bias_and_encoder_decoders():
    sizes = {"data": 1, "fsdp": 1, "context": 8, "tensor": 1}
    for scheme in ("rope", "alibi", "t5_bias", "learned", "kerple_log", "fire"):
        sharding.check_context(_decoder(position_scheme=scheme, local_window=4), sizes, 64)
        for strategy in ("all_gather", "ring"):  # flex per chunk or per ring pair
            sharding.check_context(_decoder(position_scheme=scheme, attention_backend="flex",
                                            context_parallel=strategy), sizes, 64)
    sharding.check_context(_decoder(position_scheme="relative"), sizes, 64)  # Shaw: all_gather
    seq2seq = ModelConfig(vocab_size=32, num_encoder_layers=1, num_decoder_layers=1, d_model=16,
                          num_heads=2, d_ff=32, attention_backend="reference")
    sharding.check_context(seq2seq, sizes, 64)
    sharding.check_context(seq2seq, sizes, 64, source_seq_len=24)  # 8 contiguous chunks
    with pytest.raises(ConfigError, match=r"^data.source_seq_len=20 with mesh.context=8: the "
                                          r"encoder's rows .* use a multiple of 8$"):
        sharding.check_context(seq2seq, sizes, 64, source_seq_len=20)
    with pytest.raises(ConfigError, match=r"^data.seq_len=20 with mesh.context=8: .* 16$"):
        sharding.check_context(seq2seq, sizes, 20, source_seq_len=24)
    encoder = seq2seq.replace(num_decoder_layers=0)
    with pytest.raises(ConfigError, match=r"^model.num_decoder_layers=0 with mesh.context=8"):
        sharding.check_context(encoder, sizes, 64)
    with pytest.raises(ConfigError, match=r"model.context_parallel='ulysses' is unknown"):
        with field_prefix("model"):
            _decoder(context_parallel="ulysses")
