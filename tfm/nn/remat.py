"""Rematerialisation policies: what each block keeps from its forward pass for the backward pass.

`model.remat` names one; whatever a policy does not keep is recomputed in the backward pass
(less activation memory, more FLOPs). The numbers are the same under every policy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from tfm.checks import ConfigError, check_choice

# name -> the jax.checkpoint policy of each block (None: nothing saved, all recomputed).
POLICIES: dict[str, Callable[..., Any] | None] = {
    "full": None,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    # What dots_with_no_batch_dims_saveable keeps, moved to host memory until the backward pass.
    "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
        offload_src="device", offload_dst="pinned_host"
    ),
}
CHOICES = ("none", *POLICIES)
# jax lowers a move between memory spaces only for these (jax/_src/dispatch.py): elsewhere
# `offload` would compile to no move at all.
OFFLOAD_PLATFORMS = ("tpu", "gpu")


def resolve(value: Any) -> str:
    """The policy name of a `model.remat` value: a name, or True / False (what remat was before
    it named a policy) for "full" / "none"."""
    if isinstance(value, bool):
        return "full" if value else "none"
    check_choice("remat", value, CHOICES)
    return value


def policy(name: str) -> Callable[..., Any] | None:
    """The jax.checkpoint policy of a resolved name other than "none"."""
    return POLICIES[name]


def check_platform(name: str, platform: str) -> None:
    """Raises ConfigError if policy `name` cannot do what it says on `platform` (e.g. "cpu")."""
    if name == "offload" and platform not in OFFLOAD_PLATFORMS:
        raise ConfigError(
            f"model.remat='offload' moves saved activations to host memory, which needs a "
            f"{' or '.join(OFFLOAD_PLATFORMS)} (on {platform} they are in host memory already and "
            f"jax moves nothing); choose one of: {', '.join(c for c in CHOICES if c != 'offload')}"
        )
