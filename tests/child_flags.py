"""The suite's XLA flags (set in tests/conftest.py), for a test's child process that should
compile as the tests do and for a check that needs XLA's own fusion emitters."""

from __future__ import annotations

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"
OLDER_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def child_xla_flags() -> str:
    """The suite's XLA_FLAGS (tests/conftest.py: its faster compiles) less its 8 simulated CPU
    devices, so a child process has one device, or what launch.sh gives it."""
    return " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split()
                    if not flag.startswith(DEVICE_COUNT))


def uses_older_emitters() -> bool:
    """Whether the suite's XLA_FLAGS turned XLA's own CPU fusion emitters off."""
    return OLDER_EMITTERS in os.environ.get("XLA_FLAGS", "").split()
