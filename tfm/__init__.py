"""tfm: a JAX/Flax Transformer research codebase."""

from tfm.config import ConfigError, ModelConfig

__all__ = ["ConfigError", "ModelConfig"]
