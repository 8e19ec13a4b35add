"""Tests for tfm/nn/positions.py: values against formulas, naive numpy loops and invariants."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tfm.checks import ConfigError
from tfm.nn import positions as P
from tfm.nn.positions import POSITION_SCHEMES

RNG = np.random.default_rng(0)
# Jitted once per shape: far fewer compilations than op-by-op eager dispatch.
sinusoidal = jax.jit(P.sinusoidal, static_argnames=("dim", "layout"))
apply_rope = jax.jit(P.apply_rope, static_argnames=("base", "layout", "fraction"))
alibi_bias = jax.jit(P.alibi_bias)
t5_relative_bucket = jax.jit(
    P.t5_relative_bucket, static_argnames=("bidirectional", "num_buckets", "max_distance")
)
t5_bias = jax.jit(P.t5_bias, static_argnames=("bidirectional", "num_buckets", "max_distance"))
relative_indices = jax.jit(P.relative_indices, static_argnames=("max_distance",))
shaw_logit_bias = jax.jit(P.shaw_logit_bias)
shaw_value_term = jax.jit(P.shaw_value_term)


def paper_table_f64(positions: np.ndarray, dim: int) -> np.ndarray:
    i = np.arange(dim // 2)
    angle = positions[..., None].astype(np.float64) / 10000.0 ** (2 * i / dim)
    return np.stack([np.sin(angle), np.cos(angle)], axis=-1).reshape(*positions.shape, dim)


# ---------------------------------------------------------------- sinusoidal


def test_sinusoidal_paper_matches_formula_including_huge_positions():
    dim = 16
    positions = np.array([[0, 1, 7, 123, 4097], [10**5, 10**6, 2**24 + 1, 3, 2**31 - 1]])
    out = np.asarray(sinusoidal(positions, dim, layout="paper"))
    expected = paper_table_f64(positions, dim)
    assert out.dtype == np.float32 and out.shape == (2, 5, dim)
    # Exact reduction in turns keeps float32 at ~1e-6 everywhere (float32 sin/cos themselves).
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0)
    # The tolerance has teeth: a naive float32 angle pos * inv_freq is far off at 1e6.
    inv_freq = (10000.0 ** (-2 * np.arange(dim // 2) / dim)).astype(np.float32)
    naive = np.sin(np.float32(10**6) * inv_freq)
    assert np.abs(naive - expected[1, 1, 0::2]).max() > 1e-3


def test_sinusoidal_concat_formula_and_not_a_permutation_of_paper():
    dim, positions = 8, np.array([[0, 5, 77, 10**6]])
    i = np.arange(dim // 2)
    angle = positions[..., None] * 10000.0 ** (-i / (dim // 2 - 1))
    expected = np.concatenate([np.sin(angle), np.cos(angle)], axis=-1)
    out = np.asarray(sinusoidal(positions, dim, layout="concat"))
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=0)
    paper = paper_table_f64(positions, dim)
    assert not np.allclose(np.sort(out[0, 2]), np.sort(paper[0, 2]), atol=1e-3)


def test_sinusoidal_explicit_positions_are_rows_of_the_arange_table():
    table = np.asarray(sinusoidal(np.arange(20)[None], 12))[0]
    offsets = np.array([0, 3, 11])
    positions = offsets[:, None] + np.arange(6)[None]  # decoding at per-row offsets
    out = np.asarray(sinusoidal(jnp.asarray(positions, jnp.int32), 12))
    np.testing.assert_array_equal(out, table[positions])
    packed = np.array([[0, 1, 2, 0, 1, 0]])  # positions restart per packed segment
    np.testing.assert_array_equal(np.asarray(sinusoidal(packed, 12))[0], table[packed[0]])


def test_sinusoidal_rejects_bad_arguments():
    with pytest.raises(ValueError, match="dim=7"):
        P.sinusoidal(np.arange(3)[None], 7)
    with pytest.raises(ValueError, match="layout='half'"):
        P.sinusoidal(np.arange(3)[None], 8, layout="half")
    with pytest.raises(ValueError, match="integer"):
        P.sinusoidal(np.arange(3.0)[None], 8)


# ---------------------------------------------------------------- learned


def test_learned_lookup_concrete_in_range_and_out_of_range():
    table = jnp.asarray(RNG.normal(size=(5, 3)), jnp.float32)
    positions = np.array([[0, 4, 2], [1, 1, 3]])
    np.testing.assert_array_equal(P.learned_lookup(table, positions), np.asarray(table)[positions])
    with pytest.raises(ValueError, match=r"position 5 .*max_len=5"):
        P.learned_lookup(table, np.array([[0, 5]]))
    with pytest.raises(ValueError, match=r"position -1 .*max_len=5"):
        P.learned_lookup(table, jnp.array([[-1, 0]]))


def test_learned_lookup_traced_out_of_range_gives_nan_not_clipping():
    table = jnp.asarray(RNG.normal(size=(5, 3)), jnp.float32)
    out = np.asarray(jax.jit(P.learned_lookup)(table, jnp.array([[4, 5, -1, 0]])))
    np.testing.assert_array_equal(out[0, [0, 3]], np.asarray(table)[[4, 0]])
    assert np.isnan(out[0, 1]).all() and np.isnan(out[0, 2]).all()


# ---------------------------------------------------------------- RoPE

LAYOUTS = ("interleaved", "rotate_half")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rope_score_depends_only_on_offset(layout):
    heads, head_dim = 2, 8
    q, k = RNG.normal(size=(2, 1, 1, heads, head_dim)).astype(np.float32)
    shifts = np.array([0, 1, 5, 100, 4096, 10**6])
    count = len(shifts)

    def scores(m: int, n: int) -> np.ndarray:  # [shifts, heads]: q at m + shift, k at n + shift
        q_rot = apply_rope(np.repeat(q, count, 1), (m + shifts)[None], layout=layout)
        k_rot = apply_rope(np.repeat(k, count, 1), (n + shifts)[None], layout=layout)
        return np.asarray((q_rot * k_rot).sum(-1))[0]

    for m, n in [(3, 1), (0, 7), (9, 9)]:
        s = scores(m, n)
        np.testing.assert_allclose(s, np.broadcast_to(s[0], s.shape), atol=1e-4)
    assert np.abs(scores(3, 1)[0] - scores(0, 7)[0]).max() > 1e-2  # the offset does matter


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rope_norm_preserved_and_position_zero_is_identity(layout):
    x = jnp.asarray(RNG.normal(size=(2, 4, 3, 8)), jnp.float32)
    positions = np.array([[0, 0, 0, 0], [0, 9, 123, 70000]])
    out = apply_rope(x, positions, layout=layout)
    np.testing.assert_allclose(
        jnp.linalg.norm(out, axis=-1), jnp.linalg.norm(x, axis=-1), rtol=1e-5
    )
    np.testing.assert_array_equal(out[0], x[0])
    np.testing.assert_array_equal(out[1, 0], x[1, 0])
    assert not np.allclose(out[1, 1], x[1, 1])
    assert apply_rope(x.astype(jnp.bfloat16), positions, layout=layout).dtype == jnp.bfloat16


def test_rope_interleaved_matches_explicit_rotation_matrices():
    head_dim, base = 6, 100.0
    x = RNG.normal(size=(1, 3, 2, head_dim))
    positions = np.array([[0, 2, 50]])
    out = np.asarray(
        apply_rope(jnp.asarray(x, jnp.float32), positions, base=base, layout="interleaved")
    )
    expected = np.zeros_like(x)
    for t, pos in enumerate(positions[0]):
        rotation = np.zeros((head_dim, head_dim))
        for i in range(head_dim // 2):
            a = pos * base ** (-2 * i / head_dim)
            rotation[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = [
                [np.cos(a), -np.sin(a)],
                [np.sin(a), np.cos(a)],
            ]
        expected[0, t] = x[0, t] @ rotation.T
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_rope_layouts_agree_up_to_a_permutation():
    head_dim = 8
    x = jnp.asarray(RNG.normal(size=(2, 3, 2, head_dim)), jnp.float32)
    positions = np.array([[0, 4, 17], [2, 3, 1000]])
    # Interleaved pair (2i, 2i+1) must land on rotate-half pair (i, i + head_dim/2).
    perm = np.array([0, 2, 4, 6, 1, 3, 5, 7])
    inverse = np.argsort(perm)
    via_half = apply_rope(x[..., perm], positions, layout="rotate_half")[..., inverse]
    interleaved = apply_rope(x, positions, layout="interleaved")
    np.testing.assert_allclose(via_half, interleaved, atol=1e-6)
    assert not np.allclose(apply_rope(x, positions, layout="rotate_half"), interleaved)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rope_partial_fraction_rotates_only_the_first_dims(layout):
    x = jnp.asarray(RNG.normal(size=(1, 3, 2, 8)), jnp.float32)
    positions = np.array([[1, 5, 30]])
    out = apply_rope(x, positions, layout=layout, fraction=0.5)
    np.testing.assert_array_equal(out[..., 4:], x[..., 4:])
    np.testing.assert_allclose(
        out[..., :4], apply_rope(x[..., :4], positions, layout=layout), atol=1e-6
    )
    assert not np.allclose(out[..., :4], x[..., :4])
    with pytest.raises(ValueError, match="fraction=0.375"):
        P.apply_rope(x, positions, fraction=0.375)  # 3 dims: odd
    with pytest.raises(ValueError, match="layout='neox'"):
        P.apply_rope(x, positions, layout="neox")


# ---------------------------------------------------------------- ALiBi


def test_alibi_slopes_verified_values():
    np.testing.assert_array_equal(P.alibi_slopes(8), [2.0**-k for k in range(1, 9)])
    eight = [2.0**-k for k in range(1, 9)]
    np.testing.assert_allclose(
        P.alibi_slopes(12), eight + [0.707107, 0.353553, 0.176777, 0.088388], atol=1e-6
    )
    np.testing.assert_allclose(
        P.alibi_slopes(6), [0.25, 0.0625, 0.015625, 0.003906, 0.5, 0.125], atol=1e-6
    )
    np.testing.assert_array_equal(P.alibi_slopes(1), [2.0**-8])


def test_alibi_bias_by_hand():
    slopes = P.alibi_slopes(2)  # 1/16, 1/256
    query, key = np.array([[0, 3], [5, 6]]), np.array([[0, 1, 3], [2, 6, 9]])
    out = np.asarray(alibi_bias(query, key, slopes))
    assert out.shape == (2, 2, 2, 3)
    for b, n, t, s in np.ndindex(out.shape):
        assert out[b, n, t, s] == -slopes[n] * abs(query[b, t] - key[b, s])
    assert out[0, 0, 1, 0] == -3 / 16 and out[1, 1, 0, 2] == -4 / 256


# ---------------------------------------------------------------- T5

OFFSETS = [0, 1, -1, 8, -8, 16, -16, 32, -32, 127, -127, 500, -500]


def test_t5_buckets_verified_values():
    bidirectional = t5_relative_bucket(np.array(OFFSETS), bidirectional=True)
    causal = t5_relative_bucket(np.array(OFFSETS), bidirectional=False)
    assert bidirectional.dtype == jnp.int32
    assert bidirectional.tolist() == [0, 17, 1, 24, 8, 26, 10, 28, 12, 31, 15, 31, 15]
    assert causal.tolist() == [0, 0, 1, 0, 8, 0, 16, 0, 21, 0, 31, 0, 31]


def naive_bucket(offset: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    bucket = 0
    if bidirectional:
        num_buckets //= 2
        bucket = num_buckets if offset > 0 else 0
        distance = abs(offset)
    else:
        distance = max(-offset, 0)
    max_exact = num_buckets // 2
    if distance < max_exact:
        return bucket + distance
    large = max_exact + int(
        math.log(distance / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    )
    return bucket + min(large, num_buckets - 1)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_buckets_match_float64_reference_over_a_range(bidirectional):
    offsets = np.arange(-300, 301)
    for num_buckets, max_distance in [(32, 128), (16, 40)]:
        out = t5_relative_bucket(
            offsets, bidirectional=bidirectional, num_buckets=num_buckets, max_distance=max_distance
        )
        expected = [naive_bucket(o, bidirectional, num_buckets, max_distance) for o in offsets]
        assert out.tolist() == expected


def test_t5_bias_gathers_table_entries():
    num_buckets, heads = 8, 3
    table = RNG.normal(size=(num_buckets, heads)).astype(np.float32)
    query, key = np.array([[0, 4, 20]]), np.array([[0, 1, 9, 30]])
    out = np.asarray(
        t5_bias(
            jnp.asarray(table),
            query,
            key,
            bidirectional=True,
            num_buckets=num_buckets,
            max_distance=16,
        )
    )
    assert out.shape == (1, heads, 3, 4)
    for _, n, t, s in np.ndindex(out.shape):
        bucket = naive_bucket(key[0, s] - query[0, t], True, num_buckets, 16)
        assert out[0, n, t, s] == table[bucket, n]


# ---------------------------------------------------------------- Shaw et al.


def test_relative_indices_clip_at_max_distance():
    out = relative_indices(np.array([[0, 5]]), np.array([[0, 1, 4, 9]]), max_distance=2)
    # key - query: [[0, 1, 4, 9], [-5, -4, -1, 4]] -> clip to [-2, 2] -> + 2
    assert out.tolist() == [[[2, 3, 4, 4], [0, 0, 1, 4]]]


def test_shaw_logit_and_value_terms_match_naive_loops():
    batch, q_len, k_len, heads, head_dim, k = 2, 3, 5, 2, 4, 2
    query = RNG.normal(size=(batch, q_len, heads, head_dim)).astype(np.float32)
    key_table = RNG.normal(size=(2 * k + 1, head_dim)).astype(np.float32)
    value_table = RNG.normal(size=(2 * k + 1, head_dim)).astype(np.float32)
    weights = RNG.random(size=(batch, heads, q_len, k_len)).astype(np.float32)
    q_pos = np.array([[0, 1, 2], [4, 5, 6]])
    k_pos = np.array([[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]])  # row 1 reaches offset -6: clipped
    rel_idx = relative_indices(q_pos, k_pos, k)
    logits = np.asarray(shaw_logit_bias(jnp.asarray(query), jnp.asarray(key_table), rel_idx, 0.5))
    values = np.asarray(shaw_value_term(jnp.asarray(weights), jnp.asarray(value_table), rel_idx))
    expected_logits = np.zeros((batch, heads, q_len, k_len))
    expected_values = np.zeros((batch, q_len, heads, head_dim))
    for b, t, s, n in np.ndindex(batch, q_len, k_len, heads):
        r = min(max(k_pos[b, s] - q_pos[b, t], -k), k) + k
        expected_logits[b, n, t, s] = 0.5 * query[b, t, n] @ key_table[r]
        expected_values[b, t, n] += weights[b, n, t, s] * value_table[r]
    np.testing.assert_allclose(logits, expected_logits, atol=1e-5)
    np.testing.assert_allclose(values, expected_values, atol=1e-5)
    assert int(rel_idx[1, 2, 0]) == 0  # offset -6 clipped to -k


# ---------------------------------------------------------------- registry


def test_registry_matches_config_and_rejects_unknown_names():
    assert tuple(P.SCHEMES) == POSITION_SCHEMES
    assert P.get_scheme("rope").kind == "rotary" and P.get_scheme("alibi").kind == "bias"
    kinds = {"none", "embedding", "rotary", "bias", "relative"}
    assert {scheme.kind for scheme in P.SCHEMES.values()} == kinds
    with pytest.raises(
        ConfigError,
        match="position_scheme='rotary' is unknown; choose one of: "
        "none, sinusoidal, learned, rope, relative, t5_bias, "
        "alibi",
    ):
        P.get_scheme("rotary")


def test_each_scheme_has_the_hook_of_its_kind():
    hooks = {"embedding": "embedding", "bias": "block_bias", "rotary": "rotate",
             "relative": "relative"}
    for scheme in P.SCHEMES.values():
        present = {hook for hook in hooks.values() if getattr(scheme, hook) is not None}
        assert present == ({hooks[scheme.kind]} if scheme.kind in hooks else set()), scheme.name
    assert [s.name for s in P.SCHEMES.values() if s.bounded_by_max_len] == ["learned"]


def _distance_block_bias(config, bidirectional, param):
    """A per-head learned slope times minus the distance (an ALiBi with learned slopes)."""
    slopes = param("distance_slope", (config.num_heads,), 0.5, ("heads",))

    def function(head_params, query_positions, key_positions):
        (slope,) = head_params  # [1, 1]
        return -slope * jnp.abs(key_positions - query_positions).astype(jnp.float32)

    return function, (slopes[:, None],)


def test_a_new_scheme_is_one_registry_entry(monkeypatch):
    """Adding a scheme touches tfm/nn/positions.py only: a new SCHEMES entry is accepted by the
    config, creates its parameter, biases the logits, and decodes with a KV cache like the
    full forward pass."""
    from tiny_model import TINY

    from tfm.nn.cache import init_cache
    from tfm.nn.config import ModelConfig
    from tfm.nn.models import DecoderLM

    entry = P.PositionScheme("distance", "bias", "learned slopes",
                              block_bias=_distance_block_bias, logit_bias_kind="learned")
    monkeypatch.setitem(P.SCHEMES, "distance", entry)
    config = ModelConfig(**{**TINY, "position_scheme": "distance", "num_encoder_layers": 0})
    model = DecoderLM(config)
    tokens = jnp.asarray(RNG.integers(3, config.vocab_size, (2, 6)), jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)["params"]
    params = jax.tree.map(lambda x: getattr(x, "value", x), params,
                          is_leaf=lambda x: hasattr(x, "value"))
    slopes = params["decoder"]["position_bias"]["distance_slope"]
    assert slopes.shape == (config.num_heads,)
    logits = model.apply({"params": params}, tokens)

    # Zero slopes: exactly the model without position information.
    flat = jax.tree.map(jnp.zeros_like, slopes)
    zeroed = {**params, "decoder": {**params["decoder"], "position_bias": {"distance_slope": flat}}}
    plain = {**params, "decoder": {k: v for k, v in params["decoder"].items()
                                   if k != "position_bias"}}
    np.testing.assert_allclose(
        model.apply({"params": zeroed}, tokens),
        DecoderLM(config.replace(position_scheme="none")).apply({"params": plain}, tokens),
        atol=1e-6,
    )
    unbiased = np.asarray(model.apply({"params": zeroed}, tokens))
    assert np.abs(np.asarray(logits) - unbiased).max() > 1e-3

    # Token by token through the cache: the same logits as the full pass.
    cache = init_cache(config, 2, tokens.shape[1])
    steps = []
    for t in range(tokens.shape[1]):
        step_logits, cache = model.apply({"params": params}, tokens[:, t : t + 1], cache=cache)
        steps.append(step_logits)
    np.testing.assert_allclose(np.concatenate(steps, axis=1), logits, atol=1e-5)


def test_rope_frequency_scalings():
    from tfm.nn.positions import rope_frequencies

    plain = rope_frequencies(8, 10000.0)
    np.testing.assert_allclose(plain, 10000.0 ** (-np.arange(0, 8, 2) / 8))
    np.testing.assert_allclose(rope_frequencies(8, 10000.0, "linear", 4.0), plain / 4)
    # NTK-aware: the highest frequency stays, the lowest is divided by exactly the factor.
    ntk = rope_frequencies(8, 10000.0, "ntk", 4.0)
    assert ntk[0] == plain[0] and ntk[-1] == pytest.approx(plain[-1] / 4, rel=1e-12)
    assert np.all(ntk[1:-1] < plain[1:-1]) and np.all(ntk[1:-1] > plain[1:-1] / 4)
    # Llama 3: wavelengths above original/low are divided by the factor, those below
    # original/high kept, the band between blended.
    llama3 = rope_frequencies(64, 500000.0, "llama3", 8.0, 8192, 1.0, 4.0)
    plain = rope_frequencies(64, 500000.0)
    wavelength = 2 * np.pi / plain
    low, high = wavelength > 8192, wavelength < 2048
    np.testing.assert_allclose(llama3[low], plain[low] / 8)
    np.testing.assert_array_equal(llama3[high], plain[high])
    middle = ~low & ~high
    assert middle.any() and np.all((llama3[middle] < plain[middle]) &
                                   (llama3[middle] > plain[middle] / 8))
    with pytest.raises(ValueError, match="scaling='yaarn' is unknown; choose one of: none, linear"):
        rope_frequencies(8, scaling="yaarn")


def test_log_length_scale_is_one_up_to_the_length_then_grows_with_its_log():
    from tfm.nn.positions import log_length_scale

    positions = np.array([[0, 63, 64, 255, 4095]])
    scale = np.asarray(log_length_scale(positions, 64))
    np.testing.assert_allclose(scale[0, :3], [1.0, 1.0, np.log(65) / np.log(64)], rtol=1e-6)
    np.testing.assert_allclose(scale[0, 3:], [np.log(256) / np.log(64), 2.0], rtol=1e-6)


def test_attention_log_length_scales_the_logits_of_late_queries_only():
    """Within the length the model is unchanged; past it only later tokens' outputs move, and a
    model whose queries are scaled by hand gives the same logits."""

    from tfm.nn.config import ModelConfig
    from tfm.nn.models import DecoderLM

    base = ModelConfig.decoder_only(32, 2, d_model=16, num_heads=2, d_ff=32,
                                    position_scheme="none")
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 32, (2, 40)), jnp.int32)
    params = DecoderLM(base).init(jax.random.key(0), tokens)
    plain = DecoderLM(base).apply(params, tokens)
    scaled = DecoderLM(base.replace(attention_log_length=16)).apply(params, tokens)
    np.testing.assert_allclose(scaled[:, :16], plain[:, :16], atol=1e-6)
    assert float(jnp.abs(scaled[:, 20:] - plain[:, 20:]).max()) > 1e-3
    with pytest.raises(ConfigError, match="attention_log_length=1 must be 0"):
        base.replace(attention_log_length=1)
