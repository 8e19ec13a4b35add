"""Scaled dot-product attention (Vaswani et al. 2017, eq. 1) and the masks that feed it.

The maths lives in tfm.kernels.reference, the specification every faster kernel is tested
against, below the kernels in the import graph; this module names it for the model's readers
and keeps the public path `tfm.nn.attention.dot_product_attention`.
"""

from __future__ import annotations

from tfm.kernels.reference import (
    MASKED_LOGIT,
    apply_keep,
    causal_mask,
    check_inputs,
    combine_masks,
    default_scale,
    dot_product_attention,
    dropout,
    dropout_keep,
    group_heads,
    local_window_mask,
    masked_softmax,
    padding_mask,
    segment_mask,
    valid_from_ids,
    valid_from_lengths,
)

__all__ = [
    "MASKED_LOGIT",
    "apply_keep",
    "causal_mask",
    "check_inputs",
    "combine_masks",
    "default_scale",
    "dot_product_attention",
    "dropout",
    "dropout_keep",
    "group_heads",
    "local_window_mask",
    "masked_softmax",
    "padding_mask",
    "segment_mask",
    "valid_from_ids",
    "valid_from_lengths",
]
