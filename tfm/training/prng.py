"""jax's Threefry-2x32 generator with its hash written out in jnp, so XLA fuses it.

On CPU, jax lowers the Threefry-2x32 hash of `jax.random` as a rolled loop: five passes that
each read and write whole arrays of counters, and the dropout mask is materialised afterwards.
For the ~270M dropout draws of one char-GPT training step that was ~3 s of a 20 s step.
`FUSED_THREEFRY` is the same generator (same key data, same split / fold_in, bit-identical
random bits for every shape and width; tests check this against jax) whose `random_bits` is the
20-round hash as plain unrolled uint32 arithmetic on the element counters, which XLA fuses into
one elementwise loop with the `bernoulli` comparison and the `where` that uses it.

    key = fused_threefry_key(jax.random.PRNGKey(0))    # a typed key; works anywhere jax keys do
    keep = jax.random.bernoulli(key, 0.9, shape)        # same mask as with PRNGKey(0), faster

The hash is Threefry-2x32 with 20 rounds (Salmon et al. 2011, "Parallel random numbers: as easy
as 1, 2, 3"), counters laid out as jax's partitionable threefry lays them out (the element's
row-major index as a 64-bit count split into two uint32 words), so the draws shard like jax's.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.extend import random as jax_random

_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # Threefry-2x32's rotation schedule
_KEY_PARITY = 0x1BD11BDA  # the constant of the key schedule's third word
_THREEFRY = jax_random.threefry_prng_impl  # jax's generator, whose keys and draws these are


def _rotate_left(x: jax.Array, bits: int) -> jax.Array:
    return (x << jnp.uint32(bits)) | (x >> jnp.uint32(32 - bits))


def threefry2x32_hash(
    key: jax.Array, counts_hi: jax.Array, counts_lo: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The Threefry-2x32 (20 rounds) block function, elementwise.

    key: uint32[2]; counts_hi, counts_lo: uint32 [...] (the two words of each counter)
    -> two uint32 [...] output words. Equals `jax.extend.random.threefry_2x32`'s hash."""
    schedule = (key[0], key[1], key[0] ^ key[1] ^ jnp.uint32(_KEY_PARITY))
    x0 = counts_hi + schedule[0]
    x1 = counts_lo + schedule[1]
    for block in range(5):  # 5 blocks of 4 rounds, a key injection after each
        for bits in _ROTATIONS[block % 2]:
            x0 = x0 + x1
            x1 = x0 ^ _rotate_left(x1, bits)
        x0 = x0 + schedule[(block + 1) % 3]
        x1 = x1 + schedule[(block + 2) % 3] + jnp.uint32(block + 1)
    return x0, x1


def _row_major_index(shape: tuple[int, ...]) -> jax.Array:
    """uint32 [*shape]: each element's row-major flat index (needs prod(shape) < 2**32)."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for axis in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, axis) * jnp.uint32(stride)
        stride *= shape[axis]
    return index


def _random_bits(key: jax.Array, bit_width: int, shape: tuple[int, ...]) -> jax.Array:
    """key: uint32[2] -> uint{bit_width} [*shape], as jax's partitionable threefry draws them."""
    if (
        not getattr(jax.config, "jax_threefry_partitionable", True)
        or math.prod(shape) >= 2**32
        or bit_width not in (8, 16, 32)
    ):  # jax's other layouts (and 64-bit draws): its own, rolled, implementation
        return _THREEFRY.random_bits(key, bit_width, shape)
    counts_lo = _row_major_index(tuple(shape))
    word0, word1 = threefry2x32_hash(key, jnp.zeros_like(counts_lo), counts_lo)
    bits = word0 ^ word1
    return bits if bit_width == 32 else bits.astype(jnp.dtype(f"uint{bit_width}"))


FUSED_THREEFRY = jax_random.define_prng_impl(
    key_shape=(2,),
    seed=_THREEFRY.seed,
    split=_THREEFRY.split,
    random_bits=_random_bits,
    fold_in=_THREEFRY.fold_in,
    name="fused_threefry2x32",
    tag="ffy",
)


def fused_threefry_key(key: jax.Array) -> jax.Array:
    """A threefry key (raw uint32[2] or typed) as a typed `FUSED_THREEFRY` key, same key data."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.key_data(key)
    return jax.random.wrap_key_data(key, impl=FUSED_THREEFRY)
