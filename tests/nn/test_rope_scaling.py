"""RoPE scalings against their defining properties and against Hugging Face's
ROPE_INIT_FUNCTIONS (reference vectors in tests/fixtures/rope_scaling.json, written by
tests/fixtures/make_rope_scaling.py where transformers is installed)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import numpy as np
import pytest

from tfm.checks import ConfigError
from tfm.nn import rope_scaling as rs

FIXTURE = Path(__file__).parents[1] / "fixtures" / "rope_scaling.json"
D, BASE = 64, 10000.0


def plain() -> np.ndarray:
    return BASE ** (-np.arange(0, D, 2) / D)


def test_linear_and_ntk_follow_their_formulas():
    linear = rs.static_frequencies(rs.RopeScaling("linear", factor=4.0), D, BASE)
    np.testing.assert_allclose(linear * 4.0, plain(), rtol=1e-12)
    ntk = rs.static_frequencies(rs.RopeScaling("ntk", factor=4.0), D, BASE)
    # The base grows by s^(d/(d-2)): the lowest frequency is then exactly the linear one.
    assert ntk[0] == 1.0
    np.testing.assert_allclose(ntk[-1], plain()[-1] / 4.0, rtol=1e-12)


def test_yarn_extrapolates_fast_dimensions_and_interpolates_slow_ones():
    scaling = rs.RopeScaling("yarn", factor=8.0, original_max_len=2048)
    yarn = rs.static_frequencies(scaling, D, BASE)
    rotations = 2048 * plain() / (2 * math.pi)  # turns each dimension makes over L0
    fast, slow = rotations > 32 + 1, rotations < 1 / 1.5  # clear of the rounded ramp ends
    assert fast.any() and slow.any()
    np.testing.assert_allclose(yarn[fast], plain()[fast], rtol=1e-12)
    np.testing.assert_allclose(yarn[slow], plain()[slow] / 8.0, rtol=1e-12)
    between = ~fast & ~slow
    assert np.all((yarn[between] <= plain()[between]) & (yarn[between] >= plain()[between] / 8))
    assert rs.attention_factor(scaling) == pytest.approx(0.1 * math.log(8.0) + 1)
    both = rs.RopeScaling("yarn", factor=8.0, mscale=0.707, mscale_all_dim=0.707)
    assert rs.attention_factor(both) == pytest.approx(1.0)


def test_dynamic_is_plain_up_to_the_original_context_and_ntk_like_past_it():
    scaling = rs.RopeScaling("dynamic", factor=2.0, original_max_len=512)
    at = jax.jit(lambda length: rs.frequencies_at(scaling, D, BASE, length))
    np.testing.assert_allclose(at(100), plain(), rtol=2e-6)
    np.testing.assert_allclose(at(512), plain(), rtol=2e-6)
    # At L = 2 L0 with s = 2 the base is b (2 * 2 - 1)^(d/(d-2)) = b 3^(d/(d-2)).
    expected = (BASE * 3.0 ** (D / (D - 2))) ** (-np.arange(0, D, 2) / D)
    np.testing.assert_allclose(at(1024), expected, rtol=2e-6)
    np.testing.assert_allclose(rs.static_frequencies(scaling, D, BASE), plain(), rtol=1e-12)


def test_longrope_switches_factors_past_the_original_context():
    short, long = tuple(np.linspace(1, 2, D // 2)), tuple(np.linspace(1, 30, D // 2))
    scaling = rs.RopeScaling("longrope", factor=16.0, original_max_len=4096,
                             short_factor=short, long_factor=long)
    np.testing.assert_allclose(rs.frequencies_at(scaling, D, BASE, 4096), plain() / short,
                               rtol=2e-6)
    np.testing.assert_allclose(rs.frequencies_at(scaling, D, BASE, 4097), plain() / long,
                               rtol=2e-6)
    assert rs.attention_factor(scaling) == pytest.approx(
        math.sqrt(1 + math.log(16.0) / math.log(4096)))


@pytest.mark.parametrize("bad, field", [
    (rs.RopeScaling("yaarn"), "rope_scaling='yaarn' is unknown"),
    (rs.RopeScaling("yarn", factor=0.5), "rope_scaling_factor"),
    (rs.RopeScaling("yarn", factor=2.0, beta_fast=1.0, beta_slow=2.0), "rope_beta_fast"),
    (rs.RopeScaling("longrope", short_factor=(1.0,), long_factor=(1.0,)), "rope_short_factor"),
])
def test_bad_settings_name_the_field(bad, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        bad.check(D)


def _reference_cases() -> list[dict]:
    if not FIXTURE.exists():
        return []
    return json.loads(FIXTURE.read_text())["cases"]


@pytest.mark.parametrize("case", _reference_cases(), ids=lambda case: case["name"])
def test_equals_hugging_face(case):
    scaling = rs.RopeScaling(**{k: tuple(v) if isinstance(v, list) else v
                                for k, v in case["scaling"].items()})
    rotated, base = case["rotated"], case["base"]
    if case["length"] is None:
        ours = rs.static_frequencies(scaling, rotated, base)
    else:
        ours = rs.frequencies_at(scaling, rotated, base, case["length"])
    np.testing.assert_allclose(np.asarray(ours, np.float64), case["inv_freq"], rtol=1e-6)
    assert rs.attention_factor(scaling) == pytest.approx(case["attention_factor"], rel=1e-6)


def test_reference_vectors_are_committed():
    assert len(_reference_cases()) >= 8, f"regenerate {FIXTURE} with make_rope_scaling.py"
