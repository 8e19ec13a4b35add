"""Log filters shared by every part of tfm (data, training, interop): a module of its own so
that `tfm.data` needs nothing from `tfm.training` to quiet a library's message."""

from __future__ import annotations

import logging


class _DropMessages(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def silence_absl_message(prefix: str) -> None:
    """Drops absl log records (tfds and orbax log through absl) whose message starts with
    `prefix`: for warnings about what tfm does on purpose, printed on every command."""
    logger = logging.getLogger("absl")
    if not any(isinstance(f, _DropMessages) and f.prefix == prefix for f in logger.filters):
        logger.addFilter(_DropMessages(prefix))
