"""Thin Flax (linen) modules over the pure functions in attention.py and positions.py.

Parameters carry logical axis names (vocab, embed, heads, kv_heads, head_dim, mlp, layers, relpos,
buckets) so sharding is a matter of rules (tfm/sharding.py), not code.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from tfm import attention, cache, positions
from tfm.config import ModelConfig

Array = jax.Array


def _kernel(names: tuple[str | None, ...], init: Any = None) -> Any:
    return nn.with_logical_partitioning(init or nn.initializers.xavier_uniform(), names)


def _zeros(names: tuple[str | None, ...]) -> Any:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


class Projection(nn.Module):
    """y = x . kernel (+ bias), contracting the last `num_contracted` axes of x.

    kernel: [*contracted dims, *features] with logical axis `names`; Glorot-uniform over those
    fans. Matmuls accumulate in float32 (faster than a bf16 output on CPU, and more exact).
    """

    config: ModelConfig
    features: tuple[int, ...]
    names: tuple[str | None, ...]
    num_contracted: int = 1

    @nn.compact
    def __call__(self, x: Array) -> Array:  # x: [..., *contracted] -> [..., *features]
        config, n_in, n_out = self.config, self.num_contracted, len(self.features)
        init = nn.initializers.xavier_uniform(
            in_axis=tuple(range(n_in)), out_axis=tuple(range(n_in, n_in + n_out))
        )
        shape = (*x.shape[x.ndim - n_in :], *self.features)
        kernel = self.param("kernel", _kernel(self.names, init), shape, config.params_dtype)
        contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        y = jax.lax.dot_general(
            x.astype(config.compute_dtype),
            jnp.asarray(kernel, config.compute_dtype),
            (contract, ((), ())),
            preferred_element_type=jnp.float32,
        )
        if config.use_bias:
            bias = self.param("bias", _zeros(self.names[n_in:]), self.features, config.params_dtype)
            y = y + jnp.asarray(bias, jnp.float32)
        return y.astype(config.compute_dtype)


def _dense(config: ModelConfig, features: Any, axis: Any, names: tuple, name: str) -> nn.Module:
    """A Projection onto `features` (int or tuple) contracting `axis` (-1 or (-2, -1))."""
    features = (features,) if isinstance(features, int) else tuple(features)
    num_contracted = 1 if isinstance(axis, int) else len(axis)
    return Projection(config, features, names, num_contracted, name=name)


class Norm(nn.Module):
    """LayerNorm (Ba et al. 2016) or RMSNorm (Zhang & Sennrich 2019), statistics in float32."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:  # x: [..., d_model]
        config = self.config
        kwargs = dict(
            epsilon=config.norm_eps,
            dtype=jnp.float32,
            param_dtype=config.params_dtype,
            scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), ("embed",)),
        )
        if config.norm_type == "layernorm":
            norm = nn.LayerNorm(bias_init=_zeros(("embed",)), name="layer_norm", **kwargs)
        else:
            norm = nn.RMSNorm(name="rms_norm", **kwargs)
        return norm(x.astype(jnp.float32)).astype(config.compute_dtype)


class TokenEmbedding(nn.Module):
    """Token embeddings, scaled by sqrt(d_model) (Vaswani et al. 2017 sec. 3.4); `attend` reuses
    the table as the output projection when embeddings are tied."""

    config: ModelConfig
    vocab_size: int

    def setup(self) -> None:
        config = self.config
        self.table = self.param(
            "embedding",
            _kernel(("vocab", "embed"), nn.initializers.normal(stddev=config.d_model**-0.5)),
            (self.vocab_size, config.d_model),
            config.params_dtype,
        )

    def __call__(self, tokens: Array) -> Array:  # tokens: [batch, len] -> [batch, len, d_model]
        x = jnp.take(jnp.asarray(self.table, self.config.compute_dtype), tokens, axis=0)
        if self.config.scale_embeddings:
            x = x * jnp.sqrt(jnp.asarray(self.config.d_model, x.dtype))
        return x

    def attend(self, x: Array) -> Array:  # x: [batch, len, d_model] -> [batch, len, vocab]
        table = jnp.asarray(self.table, self.config.compute_dtype)
        return jnp.einsum("btd,vd->btv", x, table, preferred_element_type=jnp.float32)


class PositionEmbedding(nn.Module):
    """Absolute positions added to the token embeddings: sinusoidal (any position) or learned
    (positions < max_len). Identity for the other schemes."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, token_positions: Array) -> Array:
        # x: [batch, len, d_model]; token_positions: [batch, len]
        config = self.config
        if config.position_scheme == "sinusoidal":
            table = positions.sinusoidal(
                token_positions, config.d_model, layout=config.sinusoidal_layout
            )
            return x + table.astype(x.dtype)
        if config.position_scheme == "learned":
            if x.shape[1] > config.max_len:  # static, so it also fails under jit
                raise ValueError(
                    f"sequence length {x.shape[1]} exceeds max_len={config.max_len} of the "
                    "learned position table; raise model.max_len or use another position_scheme"
                )
            table = self.param(
                "position_embedding",
                _kernel((None, "embed"), nn.initializers.normal(stddev=0.02)),
                (config.max_len, config.d_model),
                config.params_dtype,
            )
            return x + positions.learned_lookup(table, token_positions).astype(x.dtype)
        return x


class PositionBias(nn.Module):
    """Additive attention-logit biases from relative positions: T5 buckets (learned, per head)
    or ALiBi (fixed slopes). Returns None for schemes that add no bias."""

    config: ModelConfig
    bidirectional: bool

    @nn.compact
    def __call__(self, query_positions: Array, key_positions: Array) -> Array | None:
        # query_positions: [batch, q_len]; key_positions: [batch, kv_len]
        # returns [batch, heads, q_len, kv_len] or None
        config = self.config
        if config.position_scheme == "t5_bias":
            table = self.param(
                "t5_bias_table",
                _kernel(("buckets", "heads"), nn.initializers.normal(stddev=0.1)),
                (config.t5_num_buckets, config.num_heads),
                config.params_dtype,
            )
            return positions.t5_bias(
                table,
                query_positions,
                key_positions,
                bidirectional=self.bidirectional,
                num_buckets=config.t5_num_buckets,
                max_distance=config.t5_max_distance,
            )
        if config.position_scheme == "alibi":
            slopes = jnp.asarray(positions.alibi_slopes(config.num_heads), jnp.float32)
            return positions.alibi_bias(query_positions, key_positions, slopes)
        return None


class MultiHeadAttention(nn.Module):
    """Multi-head (or grouped-query) attention, self or cross (Vaswani et al. 2017 sec. 3.2.2).

    Self-attention applies RoPE or Shaw relative embeddings when configured; cross-attention uses
    no position information (queries from the decoder, keys/values from the encoder output).
    """

    config: ModelConfig
    is_cross: bool = False

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,  # [batch, q_len, d_model]
        inputs_kv: Array | None,  # [batch, kv_len, d_model], or None to read cached_kv
        *,
        mask: Array | None,  # [batch, 1, q_len, kv_len] bool
        bias: Array | None,  # [batch | 1, heads, q_len, kv_len]
        query_positions: Array,  # [batch, q_len]
        key_positions: Array,  # [batch, kv_len] positions of every key attended to
        cached_kv: tuple[Array, Array] | None = None,  # 2 x [batch, cache_len, kv_heads, head_dim]
        write_index: Array | None = None,  # [batch] slot where new self-attention keys go
        deterministic: bool = True,
    ) -> tuple[Array, tuple[Array, Array] | None]:
        config = self.config
        num_heads, num_kv_heads = config.num_heads, config.resolved_num_kv_heads
        head_dim = config.resolved_head_dim
        query = _dense(config, (num_heads, head_dim), -1, ("embed", "heads", "head_dim"), "query")(
            inputs_q
        )

        if inputs_kv is not None:
            kv_names = ("embed", "kv_heads", "head_dim")
            key = _dense(config, (num_kv_heads, head_dim), -1, kv_names, "key")(inputs_kv)
            value = _dense(config, (num_kv_heads, head_dim), -1, kv_names, "value")(inputs_kv)
        rope = config.position_scheme == "rope" and not self.is_cross
        if rope:
            rope_args = dict(
                base=config.rope_base, layout=config.rope_layout, fraction=config.rope_fraction
            )
            query = positions.apply_rope(query, query_positions, **rope_args)
            if inputs_kv is not None:
                key = positions.apply_rope(key, query_positions, **rope_args)

        new_cache = None
        if self.is_cross:
            if inputs_kv is None:
                key, value = cached_kv
            new_cache = (key, value) if cached_kv is not None else None
        elif cached_kv is not None:
            key = cache.write(cached_kv[0], key, write_index)
            value = cache.write(cached_kv[1], value, write_index)
            new_cache = (key, value)

        relative = config.position_scheme == "relative" and not self.is_cross
        scale = head_dim**-0.5
        if relative:
            distance = config.relative_max_distance
            rel_idx = positions.relative_indices(query_positions, key_positions, distance)
            rel_init = _kernel(
                ("relpos", "head_dim"), nn.initializers.normal(stddev=head_dim**-0.5)
            )
            key_table = self.param(
                "relative_key", rel_init, (2 * distance + 1, head_dim), config.params_dtype
            )
            shaw_bias = positions.shaw_logit_bias(query, key_table, rel_idx, scale)
            bias = shaw_bias if bias is None else bias + shaw_bias

        dropout_rate = 0.0 if deterministic else config.attention_dropout_rate
        dropout_rng = self.make_rng("dropout") if dropout_rate > 0 else None
        want_weights = relative and config.relative_values
        result = attention.dot_product_attention(
            query,
            key,
            value,
            bias=bias,
            mask=mask,
            scale=scale,
            backend=config.attention_backend,
            return_weights=want_weights,
            dropout_rate=dropout_rate,
            dropout_rng=dropout_rng,
        )
        if want_weights:
            out, weights = result
            value_table = self.param(
                "relative_value", rel_init, (2 * distance + 1, head_dim), config.params_dtype
            )
            out = out + positions.shaw_value_term(weights, value_table, rel_idx).astype(out.dtype)
        else:
            out = result
        out = _dense(config, config.d_model, (-2, -1), ("heads", "head_dim", "embed"), "out")(out)
        return out, new_cache


class FeedForward(nn.Module):
    """Position-wise FFN (Vaswani et al. 2017 eq. 2): ReLU as in the paper, GELU, or SwiGLU
    (Shazeer 2020), whose gate makes it three matrices."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:  # x: [batch, len, d_model]
        config = self.config
        hidden = _dense(config, config.d_ff, -1, ("embed", "mlp"), "wi")(x)
        if config.activation == "relu":
            hidden = nn.relu(hidden)
        elif config.activation == "gelu":
            hidden = nn.gelu(hidden, approximate=False)
        else:  # swiglu
            gate = _dense(config, config.d_ff, -1, ("embed", "mlp"), "wi_gate")(x)
            hidden = nn.silu(gate) * hidden
        return _dense(config, config.d_model, -1, ("mlp", "embed"), "wo")(hidden)
