"""Parameter and FLOP counts of a model, and model FLOPs utilisation (device peaks:
tfm/kernels/hardware.py). The sizes come from the model itself: the family's parameter shapes
under jax.eval_shape (tfm.nn.families.Family.counts), never from a second description of it.

Convention (Kaplan et al. 2020 sec. 2.1; Chowdhery et al. 2022 (PaLM) appendix B): training
costs 6 FLOPs per matmul weight per token (2 forward, 4 backward) plus, per layer, 12 * T * d_attn
for the attention scores and the weighted sum of values (QK^T and AV, 2 * T * d_attn each
forward), where T is the number of keys attended to and d_attn = num_heads * head_dim. Matmul
weights are the attention projections, the FFN matrices and the output projection (counted also
when tied to the embedding, since the matmul still runs); embedding lookups, norms, biases,
softmax and position-scheme extras (Shaw tables, T5/ALiBi biases) are not counted, nor are causal
or local-window masks (the masked score matrix is computed in full).
"""

from __future__ import annotations

import functools

from tfm.nn.config import ModelConfig
from tfm.nn.families import ModelCounts, get_family


@functools.lru_cache(maxsize=64)
def model_counts(config: ModelConfig, mode: str = "lm") -> ModelCounts:
    """The sizes of the model family `mode` (tfm.nn.families.FAMILIES) builds from `config`."""
    return get_family(mode).counts(config)


def count_params(config: ModelConfig, mode: str = "lm") -> int:
    """Every parameter of the model family `mode` builds from `config`."""
    return model_counts(config, mode).params


def attention_core_flops(config: ModelConfig, keys: int, layers: int) -> float:
    """Training FLOPs per query token of the attention core (q k^T and weights . v, forward and
    backward) over `keys` keys in each of `layers` layers: 12 * layers * keys * d_attn."""
    return 12.0 * layers * keys * config.num_heads * config.resolved_head_dim


def flops_per_token(
    config: ModelConfig, seq_len: int, mode: str = "lm", source_len: int | None = None
) -> float:
    """Training FLOPs per token: 6 * matmul weights + 12 * layers * keys * d_attn.

    Per output token of a `seq_len`-token sequence (the target, for an encoder-decoder, with a
    `source_len`-token source, default seq_len; for an encoder, its input): the work done once
    per source token (the encoder, the cross-attention key/value projections) is spread over
    the output tokens. Multiply by tokens/s for FLOP/s."""
    counts = model_counts(config, mode)
    source_len = seq_len if source_len is None else source_len
    weights = 6.0 * (counts.target_weights + counts.source_weights * source_len / seq_len)
    return weights + attention_flops_per_token(config, seq_len, mode, source_len)


def attention_flops_per_token(
    config: ModelConfig, seq_len: int, mode: str = "lm", source_len: int | None = None
) -> float:
    """flops_per_token's attention-core part (12 * layers * keys * d_attn), the work a fused
    attention kernel does (self-attention, and for an encoder-decoder cross-attention and the
    encoder's, spread over the output tokens as flops_per_token does)."""
    counts = model_counts(config, mode)
    source_len = seq_len if source_len is None else source_len
    return 12.0 * (counts.self_width * seq_len + counts.cross_width * source_len
                   + counts.source_width * source_len * source_len / seq_len)


def mfu(
    tokens_per_second: float, flops_per_token: float, num_devices: int, peak_per_device: float
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' combined peak."""
    return tokens_per_second * flops_per_token / (num_devices * peak_per_device)
