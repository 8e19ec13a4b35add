"""tfm.training.prng's fused threefry is jax's threefry bit for bit: same hash, same draws, same
keys."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import mesh_utils
from jax.extend import random as jax_random
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tfm.training import prng


def test_hash_equals_jax_threefry_2x32():
    rng = np.random.default_rng(0)
    key = jnp.asarray(rng.integers(0, 2**32, 2, dtype=np.uint64).astype(np.uint32))
    hi, lo = (jnp.asarray(rng.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32))
              for _ in range(2))
    word0, word1 = prng.threefry2x32_hash(key, hi, lo)
    # jax's function hashes the pairs (count[i], count[n + i]) of a 2n-long count
    expected = jax_random.threefry_2x32(key, jnp.concatenate([hi, lo]))
    np.testing.assert_array_equal(np.concatenate([word0, word1]), expected)


@pytest.mark.parametrize("shape", [(), (1,), (7,), (3, 5), (2, 3, 4, 5), (64, 130)])
@pytest.mark.parametrize("bit_width", [8, 16, 32])
def test_random_bits_equal_jax_threefry(shape, bit_width):
    base = jax.random.PRNGKey(11)
    dtype = jnp.dtype(f"uint{bit_width}")
    fused = jax.random.bits(prng.fused_threefry_key(base), shape, dtype)
    np.testing.assert_array_equal(fused, jax.random.bits(base, shape, dtype))
    assert fused.dtype == dtype and fused.shape == shape


def test_derived_keys_and_distributions_equal_jax_threefry():
    base = jax.random.PRNGKey(5)
    fused = prng.fused_threefry_key(base)
    assert str(jax.random.key_impl(fused)) == str(prng.FUSED_THREEFRY)
    np.testing.assert_array_equal(jax.random.key_data(fused), base)
    for fused_key, jax_key in [
        (fused, base),
        (jax.random.fold_in(fused, 3), jax.random.fold_in(base, 3)),
        (jax.random.split(fused)[1], jax.random.split(base)[1]),
    ]:
        np.testing.assert_array_equal(jax.random.key_data(fused_key), jax_key)
        for draw in (
            lambda k: jax.random.bernoulli(k, 0.8, (6, 33)),
            lambda k: jax.random.uniform(k, (6, 33)),
            lambda k: jax.random.normal(k, (4, 9)),
            lambda k: jax.random.randint(k, (50,), 0, 1000),
        ):
            np.testing.assert_array_equal(draw(fused_key), draw(jax_key))


def test_jitted_and_sharded_draws_equal_jax_threefry():
    """Under jit, with the mask laid out over 8 devices, the draws do not depend on the mesh."""
    mesh = Mesh(mesh_utils.create_device_mesh((4, 2)), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec("data", "model"))

    @jax.jit
    def masks(key_data):
        fused = jax.random.bernoulli(prng.fused_threefry_key(key_data), 0.5, (16, 24))
        return jax.lax.with_sharding_constraint(fused, sharding)

    key_data = jax.random.PRNGKey(2)
    sharded = masks(key_data)
    assert sharded.sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_array_equal(sharded, jax.random.bernoulli(key_data, 0.5, (16, 24)))


def test_a_typed_threefry_key_converts_and_other_generators_are_refused():
    typed = jax.random.key(9)
    np.testing.assert_array_equal(
        jax.random.key_data(prng.fused_threefry_key(typed)), jax.random.PRNGKey(9)
    )
    with pytest.raises(Exception, match="shape"):
        prng.fused_threefry_key(jax.random.key(0, impl="rbg"))


def test_jax_original_threefry_layout_is_followed_too():
    """With jax_threefry_partitionable off, jax lays the counters out differently; the fused key
    then hands the draw to jax's implementation, so the bits still agree."""
    base = jax.random.PRNGKey(4)
    previous = jax.config.jax_threefry_partitionable
    jax.config.update("jax_threefry_partitionable", False)
    try:
        np.testing.assert_array_equal(
            jax.random.bits(prng.fused_threefry_key(base), (5, 7)), jax.random.bits(base, (5, 7))
        )
    finally:
        jax.config.update("jax_threefry_partitionable", previous)
