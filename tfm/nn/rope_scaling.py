"""RoPE's long-context scalings: the rotation frequencies and the attention factor each one
defines, by name, as the models that use them define them (Hugging Face's `rope_scaling`
types are the reference: tests/fixtures/rope_scaling.json).

A scaling maps (rotated dimensions d, base b, the current length L) to inverse frequencies
[d / 2] and an attention factor m that multiplies the rotated parts of queries and keys (so
their logits by m^2), as Hugging Face scales cos and sin:

- none:     b^(-2i/d).
- linear:   position interpolation, frequencies / s (Chen et al. 2023).
- ntk:      the "NTK-aware" base b s^(d/(d-2)), static (bloc97, 2023).
- dynamic:  NTK with the base grown from the current length L > L0:
            b ((s L / L0) - (s - 1))^(d/(d-2)); at L <= L0 the plain frequencies (emozilla,
            2023). L changes while decoding: keys already in the cache keep the rotation of the
            length at which they were written, as in Hugging Face's generate.
- yarn:     each frequency blended between interpolation (/ s) and extrapolation by a ramp over
            the dimensions whose wavelengths make between beta_fast and beta_slow rotations in
            L0; m = 0.1 ln(s) + 1, or the ratio of two such terms with mscale / mscale_all_dim
            (Peng et al. 2023).
- longrope: per-dimension factors, short_factor up to L0 and long_factor past it;
            m = sqrt(1 + ln(s) / ln(L0)) (Ding et al. 2024; Phi-3).
- llama3:   low frequencies / s, high ones kept, a smooth blend between (Llama 3.1).

`s` is the scaling factor, L0 the original (pre-training) context. Static scalings return numpy
(float64); length-dependent ones (dynamic, longrope) accept a traced length and return a float32
jax array, computed as Hugging Face computes them.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from tfm.checks import ConfigError

ROPE_SCALINGS = ("none", "linear", "ntk", "dynamic", "yarn", "longrope", "llama3")
LENGTH_DEPENDENT = ("dynamic", "longrope")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """One RoPE scaling and its parameters (zero or empty: the kind's own default)."""

    kind: str = "none"
    factor: float = 1.0  # s
    original_max_len: int = 8192  # L0, the context the model was trained at
    low_freq_factor: float = 1.0  # llama3: wavelengths above L0 / low_freq_factor are scaled
    high_freq_factor: float = 4.0  # llama3: wavelengths below L0 / high_freq_factor are kept
    beta_fast: float = 32.0  # yarn: dimensions making more rotations in L0 extrapolate
    beta_slow: float = 1.0  # yarn: dimensions making fewer rotations in L0 interpolate
    mscale: float = 0.0  # yarn: with mscale_all_dim, m = mscale(s, mscale) / mscale(s, all_dim)
    mscale_all_dim: float = 0.0
    truncate: bool = True  # yarn: round the ramp's ends to whole dimensions
    attention_factor: float = 0.0  # m set explicitly; 0: the kind's default
    short_factor: tuple[float, ...] = ()  # longrope, one per frequency
    long_factor: tuple[float, ...] = ()

    def check(self, rotated: int) -> None:
        """Raises ConfigError naming the model field (`rope_...`) that is out of range."""
        if self.kind not in ROPE_SCALINGS:
            raise ConfigError(
                f"rope_scaling={self.kind!r} is unknown; choose one of: {', '.join(ROPE_SCALINGS)}"
            )
        if self.kind in ("dynamic", "yarn") and not self.factor >= 1.0:
            raise ConfigError(
                f"rope_scaling_factor={self.factor!r} must be >= 1 for rope_scaling={self.kind!r}"
            )
        if not self.factor > 0:
            raise ConfigError(f"rope_scaling_factor={self.factor!r} must be > 0")
        if not self.original_max_len > 0:
            raise ConfigError(f"rope_original_max_len={self.original_max_len!r} must be > 0")
        if self.attention_factor < 0:
            raise ConfigError(f"rope_attention_factor={self.attention_factor!r} must be >= 0")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ConfigError(
                f"rope_high_freq_factor={self.high_freq_factor} must be > rope_low_freq_factor="
                f"{self.low_freq_factor} > 0 for rope_scaling='llama3'"
            )
        if self.kind == "yarn" and not self.beta_fast > self.beta_slow > 0:
            raise ConfigError(
                f"rope_beta_fast={self.beta_fast} must be > rope_beta_slow={self.beta_slow} > 0 "
                "for rope_scaling='yarn'"
            )
        if self.kind == "longrope":
            for name in ("short_factor", "long_factor"):
                values = getattr(self, name)
                if len(values) != rotated // 2 or min(values, default=0) <= 0:
                    raise ConfigError(
                        f"rope_{name} must hold {rotated // 2} positive numbers (one per "
                        f"frequency of {rotated} rotated dimensions); got {len(values)}"
                    )


def _plain(rotated: int, base: float) -> np.ndarray:
    return base ** (-np.arange(0, rotated, 2, dtype=np.float64) / rotated)


def _llama3(scaling: RopeScaling, inv_freq: np.ndarray) -> np.ndarray:
    s, context = scaling.factor, scaling.original_max_len
    wavelength = 2 * np.pi / inv_freq
    low_wavelength = context / scaling.low_freq_factor
    high_wavelength = context / scaling.high_freq_factor
    scaled = np.where(wavelength > low_wavelength, inv_freq / s, inv_freq)
    smooth = (context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / s + smooth * scaled
    medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return np.where(medium, blended, scaled)


def _yarn_dimension(rotations: float, rotated: int, base: float, context: int) -> float:
    """The (fractional) dimension index whose wavelength makes `rotations` turns in `context`."""
    return rotated * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))


def _yarn(scaling: RopeScaling, rotated: int, base: float) -> np.ndarray:
    context = scaling.original_max_len
    low = _yarn_dimension(scaling.beta_fast, rotated, base, context)
    high = _yarn_dimension(scaling.beta_slow, rotated, base, context)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotated - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    interpolate = np.clip((np.arange(rotated // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    inv_freq = _plain(rotated, base)
    return inv_freq / scaling.factor * interpolate + inv_freq * (1 - interpolate)


def _yarn_mscale(s: float, mscale: float = 1.0) -> float:
    return 1.0 if s <= 1 else 0.1 * mscale * math.log(s) + 1.0


def attention_factor(scaling: RopeScaling) -> float:
    """m, the factor on the rotated parts of queries and keys (1 for most kinds)."""
    if scaling.attention_factor:
        return scaling.attention_factor
    if scaling.kind == "yarn":
        if scaling.mscale and scaling.mscale_all_dim:
            return _yarn_mscale(scaling.factor, scaling.mscale) / _yarn_mscale(
                scaling.factor, scaling.mscale_all_dim
            )
        return _yarn_mscale(scaling.factor)
    if scaling.kind == "longrope" and scaling.factor > 1:
        return math.sqrt(1 + math.log(scaling.factor) / math.log(scaling.original_max_len))
    return 1.0


def static_frequencies(scaling: RopeScaling, rotated: int, base: float) -> np.ndarray:
    """Inverse frequencies [rotated // 2] (float64) of a scaling that ignores the length; for
    dynamic and longrope, those at lengths up to the original context."""
    inv_freq = _plain(rotated, base)
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "ntk":
        return _plain(rotated, base * scaling.factor ** (rotated / (rotated - 2)))
    if scaling.kind == "llama3":
        return _llama3(scaling, inv_freq)
    if scaling.kind == "yarn":
        return _yarn(scaling, rotated, base)
    if scaling.kind == "longrope":
        return inv_freq / np.asarray(scaling.short_factor, np.float64)
    return inv_freq


def frequencies_at(scaling: RopeScaling, rotated: int, base: float, length: jax.Array) -> jax.Array:
    """Inverse frequencies [rotated // 2] (float32) of a length-dependent scaling at `length`
    (a scalar int, traced or not: the largest position in the call + 1, as Hugging Face takes
    it)."""
    length = jnp.asarray(length, jnp.float32)
    exponents = jnp.arange(0, rotated, 2, dtype=jnp.float32) / rotated
    context = float(scaling.original_max_len)
    if scaling.kind == "dynamic":
        grown = jnp.maximum(length, context)
        s = scaling.factor
        new_base = base * ((s * grown / context) - (s - 1)) ** (rotated / (rotated - 2))
        return 1.0 / new_base**exponents
    if scaling.kind == "longrope":
        short = jnp.asarray(scaling.short_factor, jnp.float32)
        long = jnp.asarray(scaling.long_factor, jnp.float32)
        factors = jnp.where(length > context, long, short)
        return 1.0 / (factors * jnp.float32(base) ** exponents)
    raise ValueError(f"rope_scaling={scaling.kind!r} does not depend on the length")
