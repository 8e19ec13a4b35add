"""What a workdir records about its run, and the check that a run resuming there trains the same
thing.

WORKDIR/config.json is the run's whole config as `Experiment.config_json` resolves it (the data's
vocabulary sizes in `model`, the schedule's length in `optimizer`). A run that finds checkpoints
in its workdir resumes them only if it trains on the same data with the same model: anything else
would continue another experiment's parameters under this one's name.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tfm.saved_config import CONFIG_FILE, saved_config_path
from tfm.training.checkpoint import ConfigMismatchError, model_differences

# Fields of the data section that say what a run trains on: another value is another dataset,
# split or vocabulary. Lengths of rows, batch sizes and eval settings may change on resume.
DATA_IDENTITY = (
    "kind", "mode", "task", "num_symbols", "train_lengths", "num_train_examples", "path",
    "text_unit", "validation_fraction", "source_path", "target_path", "name", "features",
    "train_split", "tokenizer", "vocab_size", "sentencepiece_model_type", "shared_vocab", "seed",
    "passkey_rows", "passkey_alphabet", "passkey_key_length",
)
# DATA_IDENTITY fields added after workdirs were first written, with their defaults.
_NEWER_FIELDS = {"passkey_rows": 0, "passkey_alphabet": "0123456789", "passkey_key_length": 5}
_PATH_FIELDS = ("path", "source_path", "target_path")


def read_config(workdir: str | Path) -> dict[str, Any] | None:
    """The config a run in `workdir` saved (WORKDIR/config.json), or None when there is none."""
    path = saved_config_path(workdir)
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def write_config(workdir: str | Path, config_json: str) -> None:
    """Writes WORKDIR/config.json whole or not at all (a temporary file renamed over it): the
    other processes of a run read it meanwhile (`read_config`), and a reader must never see it
    half written."""
    path = saved_config_path(workdir)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(config_json)
    os.replace(partial, path)


def _file_digest(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _same_file(saved: Any, current: Any) -> bool:
    """Two data paths name the same data: the same string, the same file, or files with the same
    bytes (a corpus copied or reached by another path)."""
    if saved == current:
        return True
    if not (isinstance(saved, str) and isinstance(current, str)):
        return False
    if not (os.path.isfile(saved) and os.path.isfile(current)):
        return False
    if os.path.samefile(saved, current):
        return True
    return (os.path.getsize(saved) == os.path.getsize(current)
            and _file_digest(saved) == _file_digest(current))


def data_differences(saved: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """'data.FIELD: saved X, current Y' for every DATA_IDENTITY field that differs."""
    old, new = saved.get("data", {}), current.get("data", {})
    lines = []
    for field in DATA_IDENTITY:
        # Both as JSON (lists, not tuples); a field newer than the saved run had its default.
        default = _NEWER_FIELDS.get(field)
        before, after = old.get(field, default), new.get(field, default)
        same = _same_file(before, after) if field in _PATH_FIELDS else before == after
        if not same:
            lines.append(f"data.{field}: saved {before!r}, current {after!r}")
    return lines


def check_resume(workdir: str | Path, saved: Mapping[str, Any], current: Mapping[str, Any]
                 ) -> None:
    """Raises ConfigMismatchError, in one line naming every differing field, when the run in
    `workdir` (its saved config `saved`) trained on other data or another model than `current`
    would: resuming it would continue that run's parameters as this one's."""
    differences = data_differences(saved, current) + model_differences(saved, current)
    if differences:
        raise ConfigMismatchError(
            f"workdir {workdir} holds a run of other data or another model ("
            + "; ".join(differences)
            + "). Train this config in another workdir (--workdir DIR), or continue that run "
            "with its own settings (./launch.sh eval/generate --workdir "
            f"{workdir} read them from its {CONFIG_FILE})"
        )
