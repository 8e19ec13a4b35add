"""The XLA_FLAGS for a test's child process that should compile as the tests do."""

from __future__ import annotations

import os

DEVICE_COUNT = "--xla_force_host_platform_device_count"


def child_xla_flags() -> str:
    """The suite's XLA_FLAGS (tests/conftest.py: its faster compiles) less its 8 simulated CPU
    devices, so a child process has one device, or what launch.sh gives it."""
    return " ".join(flag for flag in os.environ.get("XLA_FLAGS", "").split()
                    if not flag.startswith(DEVICE_COUNT))
