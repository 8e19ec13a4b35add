"""Thin Flax (linen) modules over the pure functions in attention.py and positions.py.

Parameters carry logical axis names (vocab, embed, heads, kv_heads, head_dim, mlp, layers, relpos,
buckets) so sharding is a matter of rules (tfm/parallel/sharding.py), not code.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from tfm.kernels import cpu_dense
from tfm.nn import attention, cache, positions
from tfm.nn.config import ModelConfig

Array = jax.Array


def _kernel(names: tuple[str | None, ...], init: Any = None) -> Any:
    return nn.with_logical_partitioning(init or nn.initializers.xavier_uniform(), names)


def _zeros(names: tuple[str | None, ...]) -> Any:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


class Projection(nn.Module):
    """y = x . kernel (+ bias), contracting the last len(in_features) axes of x.

    kernel: [*in_features, *features] with logical axis `names`; Glorot-uniform over those
    fans. The matmul is `tfm.kernels.cpu_dense.linear`: compute-dtype operands in both passes,
    float32
    accumulation. `kernel` and `bias` are attributes, so a layer can fuse several projections
    of one input into one matmul (`project_together`).
    """

    config: ModelConfig
    in_features: tuple[int, ...]
    features: tuple[int, ...]
    names: tuple[str | None, ...]
    bias_group: str = "mlp"  # which of config.BIAS_GROUPS switches this layer's bias

    def setup(self) -> None:
        config, n_in, n_out = self.config, len(self.in_features), len(self.features)
        init = nn.initializers.xavier_uniform(
            in_axis=tuple(range(n_in)), out_axis=tuple(range(n_in, n_in + n_out))
        )
        shape = (*self.in_features, *self.features)
        self.kernel = self.param("kernel", _kernel(self.names, init), shape, config.params_dtype)
        self.bias = None
        if config.has_bias(self.bias_group):
            self.bias = self.param(
                "bias", _zeros(self.names[n_in:]), self.features, config.params_dtype
            )

    def __call__(self, x: Array) -> Array:  # x: [..., *in_features] -> [..., *features]
        return project_together(self.config, x, [self])[0]


def project_together(
    config: ModelConfig, x: Array, projections: list[Projection], out_dtype: Any = None
) -> list[Array]:
    """Applies projections that share x's input axes as ONE matmul over their concatenated
    kernels (e.g. query, key and value), then splits: one wide matmul runs faster on CPU
    than three narrow ones, and the parameters stay separate (same checkpoint layout).

    x: [..., *in_features] -> [[..., *features_i] for each projection], in out_dtype (default
    the compute dtype).
    """
    out_dtype = config.compute_dtype if out_dtype is None else out_dtype
    num_in = len(projections[0].in_features)
    widths = [math.prod(p.features) for p in projections]
    kernels = [p.kernel.reshape(*p.in_features, math.prod(p.features)) for p in projections]
    kernel = kernels[0] if len(kernels) == 1 else jnp.concatenate(kernels, axis=-1)
    has_bias = projections[0].bias is not None
    if any((p.bias is not None) != has_bias for p in projections):
        raise ValueError("project_together needs projections that all have a bias or all none")
    y = cpu_dense.linear(
        x,
        kernel,
        num_contracted=num_in,
        compute_dtype=config.compute_dtype,
        out_dtype=jnp.float32 if has_bias else out_dtype,
    )
    if has_bias:
        bias = jnp.concatenate([p.bias.reshape(-1) for p in projections])
        y = (y + bias.astype(jnp.float32)).astype(out_dtype)
    outputs = jnp.split(y, np.cumsum(widths)[:-1].tolist(), axis=-1) if len(widths) > 1 else [y]
    return [
        out.reshape(*out.shape[:-1], *p.features)
        for out, p in zip(outputs, projections, strict=True)
    ]


def _dense(
    config: ModelConfig,
    in_features: Any,
    features: Any,
    names: tuple,
    name: str,
    bias_group: str = "mlp",
) -> Projection:
    """A Projection from `in_features` (int or tuple) onto `features` (int or tuple)."""
    as_tuple = lambda f: (f,) if isinstance(f, int) else tuple(f)
    return Projection(
        config, as_tuple(in_features), as_tuple(features), names, bias_group, name=name
    )


class Norm(nn.Module):
    """LayerNorm (Ba et al. 2016) or RMSNorm (Zhang & Sennrich 2019), statistics in float32.

    LayerNorm's variance is the exact two-pass mean((x - mean)^2): the fast E[x^2] - E[x]^2
    cancels catastrophically when a token's mean is large against its spread (mean 100, std 1
    loses about 3e-3 in float32)."""

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
            norm = nn.LayerNorm(
                bias_init=_zeros(("embed",)),
                use_fast_variance=False,
                name="layer_norm",
                **kwargs,
            )
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
        stddev = config.embedding_init_stddev or config.d_model**-0.5
        self.table = self.param(
            "embedding",
            _kernel(("vocab", "embed"), nn.initializers.normal(stddev=stddev)),
            (self.vocab_size, config.d_model),
            config.params_dtype,
        )

    def __call__(self, tokens: Array) -> Array:  # tokens: [batch, len] -> [batch, len, d_model]
        x = jnp.take(jnp.asarray(self.table, self.config.compute_dtype), tokens, axis=0)
        if self.config.scale_embeddings:
            x = x * jnp.sqrt(jnp.asarray(self.config.d_model, x.dtype))
        return x

    def attend(self, x: Array, kernel: Array | None = None) -> Array:
        """x: [batch, len, d_model] -> logits [batch, len, vocab] float32, x times the table's
        transpose. kernel: that transpose [d_model, vocab], made once before a decoding loop
        (`models.output_kernel`), since XLA CPU multiplies 4-128 rows by a table read transposed
        3-8x slower than by a [d_model, vocab] copy (benchmarks/translate_vs_hf.py); None reads
        the table."""
        config = self.config
        if kernel is None:
            kernel = self.table.T
        elif tuple(kernel.shape) != (config.d_model, self.vocab_size):
            raise ValueError(f"the tied output kernel must be [d_model, vocab] = "
                             f"{(config.d_model, self.vocab_size)}; got {tuple(kernel.shape)}")
        return cpu_dense.linear(x, kernel, compute_dtype=config.compute_dtype,
        out_dtype=jnp.float32)


def _param_fn(module: nn.Module, config: ModelConfig) -> positions.ParamFn:
    """The `param` hook tfm.nn.positions' schemes create their tables with, in `module`."""

    def param(name: str, shape: tuple[int, ...], stddev: float, axes: tuple) -> Array:
        init = _kernel(axes, nn.initializers.normal(stddev=stddev))
        return module.param(name, init, shape, config.params_dtype)

    return param


class PositionEmbedding(nn.Module):
    """Absolute positions added to the token embeddings, for schemes that have an embedding
    hook in tfm.nn.positions.SCHEMES (sinusoidal, learned); identity for the others."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array, token_positions: Array) -> Array:
        # x: [batch, len, d_model]; token_positions: [batch, len]
        embedding = self.config.scheme.embedding
        if embedding is None:
            return x
        table = embedding(self.config, token_positions, x.shape[1], _param_fn(self, self.config))
        return x + table.astype(x.dtype)


class PositionBias(nn.Module):
    """Additive attention-logit biases from relative positions, for schemes with a logit_bias
    hook (T5 buckets, ALiBi). Returns None for schemes that add no bias."""

    config: ModelConfig
    bidirectional: bool

    @nn.compact
    def __call__(self, query_positions: Array, key_positions: Array) -> Array | None:
        # query_positions: [batch, q_len]; key_positions: [batch, kv_len]
        # returns [batch, heads, q_len, kv_len] or None
        logit_bias = self.config.scheme.logit_bias
        if logit_bias is None:
            return None
        param = _param_fn(self, self.config)
        return logit_bias(self.config, query_positions, key_positions, self.bidirectional, param)


class MultiHeadAttention(nn.Module):
    """Multi-head (or grouped-query) attention, self or cross (Vaswani et al. 2017 sec. 3.2.2).

    Self-attention applies RoPE or Shaw relative embeddings when configured; cross-attention uses
    no position information (queries from the decoder, keys/values from the encoder output).
    Query, key and value projections of one input run as one matmul (`project_together`).

    With a KV cache (`cache_slots`, every layer's slots, see tfm/nn/cache.py) the new keys and
    values
    are written into this layer's slots in place, and attention reads the slots in their
    head-major layout; the updated slots are returned.
    """

    config: ModelConfig
    is_cross: bool = False

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,  # [batch, q_len, d_model]
        inputs_kv: Array | None,  # [batch, kv_len, d_model], or None to read the cross cache
        *,
        mask: Array | None,  # [batch, 1, q_len, kv_len] bool
        bias: Array | None,  # [batch | 1, heads, q_len, kv_len]
        query_positions: Array,  # [batch, q_len]
        key_positions: Array,  # [batch, kv_len] positions of every key attended to
        cache_slots: tuple[Array, Array] | None = None,  # keys, values of every layer (cache.py)
        layer: Array | int = 0,  # which layer's slots are this module's
        write_index: Array | None = None,  # [batch] slot where new self-attention keys go
        causal: bool = False,  # self-attention without a cache: query i sees no key after i
        deterministic: bool = True,
    ) -> tuple[Array, tuple[Array, Array] | None]:
        config = self.config
        num_heads, num_kv_heads = config.num_heads, config.resolved_num_kv_heads
        head_dim, d_model = config.resolved_head_dim, config.d_model
        kv_names = ("embed", "kv_heads", "head_dim")
        query_proj = _dense(
            config,
            d_model,
            (num_heads, head_dim),
            kv_names[:1] + ("heads", "head_dim"),
            "query",
            "qkv",
        )
        key_proj = _dense(config, d_model, (num_kv_heads, head_dim), kv_names, "key", "qkv")
        value_proj = _dense(config, d_model, (num_kv_heads, head_dim), kv_names, "value", "qkv")
        if inputs_kv is inputs_q:
            query, key, value = project_together(
                config, inputs_q, [query_proj, key_proj, value_proj]
            )
        else:
            query = query_proj(inputs_q)
            if inputs_kv is not None:
                key, value = project_together(config, inputs_kv, [key_proj, value_proj])
        scheme = config.scheme
        if scheme.rotate is not None and not self.is_cross:
            query = scheme.rotate(config, query, query_positions)
            key = scheme.rotate(config, key, query_positions)

        cache_layout, new_slots = False, None
        if cache_slots is not None:
            if inputs_kv is not None:  # new keys/values into this layer's slots
                start = write_index if not self.is_cross else jnp.zeros_like(query_positions[:, 0])
                new_slots = tuple(
                    cache.write_layer(slots, new.swapaxes(1, 2), layer, start, transposed=is_key)
                    for slots, new, is_key in zip(
                        cache_slots, (key, value), (True, False), strict=True
                    )
                )
            else:
                new_slots = cache_slots
            if not self.is_cross or inputs_kv is None:
                key, value = (cache.read_layer(slots, layer) for slots in new_slots)
                cache_layout = True

        scale = config.resolved_attention_scale
        value_term = None
        if scheme.relative is not None and not self.is_cross:
            relative_bias, value_term = scheme.relative(
                config, query, query_positions, key_positions, scale, _param_fn(self, config)
            )
            bias = relative_bias if bias is None else bias + relative_bias

        dropout_rate = 0.0 if deterministic else config.attention_dropout_rate
        dropout_rng = self.make_rng("dropout") if dropout_rate > 0 else None
        want_weights = value_term is not None
        result = attention.dot_product_attention(
            query,
            key.astype(query.dtype),
            value.astype(query.dtype),
            bias=bias,
            mask=mask,
            scale=scale,
            backend=config.attention_backend,
            return_weights=want_weights,
            dropout_rate=dropout_rate,
            dropout_rng=dropout_rng,
            causal=causal,
            cache_layout=cache_layout,
        )
        if want_weights:
            out, weights = result
            out = out + value_term(weights).astype(out.dtype)
        else:
            out = result
        out_proj = _dense(
            config,
            (num_heads, head_dim),
            d_model,
            ("heads", "head_dim", "embed"),
            "out",
            "attention_out",
        )
        return out_proj(out), new_slots


class FeedForward(nn.Module):
    """Position-wise FFN (Vaswani et al. 2017 eq. 2): ReLU as in the paper, GELU (exact erf, or
    the tanh approximation of GPT-2's "gelu_new"), or the gated SwiGLU / GEGLU (Shazeer 2020;
    T5 v1.1's gated GELU uses the tanh approximation), whose gate makes it three matrices.
    The activation runs on the first matmul's float32 accumulator, whatever the compute dtype;
    the second matmul casts its input (one rounding instead of one per elementwise op: with
    bfloat16 activations XLA's CPU backend split GELU into several fusions, each rounding and
    re-reading [tokens, d_ff], and a bf16 char-GPT train step ran 4% slower in a scratch A/B)."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:  # x: [batch, len, d_model]
        config = self.config
        wi = _dense(config, config.d_model, config.d_ff, ("embed", "mlp"), "wi")
        if config.activation in ("swiglu", "geglu"):
            wi_gate = _dense(config, config.d_model, config.d_ff, ("embed", "mlp"), "wi_gate")
            hidden, gate = project_together(config, x, [wi, wi_gate], out_dtype=jnp.float32)
            gate = nn.silu(gate) if config.activation == "swiglu" else nn.gelu(gate, True)
            hidden = gate * hidden
        else:
            hidden = project_together(config, x, [wi], out_dtype=jnp.float32)[0]
            if config.activation == "relu":
                hidden = nn.relu(hidden)
            elif config.activation == "gelu":
                hidden = cpu_dense.gelu(hidden)
            else:  # gelu_tanh (GPT-2's "gelu_new")
                hidden = nn.gelu(hidden, approximate=True)
        return _dense(config, config.d_ff, config.d_model, ("mlp", "embed"), "wo")(hidden)
