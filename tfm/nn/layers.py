"""Thin Flax (linen) modules over the pure functions in attention.py and positions.py.

Parameters carry logical axis names (vocab, embed, heads, kv_heads, head_dim, mlp, layers, relpos,
buckets) so sharding is a matter of rules (tfm/parallel/sharding.py), not code.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from tfm import kernels
from tfm.kernels import context_parallel, context_relative
from tfm.kernels.call import AttentionStructure, BlockBias, RelativeValue
from tfm.kernels.context_parallel import SequenceMask
from tfm.nn import positions
from tfm.nn.cache import CacheSlot, DecoderCache
from tfm.nn.config import ModelConfig

Array = jax.Array


def _kernel(names: tuple[str | None, ...], init: Any = None) -> Any:
    return nn.with_logical_partitioning(init or nn.initializers.xavier_uniform(), names)


def _zeros(names: tuple[str | None, ...]) -> Any:
    return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


class Projection(nn.Module):
    """y = x . kernel (+ bias), contracting the last len(in_features) axes of x.

    kernel: [*in_features, *features] with logical axis `names`; Glorot-uniform over those
    fans. The matmul is `tfm.kernels.linear`: compute-dtype operands in both passes, float32
    accumulation. `kernel` and `bias` are attributes, so a layer can hand several projections
    of one input to the kernels together (`project_together`).
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
    config: ModelConfig, x: Array, projections: list[Projection], out_dtype: Any = None,
    forward_only: bool = False,
) -> list[Array]:
    """x . kernel_i + bias_i for projections that share x's input axes (query, key and value
    of one input), through `tfm.kernels.projections` (which may run them as one matmul).

    x: [..., *in_features] -> [[..., *features_i] for each projection], in out_dtype (default
    the compute dtype).
    """
    has_bias = projections[0].bias is not None
    if any((p.bias is not None) != has_bias for p in projections):
        raise ValueError("project_together needs projections that all have a bias or all none")
    return kernels.projections(
        x,
        [p.kernel for p in projections],
        [p.bias for p in projections] if has_bias else None,
        backend=config.matmul_choice,
        num_contracted=len(projections[0].in_features),
        compute_dtype=config.compute_dtype,
        out_dtype=config.compute_dtype if out_dtype is None else out_dtype,
        forward_only=forward_only,
    )


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
        transpose. kernel: that transpose [d_model, vocab] if the kernels made one before a
        decoding loop (`models.output_kernel`); None reads the table."""
        config = self.config
        if kernel is None:
            kernel = self.table.T
        elif tuple(kernel.shape) != (config.d_model, self.vocab_size):
            raise ValueError(f"the tied output kernel must be [d_model, vocab] = "
                             f"{(config.d_model, self.vocab_size)}; got {tuple(kernel.shape)}")
        return kernels.linear(x, kernel, backend=config.matmul_choice,
                              compute_dtype=config.compute_dtype, out_dtype=jnp.float32)


class OutputProjection(nn.Module):
    """The untied output layer: logits = x . kernel (+ bias with lm_head_bias) in float32,
    through `tfm.kernels.linear`. kernel: [d_model, vocab] (Glorot-uniform), bias: [vocab]."""

    config: ModelConfig
    vocab_size: int

    @nn.compact
    def __call__(self, x: Array) -> Array:  # x: [batch, len, d_model] -> [batch, len, vocab]
        config = self.config
        kernel = self.param("kernel", _kernel(("embed", "vocab")),
                            (config.d_model, self.vocab_size), config.params_dtype)
        logits = kernels.linear(x, kernel, backend=config.matmul_choice,
                                compute_dtype=config.compute_dtype, out_dtype=jnp.float32)
        if config.lm_head_bias:
            bias = self.param("bias", nn.initializers.zeros_init(), (self.vocab_size,),
                              config.params_dtype)
            logits = logits + bias.astype(jnp.float32)
        return logits


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
    """The attention-logit bias from relative positions of schemes with a block_bias hook
    (T5 buckets, ALiBi, Kerple, FIRE), by its parts (BlockBias): the kernels evaluate it per
    block or write it out. None for schemes that add no bias."""

    config: ModelConfig
    bidirectional: bool

    @nn.compact
    def __call__(self, query_positions: Array, key_positions: Array) -> BlockBias | None:
        # query_positions: [batch, q_len]; key_positions: [batch, kv_len]
        scheme = self.config.scheme
        if scheme.block_bias is None:
            return None
        function, params = scheme.block_bias(self.config, self.bidirectional,
                                              _param_fn(self, self.config))
        dense = (None if scheme.dense_function is None
                 else scheme.dense_function(self.config, self.bidirectional))
        return BlockBias(function, params, jnp.asarray(query_positions, jnp.int32),
                         jnp.asarray(key_positions, jnp.int32),
                         learned=scheme.logit_bias_kind == "learned", dense=dense)


@struct.dataclass
class AttentionInputs:
    """What one attention call reads besides its hidden states, computed once per stack call.

    query_positions: [batch, q_len]; key_positions: [batch, kv_len], of every key attended to;
    structure: the mask and the shared position bias by their parts (AttentionStructure), the
    one form they take on the way to the kernel; sequence: under context parallelism
    (tfm.nn.context_split), the self- or cross-attention mask from each token's original index
    and segment, which replaces the structure's mask (the structure then only carries the
    position bias by blocks).
    """

    query_positions: Array
    key_positions: Array
    structure: AttentionStructure
    sequence: SequenceMask | None = None


class MultiHeadAttention(nn.Module):
    """Multi-head (or grouped-query) attention, self or cross (Vaswani et al. 2017 sec. 3.2.2).

    Self-attention applies RoPE or Shaw relative embeddings when configured; cross-attention uses
    no position information (queries from the decoder, keys/values from the encoder output).
    Query, key and value projections of one input go to the kernels together
    (`project_together`). The attention core is `tfm.kernels.attention` with the config's backend.

    With a KV cache slot (tfm.nn.cache.CacheSlot) the new keys and values are written into
    this layer's slots in place, attention reads the slots in the cache's layout, and the
    updated cache is returned (None without one).

    Applied with the "intermediates" collection mutable, it also sows its attention weights
    [batch, heads, q_len, kv_len] as "attention_weights" (the backend must return weights:
    "reference"; tfm/training/diagnostics.py).
    """

    config: ModelConfig
    is_cross: bool = False

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,  # [batch, q_len, d_model]
        inputs_kv: Array | None,  # [batch, kv_len, d_model], or None to read the cross cache
        inputs: AttentionInputs,  # positions, the mask and shared bias by parts
        slot: CacheSlot | None = None,  # this layer's place in the KV cache, or None
        deterministic: bool = True,
    ) -> tuple[Array, DecoderCache | None]:  # [batch, q_len, d_model], the updated cache
        config = self.config
        query, key, value = self._project(inputs_q, inputs_kv, deterministic)
        rotate = config.scheme.rotate
        if rotate is not None and not self.is_cross:
            query = rotate(config, query, inputs.query_positions)
            key = rotate(config, key, inputs.query_positions)
        if config.attention_log_length and not self.is_cross:
            scale = positions.log_length_scale(inputs.query_positions, config.attention_log_length)
            query = (query * scale[:, :, None, None]).astype(query.dtype)
        cache = None if slot is None else slot.cache
        # A self-attention prefill that fills the cache attends to its own keys and values as
        # a full pass does (tfm.nn.context.cached_inputs), and writes them for later steps.
        fresh = cache is not None and not self.is_cross and cache.filled_by(query.shape[1])
        reads_cache = cache is not None and not fresh and (not self.is_cross or inputs_kv is None)
        if cache is not None and inputs_kv is not None:  # new keys/values into this layer's slots
            start = (jnp.zeros_like(inputs.query_positions[:, 0]) if self.is_cross
                     else slot.write_index)
            new = (key, value) if self.is_cross else _in_token_order(inputs, key, value)
            cache = _write_cache(cache, self.is_cross, *new, slot.layer, start)
        # A fresh prefill reads its keys and values back from the slots it filled (the same
        # values, where the cache holds them as computed): its own copies die at the write,
        # not after every layer's prefill (GPT-2 medium's v5e-8 decode loop: 2.41 -> 1.93 GB
        # of temporaries; TPU's layout, CacheLayout.prefill_reads_back). Under a context mesh
        # the kernels take them in the split's order.
        if reads_cache:
            key, value = _read_cache(cache, self.is_cross, slot.layer)
        elif fresh and inputs.sequence is None and cache.layout.prefill_reads_back:
            keys, values = _read_cache(cache, self.is_cross, slot.layer)
            key, value = (cache.layout.in_model_order(keys, True),
                          cache.layout.in_model_order(values, False))
        # keys and values in a kernel's own layout (the reference one reads as computed)
        in_cache_layout = reads_cache and cache.layout.name != "reference"
        out = self._attend(query, key, value, inputs, in_cache_layout, deterministic)
        num_heads, head_dim = config.num_heads, config.resolved_head_dim
        names = ("heads", "head_dim", "embed")
        out_proj = _dense(config, (num_heads, head_dim), config.d_model, names, "out",
                          "attention_out")
        return out_proj(out), cache

    def _project(self, inputs_q: Array, inputs_kv: Array | None,
                 forward_only: bool = False) -> tuple[Array, ...]:
        """query [batch, q_len, heads, head_dim]; key, value [batch, kv_len, kv_heads, head_dim]
        (None without inputs_kv). forward_only: no backward pass follows (deterministic)."""
        config = self.config
        num_heads, num_kv_heads = config.num_heads, config.resolved_num_kv_heads
        head_dim, d_model = config.resolved_head_dim, config.d_model
        kv_names = ("embed", "kv_heads", "head_dim")
        query_proj = _dense(config, d_model, (num_heads, head_dim),
                            ("embed", "heads", "head_dim"), "query", "qkv")
        key_proj = _dense(config, d_model, (num_kv_heads, head_dim), kv_names, "key", "qkv")
        value_proj = _dense(config, d_model, (num_kv_heads, head_dim), kv_names, "value", "qkv")
        if inputs_kv is inputs_q:
            return tuple(project_together(config, inputs_q, [query_proj, key_proj, value_proj],
                                          forward_only=forward_only))
        if inputs_kv is None:
            return query_proj(inputs_q), None, None
        return query_proj(inputs_q), *project_together(config, inputs_kv, [key_proj, value_proj],
                                                       forward_only=forward_only)

    def _attend(
        self, query: Array, key: Array, value: Array, inputs: AttentionInputs,
        cache_layout: bool, deterministic: bool,
    ) -> Array:  # [batch, q_len, heads, head_dim]
        """The attention core, with a Shaw relative scheme's logit bias and value term."""
        config = self.config
        value_term, structure = None, inputs.structure
        if config.scheme.relative is not None and not self.is_cross:
            relative, value_term = config.scheme.relative(
                config, inputs.query_positions, inputs.key_positions, _param_fn(self, config))
            structure = structure.replace(relative=relative)
        if inputs.sequence is not None:
            return _context_parallel_attend(config, query, key, value, inputs.sequence,
                                            structure, value_term)
        collect = self.is_mutable_collection("intermediates")
        dropout_rate = 0.0 if deterministic else config.attention_dropout_rate
        result = kernels.attention(
            query,
            key.astype(query.dtype),
            value.astype(query.dtype),
            backend=config.attention_backend,
            scale=config.resolved_attention_scale,
            dropout_rate=dropout_rate,
            dropout_rng=self.make_rng("dropout") if dropout_rate > 0 else None,
            return_weights=value_term is not None or collect,
            cache_layout=cache_layout,
            structure=structure,
        )
        if value_term is None and not collect:
            return result
        out, weights = result
        self.sow("intermediates", "attention_weights", weights)
        return out if value_term is None else out + value_term(weights).astype(out.dtype)


def _context_parallel_attend(
    config: ModelConfig,
    query: Array,  # [batch, len, heads, head_dim], rows split over the context axis
    key: Array,  # [batch, len, kv_heads, head_dim]
    value: Array,  # like key
    sequence: SequenceMask,  # each token's original index and segment
    structure: AttentionStructure,  # the bias by blocks, or Shaw's relative bias
    value_term: RelativeValue | None,  # Shaw's relative values, or None
) -> Array:  # [batch, len, heads, head_dim]
    """Self- or cross-attention under context parallelism (tfm.kernels.context_parallel): each
    device's chunk by the flex kernel when it is the backend, else the reference maths; a bias
    from the queries (Shaw) by tfm.kernels.context_relative, under all_gather only."""
    key, value = key.astype(query.dtype), value.astype(query.dtype)
    scale = config.resolved_attention_scale
    if structure.relative is not None:
        if config.context_parallel != "all_gather":
            raise ValueError(f"position_scheme={config.position_scheme!r} under context_parallel="
                             f"{config.context_parallel!r}: its value term needs each key "
                             "block's weights; use all_gather")
        return context_relative.relative_attention_by_rules(
            query, key, value, sequence, structure.relative, value_term, scale=scale)
    kernel = "flex" if config.attention_backend == "flex" else "reference"
    return context_parallel.attention_by_rules(
        query, key, value, sequence, structure.bias, strategy=config.context_parallel,
        scale=scale, kernel=kernel)


def _in_token_order(inputs: AttentionInputs, key: Array, value: Array) -> tuple[Array, Array]:
    """Self-attention's key and value [batch, len, kv_heads, head_dim] in token order, as the
    cache holds them: a prefill split over the context axis (tfm.nn.context_split) computed
    them load balanced."""
    if inputs.sequence is None or inputs.sequence.layout != "balanced":
        return key, value
    shards = context_parallel.mesh_context_size()
    return (context_parallel.restore_order(key, shards),
            context_parallel.restore_order(value, shards))


def _write_cache(
    cache: DecoderCache, is_cross: bool, key: Array, value: Array, layer: Array | int,
    start: Array,  # [batch] int32
) -> DecoderCache:
    """`cache` with key, value [batch, new_len, kv_heads, head_dim] in layer `layer`'s self- or
    cross-attention slots from `start` on."""
    names = ("cross_keys", "cross_values") if is_cross else ("keys", "values")
    written = {
        name: cache.layout.write(getattr(cache, name), new, layer, start, is_key)
        for name, new, is_key in zip(names, (key, value), (True, False), strict=True)
    }
    return cache.replace(**written)


def _read_cache(cache: DecoderCache, is_cross: bool, layer: Array | int) -> tuple[Array, Array]:
    """Layer `layer`'s self- or cross-attention keys and values, in the cache's layout."""
    if is_cross:
        keys, values = cache.cross_keys, cache.cross_values
    else:
        keys, values = cache.keys, cache.values
    return cache.layout.read(keys, layer), cache.layout.read(values, layer)


class FeedForward(nn.Module):
    """Position-wise FFN (Vaswani et al. 2017 eq. 2): ReLU as in the paper, GELU (exact erf, or
    the tanh approximation of GPT-2's "gelu_new"), or the gated SwiGLU / GEGLU (Shazeer 2020;
    T5 v1.1's gated GELU uses the tanh approximation), whose gate makes it three matrices.
    The activation runs in config.ffn_activation_dtype: on CPU ("auto") on the first matmul's
    float32 accumulator, the second matmul casting its input (one rounding instead of one per
    elementwise op; with bfloat16 activations XLA's CPU backend split GELU into several
    fusions, each rounding and re-reading [tokens, d_ff]); on TPU and GPU in the compute dtype,
    so the [tokens, d_ff] arrays kept for the backward pass are half the bytes."""

    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:  # x: [batch, len, d_model]
        config = self.config
        hidden_dtype = _ffn_activation_dtype(config)
        wi = _dense(config, config.d_model, config.d_ff, ("embed", "mlp"), "wi")
        if config.activation in ("swiglu", "geglu"):
            wi_gate = _dense(config, config.d_model, config.d_ff, ("embed", "mlp"), "wi_gate")
            hidden, gate = project_together(config, x, [wi, wi_gate], out_dtype=hidden_dtype)
            gate = nn.silu(gate) if config.activation == "swiglu" else nn.gelu(gate, True)
            hidden = gate * hidden
        else:
            hidden = project_together(config, x, [wi], out_dtype=hidden_dtype)[0]
            if config.activation == "relu":
                hidden = nn.relu(hidden)
            elif config.activation == "gelu":
                hidden = gelu(hidden)
            else:  # gelu_tanh (GPT-2's "gelu_new")
                hidden = nn.gelu(hidden, approximate=True)
        return _dense(config, config.d_ff, config.d_model, ("mlp", "embed"), "wo")(hidden)


def _ffn_activation_dtype(config: ModelConfig) -> jnp.dtype:
    """config.ffn_activation_dtype, with "auto" resolved for the platform compiled for."""
    choice = kernels.ffn_activation_dtype(config.ffn_activation_dtype)
    return jnp.dtype(jnp.float32) if choice == "float32" else config.compute_dtype


def gelu(x: jax.Array) -> jax.Array:
    """Exact GELU, x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2))) (Hendrycks & Gimpel 2016), in
    x's dtype. Written with erf, which XLA computes as one rational approximation (jax.nn.gelu's
    erfc branches); the two agree to ~1e-6."""
    return 0.5 * x * (1.0 + jax.lax.erf(x * jnp.asarray(2.0**-0.5, x.dtype)))
