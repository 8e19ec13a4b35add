"""The one frozen model config passed to every module, validated on construction.

Every field is checked in `__post_init__`, so a bad value fails with one readable message
naming the field and the allowed values, before any parameter is created or anything compiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from tfm import kernels
from tfm.checks import (
    ConfigError,
    check_bool,
    check_choice,
    check_positive,
    check_rate,
    section_dict,
)

# loss_backend_for, FUSED_LOSS_MIN_VOCAB: a platform rule, tfm.kernels'; named here for callers.
from tfm.kernels import FUSED_LOSS_MIN_VOCAB, loss_backend_for  # noqa: F401
from tfm.kernels.context_parallel import STRATEGIES as CONTEXT_STRATEGIES
from tfm.nn import remat as remat_lib
from tfm.nn import rope_scaling
from tfm.nn.positions import ROPE_SCALINGS, get_scheme  # noqa: F401  (ROPE_SCALINGS: public)

SINUSOIDAL_LAYOUTS = ("paper", "concat")
ROPE_LAYOUTS = ("interleaved", "rotate_half")
NORM_TYPES = ("layernorm", "rmsnorm")
NORM_PLACEMENTS = ("post", "pre")
ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu", "geglu")
GATED_ACTIVATIONS = ("swiglu", "geglu")
BIAS_GROUPS = ("qkv", "attention_out", "mlp", "lm_head")
FFN_ACTIVATION_DTYPES = ("auto", "float32", "compute")
LOSS_BACKENDS = ("auto", "reference", "fused")

DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of an encoder, a decoder-only LM, or an encoder-decoder Transformer.

    Defaults are the paper's base model (Vaswani et al. 2017, Table 3), a 6 + 6-layer
    encoder-decoder, with a small vocabulary; `ModelConfig.decoder_only(...)` starts a
    decoder-only LM's config instead (num_encoder_layers=0, as DecoderLM requires).
    """

    # Vocabulary. `vocab_size` is the decoder's (target) vocabulary; `source_vocab_size`
    # (None = same) the encoder's. `share_embeddings` shares one table between encoder and
    # decoder (needs equal sizes); `tie_output` reuses the decoder table as the output projection.
    vocab_size: int = 256
    source_vocab_size: int | None = None
    share_embeddings: bool = True
    tie_output: bool = True
    scale_embeddings: bool = True  # multiply embeddings by sqrt(d_model) (paper sec. 3.4)
    # Std of the token-embedding init; None = d_model ** -0.5. With a tied output, a small value
    # (GPT-2: 0.02) starts a language model near loss ln(vocab_size).
    embedding_init_stddev: float | None = None
    # Which token id pads (None: the model has no pad token). Only decoding uses it, to fill
    # the outputs after EOS: validity always comes from lengths / segment ids / valid masks,
    # never from token values, so a real token equal to pad_id is attended to like any other.
    pad_id: int | None = 0
    # BERT-style encoder inputs: token-type (segment A/B) embeddings added to the token
    # embeddings (0 = none), and a norm after the embedding sum.
    type_vocab_size: int = 0
    embedding_norm: bool = False

    # Sizes.
    d_model: int = 512  # width of every residual stream
    num_heads: int = 8  # attention heads (query heads under GQA)
    num_kv_heads: int | None = None  # None = num_heads (MHA); 1 = MQA; else GQA
    head_dim: int | None = None  # None = d_model // num_heads
    d_ff: int = 2048  # inner width of each feed-forward layer
    num_encoder_layers: int = 6  # 0 for a decoder-only LM (DecoderLM requires it)
    num_decoder_layers: int = 6  # decoder blocks (an LM's blocks)

    # Regularisation (paper sec. 5.4: P_drop = 0.1 on sub-layer outputs and embedding sums).
    dropout_rate: float = 0.1
    attention_dropout_rate: float = 0.0  # on the attention weights (the paper has none)

    # Position scheme and its options.
    position_scheme: str = "sinusoidal"  # tfm.nn.positions.POSITION_SCHEMES
    max_len: int = 512  # only bounds `learned` positions; other schemes work at any position
    sinusoidal_layout: str = "paper"  # "paper" (interleaved sin/cos) or "concat" (tensor2tensor)
    rope_base: float = 10000.0  # theta of the rotation frequencies base^(-2i/d)
    rope_layout: str = "rotate_half"  # which dimensions pair up: "rotate_half" or "interleaved"
    rope_fraction: float = 1.0  # fraction of head_dim rotated (partial rotary, GPT-NeoX)
    # Long-context RoPE scaling (tfm.nn.rope_scaling): none, linear, ntk, dynamic, yarn,
    # longrope or llama3, by rope_scaling_factor over the original context rope_original_max_len.
    rope_scaling: str = "none"
    rope_scaling_factor: float = 1.0
    rope_original_max_len: int = 8192
    rope_low_freq_factor: float = 1.0  # llama3: the band edges of the smooth blend
    rope_high_freq_factor: float = 4.0
    rope_beta_fast: float = 32.0  # yarn: dimensions making more turns in the context extrapolate
    rope_beta_slow: float = 1.0  # yarn: dimensions making fewer turns interpolate
    rope_mscale: float = 0.0  # yarn: Hugging Face's mscale / mscale_all_dim (0: unset)
    rope_mscale_all_dim: float = 0.0
    rope_truncate: bool = True  # yarn: the ramp's ends rounded to whole dimensions
    rope_attention_factor: float = 0.0  # factor on rotated q and k; 0: the scaling's own
    rope_short_factor: tuple[float, ...] = ()  # longrope: per-frequency factors up to the
    rope_long_factor: tuple[float, ...] = ()  # original context, and past it
    # > 0: self-attention queries at position p are scaled by max(1, ln(p + 1) / ln(this)),
    # a temperature that grows with the log of the position past this length (log-length
    # scaling, for NoPE or with YaRN); evaluation may change it on a trained model. 0 = off.
    attention_log_length: int = 0
    relative_max_distance: int = 16  # Shaw et al. clipping distance k
    relative_values: bool = True  # Shaw et al. also add relative embeddings to values
    t5_num_buckets: int = 32  # relative-position buckets of the T5 bias
    t5_max_distance: int = 128  # distance beyond which T5 buckets stop growing
    t5_shared_across_layers: bool = True  # T5 computes the bias once per stack

    # Block structure.
    norm_type: str = "layernorm"  # "layernorm" or "rmsnorm"
    norm_placement: str = "post"  # post = the paper's Add & Norm; pre = pre-LN + final norm
    norm_eps: float = 1e-6  # epsilon inside each norm
    activation: str = "relu"  # feed-forward activation: relu, gelu, gelu_tanh, swiglu, geglu
    use_bias: bool = True  # biases in dense layers (the paper has them; Llama-style has none)
    # Per-group overrides of use_bias (None = use_bias): query/key/value projections, the
    # attention output projection, the feed-forward layers. Qwen2 has biases on q/k/v only;
    # GPT-2 and BERT everywhere. The untied LM head has a bias only when lm_head_bias=True.
    qkv_bias: bool | None = None
    attention_out_bias: bool | None = None
    mlp_bias: bool | None = None
    lm_head_bias: bool | None = False
    # Norm after the last block: None = pre-LN has one and post-LN has none (the paper);
    # True after post-LN is torch.nn.Transformer's default; False drops it after pre-LN.
    final_norm: bool | None = None
    # Attention logit scale: None = head_dim ** -0.5 (the paper); T5 uses 1.0.
    attention_scale: float | None = None
    # Multiplies the decoder output before the LM head (T5 v1.0: d_model ** -0.5 with tied
    # embeddings); None = 1.
    output_scale: float | None = None
    local_window: int | None = None  # restricted self-attention radius r (paper Table 1)

    # Implementation.
    # Three separate choices (tfm.kernels): the attention core (tfm.kernels.BACKENDS; "auto" =
    # the platform's fastest that serves the model, else the reference maths); the matmul of
    # every dense layer (tfm.kernels.MATMULS: reference, cpu, fused, forward_fused); the KV
    # cache layout (tfm.kernels.CACHE_LAYOUTS: reference, cpu, tpu). "auto" for the last two =
    # what the attention backend's platform profile names (the "cpu" backend: the cpu ones;
    # the reference, splash and flex on TPU: the tpu layout and forward_fused; the others:
    # the reference layout, on GPU the fused matmul, on TPU forward_fused).
    attention_backend: str = "auto"
    matmul: str = "auto"
    cache_layout: str = "auto"
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"  # dtype the parameters (and optimizer state) are kept in
    scan_layers: bool = False  # nn.scan over layers: compile time flat in depth
    # What each block keeps for the backward pass (tfm.nn.remat.CHOICES): "none" keeps all its
    # activations, "full" recomputes them all, the others keep some. True / False (the
    # old bool) mean "full" / "none".
    remat: str = "none"
    # The dtype the FFN's activation runs in: "float32" (on the first matmul's float32
    # accumulator, then rounded once for the second matmul), "compute" (`dtype`: the matmul's
    # output rounded first, as most mixed-precision codebases do; a TPU step then writes and
    # reads its [tokens, d_ff] arrays at half the bytes), "auto" = "float32" on CPU (measured
    # faster there: one fusion) and "compute" on TPU and GPU. Same values when dtype=float32.
    ffn_activation_dtype: str = "auto"
    # How training and evaluation compute the output projection and cross-entropy:
    # "reference" writes the [tokens, vocab] logits and takes their log-softmax; "fused" runs
    # tfm.kernels.fused_cross_entropy (one Pallas kernel, no logits in memory; interpret mode
    # off TPU, for tests); "auto" = "fused" on TPU for vocabularies of 2,048 or more
    # (FUSED_LOSS_MIN_VOCAB), "reference" otherwise. Same values up to summation order;
    # decoding always computes logits.
    loss_backend: str = "auto"
    # How self-attention runs when the mesh splits every row's sequence (mesh.context > 1;
    # tfm.kernels.context_parallel): "all_gather" gathers every chunk's keys and values to
    # each device, "ring" passes them around the devices with an online softmax. Unused with
    # mesh.context=1.
    context_parallel: str = "all_gather"

    @classmethod
    def decoder_only(cls, vocab_size: int, num_layers: int = 6, **fields: Any) -> ModelConfig:
        """The config of a decoder-only language model (tfm.nn.models.DecoderLM): `num_layers`
        decoder blocks and no encoder; other fields as given, else ModelConfig's defaults.
        E.g. ModelConfig.decoder_only(vocab_size=65, num_layers=4, d_model=128, num_heads=4,
        d_ff=512, norm_placement="pre")."""
        for field, why in (("num_encoder_layers", "a decoder-only model has no encoder"),
                           ("num_decoder_layers", "num_layers= sets the decoder's depth"),
                           ("source_vocab_size", "a decoder-only model has no source side")):
            if field in fields:
                raise ConfigError(f"decoder_only() sets {field} itself ({why}); drop "
                                  f"{field}={fields[field]!r}")
        return cls(vocab_size=vocab_size, num_encoder_layers=0, num_decoder_layers=num_layers,
                   **fields)

    def __post_init__(self) -> None:
        object.__setattr__(self, "remat", remat_lib.resolve(self.remat))  # frozen: set once
        for field in ("rope_short_factor", "rope_long_factor"):  # lists from JSON or a command
            object.__setattr__(self, field, tuple(float(x) for x in getattr(self, field)))
        self._check_vocabulary_and_switches()
        self._check_sizes()
        self.scheme  # noqa: B018  (ConfigError naming the registered schemes if unknown)
        self._check_position_options()
        self._check_blocks_and_implementation()
        self.scheme.check(self)  # the scheme's own constraints, on fields checked above

    def _check_vocabulary_and_switches(self) -> None:
        check_positive("vocab_size", self.vocab_size)
        if self.source_vocab_size is not None:
            check_positive("source_vocab_size", self.source_vocab_size)
        if self.share_embeddings and self.source_vocab_size not in (None, self.vocab_size):
            raise ConfigError(
                f"share_embeddings=True needs source_vocab_size == vocab_size; got "
                f"source_vocab_size={self.source_vocab_size}, vocab_size={self.vocab_size}"
            )
        if self.embedding_init_stddev is not None and not (
            isinstance(self.embedding_init_stddev, int | float) and self.embedding_init_stddev > 0
        ):
            raise ConfigError(
                f"embedding_init_stddev={self.embedding_init_stddev!r} must be a number > 0 "
                "(or None for d_model ** -0.5)"
            )
        if self.pad_id is not None:
            check_positive("pad_id", self.pad_id, allow_zero=True)
        check_positive("type_vocab_size", self.type_vocab_size, allow_zero=True)
        for field in ("share_embeddings", "tie_output", "scale_embeddings", "embedding_norm"):
            check_bool(field, getattr(self, field))
        for field in ("use_bias", "relative_values", "t5_shared_across_layers"):
            check_bool(field, getattr(self, field))
        for group in BIAS_GROUPS:
            check_bool(f"{group}_bias", getattr(self, f"{group}_bias"), optional=True)
        check_bool("final_norm", self.final_norm, optional=True)
        for field in ("attention_scale", "output_scale"):
            value = getattr(self, field)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
            ):
                raise ConfigError(f"{field}={value!r} must be None (the default) or a number > 0")

    def _check_sizes(self) -> None:
        for field in ("d_model", "num_heads", "d_ff"):
            check_positive(field, getattr(self, field))
        check_positive("num_encoder_layers", self.num_encoder_layers, allow_zero=True)
        check_positive("num_decoder_layers", self.num_decoder_layers, allow_zero=True)
        if self.head_dim is None and self.d_model % self.num_heads:
            raise ConfigError(
                f"d_model={self.d_model} is not divisible by num_heads={self.num_heads}; "
                "pick sizes that divide or set head_dim explicitly"
            )
        if self.head_dim is not None:
            check_positive("head_dim", self.head_dim)
        if self.num_kv_heads is not None:
            check_positive("num_kv_heads", self.num_kv_heads)
            if self.num_heads % self.num_kv_heads:
                raise ConfigError(
                    f"num_heads={self.num_heads} is not divisible by "
                    f"num_kv_heads={self.num_kv_heads}; each key/value head serves a whole "
                    "group of query heads"
                )
        check_rate("dropout_rate", self.dropout_rate)
        check_rate("attention_dropout_rate", self.attention_dropout_rate)

    def _check_position_options(self) -> None:
        check_positive("max_len", self.max_len)
        check_choice("sinusoidal_layout", self.sinusoidal_layout, SINUSOIDAL_LAYOUTS)
        check_choice("rope_layout", self.rope_layout, ROPE_LAYOUTS)
        if not self.rope_base > 1:
            raise ConfigError(f"rope_base={self.rope_base!r} must be > 1")
        for field in ("rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"{field}={value!r} must be a number > 0")
        check_positive("rope_original_max_len", self.rope_original_max_len)
        log_length = self.attention_log_length
        if isinstance(log_length, bool) or not isinstance(log_length, int) or log_length in (1,) \
                or log_length < 0:
            raise ConfigError(f"attention_log_length={log_length!r} must be 0 (off) or an "
                              "integer >= 2")
        self.rope_scaling_spec.check(round(self.resolved_head_dim * self.rope_fraction))
        if not 0.0 < self.rope_fraction <= 1.0:
            raise ConfigError(f"rope_fraction={self.rope_fraction!r} must be in (0, 1]")
        check_positive("relative_max_distance", self.relative_max_distance)
        check_positive("t5_num_buckets", self.t5_num_buckets)
        check_positive("t5_max_distance", self.t5_max_distance)

    def _check_blocks_and_implementation(self) -> None:
        check_choice("norm_type", self.norm_type, NORM_TYPES)
        check_choice("norm_placement", self.norm_placement, NORM_PLACEMENTS)
        if not self.norm_eps > 0:
            raise ConfigError(f"norm_eps={self.norm_eps!r} must be > 0")
        check_choice("activation", self.activation, ACTIVATIONS)
        if self.local_window is not None:
            check_positive("local_window", self.local_window)
        check_choice("attention_backend", self.attention_backend, kernels.CHOICES)
        kernels.check_config(self.attention_backend, **self.attention_needs)
        check_choice("matmul", self.matmul, kernels.MATMUL_CHOICES)
        check_choice("cache_layout", self.cache_layout, kernels.CACHE_LAYOUT_CHOICES)
        if "auto" not in (self.attention_backend, self.cache_layout):  # resolved when traced
            kernels.cache_layout(self.attention_backend, self.cache_layout)
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("param_dtype", self.param_dtype, DTYPES)
        check_choice("ffn_activation_dtype", self.ffn_activation_dtype,
                     FFN_ACTIVATION_DTYPES)
        check_choice("loss_backend", self.loss_backend, LOSS_BACKENDS)
        check_choice("context_parallel", self.context_parallel, CONTEXT_STRATEGIES)

    # Derived values: read these, never recompute them elsewhere.
    @property
    def scheme(self) -> Any:
        """The registry entry of `position_scheme` (a tfm.nn.positions.PositionScheme)."""
        return get_scheme(self.position_scheme)

    @property
    def matmul_choice(self) -> str:
        """What tfm.kernels.linear is asked for: `matmul`, or with "auto" the matmul of the
        attention backend's platform profile (`kernels.profile_matmul`), resolved where it is
        compiled: read it while tracing."""
        if self.matmul != "auto":
            return self.matmul
        return kernels.profile_matmul(self.attention_backend).name

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.num_heads

    def has_bias(self, group: str) -> bool:
        """Whether the dense layers of `group` (one of BIAS_GROUPS) have a bias."""
        check_choice("bias group", group, BIAS_GROUPS)
        value = getattr(self, f"{group}_bias")
        return self.use_bias if value is None else value

    @property
    def has_final_norm(self) -> bool:
        return self.norm_placement == "pre" if self.final_norm is None else self.final_norm

    @property
    def resolved_attention_scale(self) -> float:
        if self.attention_scale is None:
            return self.resolved_head_dim**-0.5
        return float(self.attention_scale)

    @property
    def rope_scaling_spec(self) -> rope_scaling.RopeScaling:
        """The RoPE scaling these fields describe."""
        return rope_scaling.RopeScaling(
            self.rope_scaling, self.rope_scaling_factor, self.rope_original_max_len,
            self.rope_low_freq_factor, self.rope_high_freq_factor, self.rope_beta_fast,
            self.rope_beta_slow, self.rope_mscale, self.rope_mscale_all_dim, self.rope_truncate,
            self.rope_attention_factor, self.rope_short_factor, self.rope_long_factor,
        )

    @property
    def rope_frequencies(self) -> np.ndarray:
        """RoPE's rotation frequencies (float64, static) with this config's scaling (those up
        to the original context for the length-dependent dynamic and longrope)."""
        rotated = round(self.resolved_head_dim * self.rope_fraction)
        return rope_scaling.static_frequencies(self.rope_scaling_spec, rotated, self.rope_base)

    @property
    def resolved_num_kv_heads(self) -> int:
        return self.num_kv_heads if self.num_kv_heads is not None else self.num_heads

    @property
    def resolved_source_vocab_size(self) -> int:
        return self.source_vocab_size if self.source_vocab_size is not None else self.vocab_size

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    @property
    def params_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)

    def for_platform(self, platform: str, longest_row: int | None = None) -> ModelConfig:
        """This config with attention_backend and loss_backend "auto" resolved for `platform`
        ("cpu", "gpu" or "tpu"), e.g. to compile for an accelerator on a CPU host; named
        backends stay. longest_row: the longest rows the run attends over (tokens), if known:
        rows that fit in one kernel block take the reference (tfm.kernels.within_one_block)."""
        config = self
        if config.loss_backend == "auto":
            config = config.replace(loss_backend=loss_backend_for(platform, config.vocab_size))
        if config.attention_backend != "auto":
            return config
        backend, _ = kernels.auto_choice(platform, longest_row, **config.attention_needs)
        return config.replace(attention_backend=backend.name)

    @property
    def attention_needs(self) -> dict[str, Any]:
        """What the attention backend must offer this model (tfm.kernels.auto_choice's keyword
        arguments): returned weights, dropout, the scheme's logit bias kind, dtype, head size."""
        return dict(
            needs_weights=self.scheme.needs_attention_weights(self),
            needs_dropout=self.attention_dropout_rate > 0,
            bias=self.scheme.logit_bias_kind,
            dtype=self.dtype,
            head_dim=self.resolved_head_dim,
        )

    def replace(self, **changes: Any) -> ModelConfig:
        return from_dict({**dataclasses.asdict(self), **changes})


def from_dict(values: Mapping[str, Any]) -> ModelConfig:
    """A ModelConfig from a mapping (e.g. an ml_collections ConfigDict); unknown keys raise."""
    known = sorted(field.name for field in dataclasses.fields(ModelConfig))
    return ModelConfig(**section_dict(values, "model", known))


def paper_base(vocab_size: int = 37000) -> ModelConfig:
    """The paper's base model: N=6, d_model=512, d_ff=2048, h=8, P_drop=0.1, shared embeddings
    (Vaswani et al. 2017, Table 3; 37,000-token shared BPE vocabulary for WMT En-De)."""
    return ModelConfig(
        vocab_size=vocab_size,
        share_embeddings=True,
        tie_output=True,
        d_model=512,
        num_heads=8,
        d_ff=2048,
        num_encoder_layers=6,
        num_decoder_layers=6,
        dropout_rate=0.1,
        position_scheme="sinusoidal",
        norm_placement="post",
        activation="relu",
    )


def paper_big(vocab_size: int = 37000) -> ModelConfig:
    """The paper's big model (Table 3): d_model=1024, d_ff=4096, h=16, P_drop=0.3."""
    return paper_base(vocab_size).replace(d_model=1024, d_ff=4096, num_heads=16, dropout_rate=0.3)
