"""The config a run was trained with, as a config file: `--config=tfm/saved_config.py:WORKDIR`.

Training writes the whole resolved config to WORKDIR/config.json; `eval`, `generate` and
`average` on a workdir read it back through this file (tfm.main does the swap), so a command
on a run needs none of its overrides repeated, while `--config.x=y` flags still override it:
ml_collections' config_flags applies them to the ConfigDict returned here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ml_collections
from ml_collections import config_dict

CONFIG_FILE = "config.json"  # in the workdir; written by tfm.training.train
# Saved as what "auto" resolved to on the training platform; "auto" again, so that a run
# trained on a TPU (splash attention, fused loss) is evaluated on a CPU and vice versa. The
# two choose an implementation, not the parameters (tfm.training.checkpoint.IMPLEMENTATION_ONLY).
_RESOLVED_PER_PLATFORM = ("attention_backend", "loss_backend")


class NoSavedConfig(FileNotFoundError):
    """The workdir has no config.json: no training run wrote it."""


def saved_config_path(workdir: str | Path) -> Path:
    return Path(workdir) / CONFIG_FILE


def _as_config_value(value: Any) -> Any:
    """A JSON value as a config file writes it: lists as tuples, None as a typed placeholder
    (object: any override parses, as ml_collections' literal_eval-or-string)."""
    if value is None:
        return config_dict.placeholder(object)
    if isinstance(value, list):
        return _as_tuple(value)
    if isinstance(value, dict):
        return ml_collections.ConfigDict({k: _as_config_value(v) for k, v in value.items()})
    return value


def _as_tuple(value: Any) -> Any:
    return tuple(map(_as_tuple, value)) if isinstance(value, list) else value


def load(workdir: str | Path) -> ml_collections.ConfigDict:
    """WORKDIR/config.json as the ConfigDict configs/base.py's base_config() has the shape of
    (sections of ConfigDicts; tuples, typed placeholders for None). Raises NoSavedConfig."""
    from tfm.training.config import TOP_LEVEL_SECTIONS

    path = saved_config_path(workdir)
    if not path.is_file():
        raise NoSavedConfig(f"{workdir} has no {CONFIG_FILE}: no training run there (train one, "
                            "or give the run's CONFIG)")
    values = json.loads(path.read_text())
    config = ml_collections.ConfigDict()
    for section, content in values.items():
        if section in TOP_LEVEL_SECTIONS:  # what else a newer run saves is not config
            config[section] = _as_config_value(content)
    for field in _RESOLVED_PER_PLATFORM:
        if field in config.get("model", {}):
            config.model[field] = "auto"
    return config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    """ARG: the workdir."""
    if not arg:
        raise ValueError("tfm/saved_config.py needs the workdir: tfm/saved_config.py:WORKDIR")
    return load(arg)
