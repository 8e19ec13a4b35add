"""Position information for Transformers: pure functions and a registry by name.

Every function takes explicit integer position ids (`positions: [batch, length]`), so packed
sequences (positions restart per segment) and decoding at an offset work like plain `arange`.
Nothing here holds parameters; tables (learned, T5, Shaw) are passed in by the layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tfm import kernels
from tfm.checks import ConfigError
from tfm.kernels import block_bias
from tfm.kernels.block_bias import dense_from_blocks  # noqa: F401
from tfm.kernels.call import RelativeBias, RelativeValue
from tfm.nn import learned_biases, rope_scaling
from tfm.nn.shaw import (  # noqa: F401
    relative_indices,
    shaw_bias,
    shaw_logit_bias,
    shaw_value_term,
    shaw_values,
)

Array = jax.Array
ArrayLike = jax.Array | np.ndarray  # concrete or traced ids; numpy for static inputs


def _int_positions(positions: ArrayLike, name: str = "positions") -> Array:
    positions = jnp.asarray(positions)
    if not jnp.issubdtype(positions.dtype, jnp.integer):
        raise ValueError(f"{name} must be an integer array; got dtype {positions.dtype}")
    return positions.astype(jnp.int32)


def _sin_cos(positions: Array, inv_freq: np.ndarray) -> tuple[Array, Array]:
    """sin, cos of `positions[..., None] * inv_freq` in float32, ~1e-6 off at any int32 position.

    positions: [...] int32; inv_freq: [F] static -> two [..., F] arrays.
    A float32 product `pos * inv_freq` has an angle error of about |angle| * 2^-24 (plus the
    rounding of inv_freq itself): ~0.05 rad at pos = 1e6. So we reduce exactly, in turns:
    turns-per-position = fixed / 2^32 + residual with `fixed` a uint32; `pos * fixed` wraps
    modulo 2^32, which is exactly the fractional turn of that part, and `pos * residual` is
    below 0.25 turns. The angle fed to sin/cos is then in (-pi/2, 5pi/2) and off by ~1e-6 rad.
    """
    scaled = np.asarray(inv_freq, np.float64) / (2 * np.pi) * 2.0**32
    whole = np.round(scaled)
    fixed = jnp.asarray(np.mod(whole, 2.0**32).astype(np.uint32))
    residual = jnp.asarray(((scaled - whole) / 2.0**32).astype(np.float32))
    pos = positions[..., None]
    phase = (pos.astype(jnp.uint32) * fixed).astype(jnp.float32) * np.float32(2.0**-32)
    turns = phase + pos.astype(jnp.float32) * residual
    angle = np.float32(2 * np.pi) * turns
    return jnp.sin(angle), jnp.cos(angle)


def sinusoidal(
    positions: ArrayLike, dim: int, *, layout: str = "paper", max_timescale: float = 10000.0
) -> Array:
    """Fixed sinusoidal position encodings; positions: [..., T] int -> [..., T, dim] float32.

    layout="paper" (Vaswani et al. 2017, sec. 3.5): PE(pos, 2i) = sin(pos / max_timescale^(2i/dim)),
    PE(pos, 2i+1) = cos(same angle), interleaved.
    layout="concat" (tensor2tensor / Flax examples): [sin | cos] halves with inverse frequency
    max_timescale^(-i / (dim/2 - 1)), i = 0..dim/2-1. Its frequencies differ from the paper's
    (exponent over dim/2 - 1, not dim/2), so it is NOT a permutation of the paper's table.
    Works at any position (no table). Values are accurate to ~1e-6 even at pos = 1e6 (see _sin_cos).
    """
    if dim <= 0 or dim % 2:
        raise ValueError(f"dim={dim} must be a positive even number")
    if layout not in ("paper", "concat"):
        raise ValueError(f"layout={layout!r} is unknown; choose one of: paper, concat")
    half = dim // 2
    positions = _int_positions(positions)
    if layout == "paper":
        inv_freq = max_timescale ** (-2.0 * np.arange(half) / dim)
        sin, cos = _sin_cos(positions, inv_freq)
        return jnp.stack([sin, cos], axis=-1).reshape(*positions.shape, dim)
    inv_freq = max_timescale ** (-np.arange(half) / max(half - 1, 1))
    return jnp.concatenate(_sin_cos(positions, inv_freq), axis=-1)


def learned_lookup(table: Array, positions: ArrayLike) -> Array:
    """Rows of a learned position table; table: [max_len, D], positions: [B, T] -> [B, T, D].

    Concrete positions outside [0, max_len) raise ValueError; traced ones give NaN rows
    (loud downstream), never silently clipped to the last row.
    """
    max_len = table.shape[0]
    if not isinstance(positions, jax.core.Tracer):
        concrete = np.asarray(positions)
        bad = concrete[(concrete < 0) | (concrete >= max_len)]
        if bad.size:
            raise ValueError(
                f"position {int(bad.flat[0])} is outside the learned table (max_len={max_len}); "
                "learned positions need 0 <= position < max_len"
            )
    positions = _int_positions(positions)
    # mode="fill" would wrap negative indices; send them out of range too.
    positions = jnp.where(positions < 0, max_len, positions)
    return jnp.take(table, positions, axis=0, mode="fill", fill_value=jnp.nan)


ROPE_SCALINGS = rope_scaling.ROPE_SCALINGS


def rope_frequencies(
    rotated: int,
    base: float = 10000.0,
    scaling: str = "none",
    factor: float = 1.0,
    original_max_len: int = 8192,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
) -> np.ndarray:
    """RoPE's rotation frequencies [rotated // 2] (float64), base^(-2i/rotated), rescaled for
    long context by `scaling` with its parameters at their defaults beyond those named here
    (tfm.nn.rope_scaling has every scaling and all of its parameters). Length-dependent
    scalings (dynamic, longrope) give their frequencies up to the original context."""
    spec = rope_scaling.RopeScaling(scaling, factor, original_max_len, low_freq_factor,
                                    high_freq_factor)
    if scaling not in ROPE_SCALINGS:
        raise ValueError(f"scaling={scaling!r} is unknown; choose one of: "
                         f"{', '.join(ROPE_SCALINGS)}")
    return rope_scaling.static_frequencies(spec, rotated, base)


def apply_rope(
    x: Array,
    positions: ArrayLike,
    *,
    base: float = 10000.0,
    layout: str = "rotate_half",
    fraction: float = 1.0,
    frequencies: np.ndarray | Array | None = None,
    attention_factor: float = 1.0,
) -> Array:
    """Rotary position embedding (Su et al. 2021); x: [B, T, N, H], positions: [B, T] -> x's shape.

    The first d = round(fraction * H) dims (even) are rotated by angles pos * base^(-2i/d);
    the rest pass through. layout="interleaved" rotates pairs (2i, 2i+1) (paper, GPT-J);
    layout="rotate_half" rotates pairs (i, i + d/2) (GPT-NeoX, Llama). `frequencies` [d / 2]
    (e.g. from tfm.nn.rope_scaling) replace base^(-2i/d): numpy (static) ones get the exact
    angle reduction of `_sin_cos`; a jax array (a length-dependent scaling's, traced) the plain
    float32 product pos * f, as Hugging Face computes it. `attention_factor` multiplies the
    rotated dimensions (YaRN's and LongRoPE's m: cos and sin scaled, as Hugging Face does).
    Computed in float32, returned in x's dtype.
    """
    if layout not in ("interleaved", "rotate_half"):
        raise ValueError(f"layout={layout!r} is unknown; choose one of: interleaved, rotate_half")
    positions = _int_positions(positions)
    if positions.ndim != 2:
        raise ValueError(f"positions must be [batch, length]; got shape {positions.shape}")
    head_dim = x.shape[-1]
    rotated = round(fraction * head_dim)
    if not 0.0 < fraction <= 1.0 or rotated < 2 or rotated % 2:
        raise ValueError(
            f"fraction={fraction} rotates {rotated} of head_dim={head_dim} dims; "
            "that must be an even number >= 2 with 0 < fraction <= 1"
        )
    half = rotated // 2
    if frequencies is None:
        frequencies = base ** (-2.0 * np.arange(half) / rotated)
    if np.shape(frequencies) != (half,):
        raise ValueError(f"frequencies must have shape ({half},); got {np.shape(frequencies)}")
    if isinstance(frequencies, jax.Array):
        angle = positions[..., None].astype(jnp.float32) * frequencies.astype(jnp.float32)
        sin, cos = jnp.sin(angle), jnp.cos(angle)
    else:
        sin, cos = _sin_cos(positions, frequencies)
    if attention_factor != 1.0:
        sin, cos = sin * attention_factor, cos * attention_factor
    sin, cos = sin[:, :, None, :], cos[:, :, None, :]  # [B, T, 1, half]
    rot, rest = x[..., :rotated].astype(jnp.float32), x[..., rotated:]
    if layout == "rotate_half":
        # (first, second) -> (first cos - second sin, second cos + first sin), on whole rows:
        # x cos + swap(x) sin, where swap(x) = (second, first).
        cos_row = jnp.concatenate([cos, cos], axis=-1)
        sin_row = jnp.concatenate([-sin, sin], axis=-1)
        swapped = kernels.swap_halves(x[..., :rotated])
        out = rot * cos_row + swapped * sin_row
    else:
        first, second = rot[..., 0::2], rot[..., 1::2]
        pairs = [first * cos - second * sin, second * cos + first * sin]
        out = jnp.stack(pairs, axis=-1).reshape(rot.shape)
    return jnp.concatenate([out.astype(x.dtype), rest], axis=-1)


def log_length_scale(positions: ArrayLike, length: int) -> Array:
    """max(1, ln(p + 1) / ln(length)) for each position p: the factor on a query's logits that
    keeps attention from flattening past `length` tokens (Chiang and Cholak 2022's log-length
    scaling). positions: [B, T] -> [B, T] float32."""
    positions = _int_positions(positions).astype(jnp.float32)
    return jnp.maximum(1.0, jnp.log(positions + 1.0) / np.float32(np.log(length)))


def alibi_slopes(num_heads: int) -> np.ndarray:
    """ALiBi head slopes (Press et al. 2022) -> [num_heads] float32.

    For a power of two n: 2^(-8/n), 2^(-16/n), ..., 2^(-8). Otherwise the slopes of the closest
    lower power of two p, then slopes 0, 2, 4, ... of the 2p-head list, up to num_heads.
    """
    if num_heads <= 0:
        raise ValueError(f"num_heads={num_heads} must be > 0")

    def power_of_two(n: int) -> list[float]:
        return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]

    lower = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(lower) + power_of_two(2 * lower)[0::2][: num_heads - lower]
    return np.asarray(slopes, np.float32)


def _offsets(query_positions: ArrayLike, key_positions: ArrayLike) -> Array:
    """key - query; query_positions: [B, T], key_positions: [B, S] -> [B, T, S] int32."""
    query_positions = _int_positions(query_positions, "query_positions")
    key_positions = _int_positions(key_positions, "key_positions")
    return key_positions[:, None, :] - query_positions[:, :, None]


def alibi_bias(query_positions: ArrayLike, key_positions: ArrayLike, slopes: ArrayLike) -> Array:
    """-slope * |q - k|; query: [B, T], key: [B, S], slopes: [N] -> [B, N, T, S].

    Equals the paper's causal bias where k <= q, and is symmetric for encoders.
    """
    distance = jnp.abs(_offsets(query_positions, key_positions)).astype(jnp.float32)
    return -jnp.asarray(slopes, jnp.float32)[None, :, None, None] * distance[:, None]


def t5_relative_bucket(
    relative_position: ArrayLike,
    *,
    bidirectional: bool,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Array:
    """T5 bucket of relative_position = key - query (Raffel et al. 2020; Mesh TensorFlow) -> int32.

    Bidirectional: half the buckets per sign, key after query (positive) in the upper half.
    Causal: only key <= query is distinguished; future keys get bucket 0. Within a half, the
    first half of the buckets are exact distances, the rest logarithmic up to max_distance,
    then clipped to the last bucket.
    """
    relative_position = _int_positions(relative_position, "relative_position")
    bucket = jnp.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        bucket = jnp.where(relative_position > 0, num_buckets, 0)
        distance = jnp.abs(relative_position)
    else:
        distance = jnp.maximum(-relative_position, 0)
    max_exact = num_buckets // 2
    # + 1e-6 as in Mesh TF: guards exact ratios (16/8 = 2) against float32 log rounding down.
    ratio = jnp.maximum(distance, max_exact).astype(jnp.float32) / max_exact + 1e-6
    scale = (num_buckets - max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (jnp.log(ratio) * scale).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return (bucket + jnp.where(distance < max_exact, distance, large)).astype(jnp.int32)


def t5_bias(
    table: Array,
    query_positions: ArrayLike,
    key_positions: ArrayLike,
    *,
    bidirectional: bool,
    num_buckets: int = 32,
    max_distance: int = 128,
) -> Array:
    """T5 relative attention bias; table: [num_buckets, N], query_positions: [B, T],
    key_positions: [B, S] -> [B, N, T, S]."""
    if table.shape[0] != num_buckets:
        raise ValueError(f"table has {table.shape[0]} rows but num_buckets={num_buckets}")
    buckets = t5_relative_bucket(
        _offsets(query_positions, key_positions),
        bidirectional=bidirectional,
        num_buckets=num_buckets,
        max_distance=max_distance,
    )
    return jnp.moveaxis(jnp.take(table, buckets, axis=0), -1, 1)  # [B, T, S, N] -> [B, N, T, S]


# ---------------------------------------------------------------------------------------------
# Logit biases by blocks: the form a fused kernel evaluates per [block_q, block_k] tile
# (tfm.kernels.flex_attention), so no [batch, heads, T, S] bias reaches memory. A block bias
# function is fn(head_params, query_positions [bq, 1] int32, key_positions [1, bk] int32)
# -> [bq, bk] float32, where head_params holds one head's row of each parameter ([1, P]).
# Inside a TPU kernel it may use elementwise maths, broadcasts and reductions over the
# parameter row only (no gather), and so may its gradient with respect to head_params; it must
# be elementwise in the positions, so that given query positions [1, bq] and key positions
# [bk, 1] it returns the transposed tile (the kernel's dk/dv pass does that).

BlockBiasFn = Callable[[Any, Array, Array], Array]


def alibi_block_bias(head_params: tuple[Array], query_positions: Array,
                     key_positions: Array) -> Array:
    """-slope * |k - q| for one head; head_params: ([1, 1] slope,) -> [bq, bk] (alibi_bias)."""
    (slope,) = head_params
    distance = jnp.abs(key_positions - query_positions).astype(jnp.float32)
    return -slope.astype(jnp.float32) * distance


def t5_block_bias(head_params: tuple[Array], query_positions: Array, key_positions: Array, *,
                  bidirectional: bool, num_buckets: int, max_distance: int) -> Array:
    """table[bucket(k - q), head] for one head; head_params: ([1, num_buckets] table row,)
    -> [bq, bk] (t5_bias), looked up in the form a fused kernel evaluates (no gather)."""
    (table_row,) = head_params
    buckets = t5_relative_bucket(key_positions - query_positions, bidirectional=bidirectional,
                                 num_buckets=num_buckets, max_distance=max_distance)
    return block_bias.row_lookup(table_row, buckets)


def alibi_dense_bias(head_params: tuple[Array], query_positions: Array,
                     key_positions: Array) -> Array:
    """alibi_bias over whole rows from alibi_block_bias's params ([N, 1] slopes,)
    -> [B, N, T, S]."""
    (slopes,) = head_params
    return alibi_bias(query_positions, key_positions, slopes[:, 0])


def t5_dense_bias(head_params: tuple[Array], query_positions: Array, key_positions: Array, *,
                  bidirectional: bool, num_buckets: int, max_distance: int) -> Array:
    """t5_bias over whole rows (a gather) from t5_block_bias's params ([N, num_buckets] table,)
    -> [B, N, T, S]."""
    (table,) = head_params
    return t5_bias(table.T, query_positions, key_positions, bidirectional=bidirectional,
                   num_buckets=num_buckets, max_distance=max_distance)


# ---------------------------------------------------------------------------------------------
# The registry: what each scheme adds to the model. Layers call these hooks and never compare
# scheme names, so a new scheme is one entry here (and its test).

# param(name, shape, init_stddev, logical_axes) -> a parameter of the calling linen module.
ParamFn = Callable[[str, tuple[int, ...], float, tuple[str | None, ...]], Array]
# A Shaw-style term: (its logit bias by parts, its value term by parts, called as
# value_term(weights [B, N, T, S]) -> [B, T, N, H], or None)
RelativeTerm = tuple[RelativeBias, RelativeValue | None]
# dense(params, query_positions [B, T], key_positions [B, S]) -> [B, N, T, S]: a block bias's
# params evaluated over whole rows (a faster form than the block function's for the reference)
DenseBiasFn = Callable[[Any, Array, Array], Array]


def _no_params(config: Any, num_layers: int) -> int:
    return 0


def _never(config: Any) -> bool:
    return False


def _always(config: Any) -> bool:
    return True


def _no_check(config: Any) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class PositionScheme:
    """A position scheme by name and the hooks that say where it enters the model (None: the
    scheme adds nothing there). `config` is a tfm.nn.config.ModelConfig.

    embedding(config, token_positions [B, T], width T, param) -> [B, T, d_model], added to the
      token embeddings.
    rotate(config, x [B, T, N, H], positions [B, T]) -> x, applied to self-attention queries
      and keys.
    relative(config, query_positions [B, T], key_positions [B, S], param) -> RelativeTerm,
      a logit bias from the queries (by parts: the kernel computes it) plus an optional value
      term.
    block_bias(config, bidirectional, param) -> (BlockBiasFn, params with leaves
      [num_heads, P]): the logit bias added to self-attention logits (shared by a stack's
      layers unless `bias_per_layer(config)`), in the form fused kernels evaluate per block.
    dense_function(config, bidirectional) -> DenseBiasFn over the same params, or None: the
      same bias over whole rows for kernels that write it out (None: the block function on
      whole rows, dense_from_blocks).
    """

    name: str
    kind: str  # "none" | "embedding" | "rotary" | "bias" | "relative"
    description: str = ""
    embedding: Callable[..., Array] | None = None
    rotate: Callable[..., Array] | None = None
    relative: Callable[..., RelativeTerm] | None = None
    block_bias: Callable[..., tuple[BlockBiasFn, Any]] | None = None
    dense_function: Callable[[Any, bool], DenseBiasFn] | None = None
    bias_per_layer: Callable[[Any], bool] = _never
    # True: positions must be < config.max_len (a table); others run at any position.
    bounded_by_max_len: bool = False
    check: Callable[[Any], None] = _no_check  # raises ConfigError for invalid settings
    # Whether the layers need the attention weights (Shaw's value term): fused kernels lack them.
    needs_attention_weights: Callable[[Any], bool] = _never
    # The logit bias it adds: None, "fixed" (no parameters), "learned" (a gradient flows
    # through it) or "query" (computed from the queries: Shaw); fused kernels take some kinds
    # or none (tfm.kernels.Backend.biases), and only in the block form (block_bias).
    logit_bias_kind: str | None = None
    num_params: Callable[[Any, int], int] = _no_params  # per stack of num_layers layers


def _sinusoidal_embedding(config: Any, token_positions: Array, width: int, param: ParamFn):
    return sinusoidal(token_positions, config.d_model, layout=config.sinusoidal_layout)


def _check_sinusoidal(config: Any) -> None:
    if config.d_model % 2:
        raise ConfigError(f"d_model={config.d_model} must be even for sinusoidal positions")


def _learned_embedding(config: Any, token_positions: Array, width: int, param: ParamFn):
    if width > config.max_len:  # static, so it also fails under jit
        raise ValueError(
            f"sequence length {width} exceeds max_len={config.max_len} of the "
            "learned position table; raise model.max_len or use another position_scheme"
        )
    table = param("position_embedding", (config.max_len, config.d_model), 0.02, (None, "embed"))
    return learned_lookup(table, token_positions)


def _rope_rotate(config: Any, x: Array, positions: Array) -> Array:
    spec = config.rope_scaling_spec
    frequencies = config.rope_frequencies
    if spec.kind in rope_scaling.LENGTH_DEPENDENT:
        # The length is the call's largest position + 1, as Hugging Face takes it: while
        # decoding it grows step by step, and cached keys keep their earlier rotation.
        length = jnp.max(jnp.asarray(positions)) + 1
        frequencies = rope_scaling.frequencies_at(spec, 2 * len(frequencies), config.rope_base,
                                                  length)
    return apply_rope(
        x,
        positions,
        layout=config.rope_layout,
        fraction=config.rope_fraction,
        frequencies=frequencies,
        attention_factor=rope_scaling.attention_factor(spec),
    )


def _check_rope(config: Any) -> None:
    rotated = round(config.resolved_head_dim * config.rope_fraction)
    if rotated < 2 or rotated % 2:
        raise ConfigError(
            f"rope_fraction={config.rope_fraction} rotates {rotated} of head_dim="
            f"{config.resolved_head_dim} dimensions; that must be an even number >= 2"
        )


def _shaw_relative(
    config: Any, query_positions: Array, key_positions: Array, param: ParamFn
) -> RelativeTerm:
    distance, head_dim = config.relative_max_distance, config.resolved_head_dim
    shape, axes = (2 * distance + 1, head_dim), ("relpos", "head_dim")
    key_table = param("relative_key", shape, head_dim**-0.5, axes)
    bias = RelativeBias(functools.partial(shaw_bias, max_distance=distance), key_table,
                        query_positions, key_positions)
    if not config.relative_values:
        return bias, None
    value_table = param("relative_value", shape, head_dim**-0.5, axes)
    return bias, RelativeValue(functools.partial(shaw_values, max_distance=distance),
                               value_table, query_positions, key_positions)


def _t5_table(config: Any, param: ParamFn) -> Array:
    return param(
        "t5_bias_table", (config.t5_num_buckets, config.num_heads), 0.1, ("buckets", "heads")
    )


def _t5_block_bias(config: Any, bidirectional: bool, param: ParamFn) -> tuple[BlockBiasFn, Any]:
    function = functools.partial(
        t5_block_bias, bidirectional=bidirectional, num_buckets=config.t5_num_buckets,
        max_distance=config.t5_max_distance,
    )
    return function, (_t5_table(config, param).T,)


def _alibi_block_bias(config: Any, bidirectional: bool, param: ParamFn) -> tuple[BlockBiasFn, Any]:
    return alibi_block_bias, (jnp.asarray(alibi_slopes(config.num_heads))[:, None],)


def _t5_dense_bias(config: Any, bidirectional: bool) -> DenseBiasFn:
    return functools.partial(t5_dense_bias, bidirectional=bidirectional,
                             num_buckets=config.t5_num_buckets,
                             max_distance=config.t5_max_distance)


SCHEMES: dict[str, PositionScheme] = {
    scheme.name: scheme
    for scheme in (
        PositionScheme("none", "none", "no position information (e.g. causal-only NoPE)"),
        PositionScheme(
            "sinusoidal", "embedding", "fixed sinusoids added to embeddings",
            embedding=_sinusoidal_embedding, check=_check_sinusoidal,
        ),
        PositionScheme(
            "learned", "embedding", "learned table added to embeddings, < max_len",
            embedding=_learned_embedding, bounded_by_max_len=True,
            num_params=lambda config, layers: config.max_len * config.d_model,
        ),
        PositionScheme(
            "rope", "rotary", "rotary embedding of queries and keys",
            rotate=_rope_rotate, check=_check_rope,
        ),
        PositionScheme(
            "relative", "relative", "Shaw et al. clipped relative keys/values",
            relative=_shaw_relative, logit_bias_kind="query",
            needs_attention_weights=lambda config: config.relative_values,
            # Tables shared by heads, one or two per self-attention layer.
            num_params=lambda config, layers: layers * (1 + config.relative_values) * (
                2 * config.relative_max_distance + 1) * config.resolved_head_dim,
        ),
        PositionScheme(
            "t5_bias", "bias", "T5 bucketed relative attention bias",
            block_bias=_t5_block_bias, dense_function=_t5_dense_bias, logit_bias_kind="learned",
            bias_per_layer=lambda config: not config.t5_shared_across_layers,
            num_params=lambda config, layers: (
                1 if config.t5_shared_across_layers else layers
            ) * config.t5_num_buckets * config.num_heads,
        ),
        PositionScheme(
            "alibi", "bias", "ALiBi linear distance penalty per head",
            block_bias=_alibi_block_bias,
            dense_function=lambda config, bidirectional: alibi_dense_bias, logit_bias_kind="fixed",
        ),
        # Learned long-context biases (tfm.nn.learned_biases), one set per layer as in their
        # papers; Kerple's dense form comes from its block form, FIRE has its own.
        PositionScheme(
            "kerple_log", "bias", "Kerple: -r1 log(1 + r2 |i - j|), learned per head",
            block_bias=learned_biases.kerple_log, logit_bias_kind="learned",
            bias_per_layer=_always,
        ),
        PositionScheme(
            "kerple_power", "bias", "Kerple: -r1 |i - j|^r2, learned per head",
            block_bias=learned_biases.kerple_power, logit_bias_kind="learned",
            bias_per_layer=_always,
        ),
        PositionScheme(
            "fire", "bias", "FIRE: an MLP of the log distance over the log query position",
            block_bias=learned_biases.fire,
            dense_function=lambda config, bidirectional: learned_biases.fire_dense_bias,
            logit_bias_kind="learned", bias_per_layer=_always,
        ),
    )
}
POSITION_SCHEMES = tuple(SCHEMES)


def get_scheme(name: str) -> PositionScheme:
    """The registered PositionScheme called `name`; unknown names raise ConfigError."""
    if name not in SCHEMES:
        raise ConfigError(
            f"position_scheme={name!r} is unknown; choose one of: {', '.join(SCHEMES)}"
        )
    return SCHEMES[name]
