"""tfm: a JAX/Flax Transformer research codebase.

The public names, listed once here and importable from `tfm` (loaded on first use, so
`import tfm` starts no backend):

    from tfm import ModelConfig, DecoderLM, EncoderDecoder, lm_generate
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
PUBLIC = {
    "ConfigError": "tfm.checks",
    "ModelConfig": "tfm.nn.config",
    "paper_base": "tfm.nn.config",
    "paper_big": "tfm.nn.config",
    "dot_product_attention": "tfm.nn.attention",
    "Encoder": "tfm.nn.models",
    "DecoderLM": "tfm.nn.models",
    "EncoderDecoder": "tfm.nn.models",
    "DecoderCache": "tfm.nn.cache",
    "init_cache": "tfm.nn.cache",
    "DecodeConfig": "tfm.decode.search",
    "lm_generate": "tfm.decode.generate",
    "translate": "tfm.decode.generate",
    "train_and_evaluate": "tfm.training.train",
}
__all__ = sorted(PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in PUBLIC:
        raise AttributeError(f"module 'tfm' has no attribute {name!r}")
    return getattr(importlib.import_module(PUBLIC[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(PUBLIC))
