"""What every Hugging Face architecture module shares: the registry entry, errors, reading and
writing a model folder, and the weight-layout helpers (Hugging Face Linear weights are
[out, in]; tfm kernels are [in, *out] / [*in, out])."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tfm.nn.config import ModelConfig

Params = dict[str, Any]


class UnsupportedCheckpoint(ValueError):
    """The checkpoint uses an architecture or a field value that tfm cannot express."""


class UnreadableCheckpoint(ValueError):
    """A weights file of the folder cannot be read (truncated, or not what its name says)."""


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One Hugging Face architecture tfm reads, and perhaps writes (tfm.interop.hf.ARCHITECTURES).

    model_types: the config.json `model_type` values it reads. config: config.json ->
    ModelConfig, raising on what tfm cannot express. params: (ModelConfig, config.json, tensors
    by Hugging Face name) -> tfm params in the unrolled layout.
    Writing (None: tfm does not write it): save_fields, the ModelConfig field values a tfm
    config must have to be written as this architecture; save_type, the model_type written for
    such a config (raises where the variant has no Hugging Face equivalent); save_config and
    save_tensors, (config, model_type) -> config.json fields and (config, unrolled float32
    params) -> tensors by Hugging Face name; save_types, every model_type save_type returns."""

    name: str
    model_types: tuple[str, ...]
    config: Callable[[Mapping[str, Any]], ModelConfig]
    params: Callable[[ModelConfig, Mapping[str, Any], Mapping[str, np.ndarray]], Params]
    save_fields: Mapping[str, Any] | None = None
    save_type: Callable[[ModelConfig], str] | None = None
    save_config: Callable[[ModelConfig, str], dict[str, Any]] | None = None
    save_tensors: Callable[[ModelConfig, Params], dict[str, np.ndarray]] | None = None
    save_types: tuple[str, ...] = ()

    def differences(self, config: ModelConfig) -> list[str]:
        """The fields of `config` that keep it from being written as this architecture."""
        return [f"{field}={getattr(config, field)!r} (needs {value!r})"
                for field, value in (self.save_fields or {}).items()
                if getattr(config, field) != value]


def unsupported(field: str, value: Any, supported: str) -> UnsupportedCheckpoint:
    return UnsupportedCheckpoint(
        f"Hugging Face config field {field}={value!r} is not supported; supported: {supported}"
    )


def require(hf: Mapping[str, Any], field: str, allowed: tuple, default: Any = None) -> Any:
    """hf[field] (or `default`) when it is one of `allowed`; else UnsupportedCheckpoint."""
    value = hf.get(field, default)
    if value not in allowed:
        raise unsupported(field, value, ", ".join(map(repr, allowed)))
    return value


# --------------------------------------------------------------------------------- reading


def read_config(directory: str | Path) -> dict[str, Any]:
    """The folder's config.json."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: a Hugging Face model folder has config.json")
    return json.loads(path.read_text())


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, as stored."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        return load_file(path)
    except SafetensorError as error:
        raise UnreadableCheckpoint(
            f"{path.name} in {path.parent} is unreadable (truncated or not a safetensors "
            f"file): {error}"
        ) from None


def read_tensors(directory: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder as float32 numpy arrays, by Hugging Face name."""
    directory = Path(directory)
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        tensors = read_safetensors(single)
    elif index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        tensors = {}
        for shard in shards:
            tensors.update(read_safetensors(directory / shard))
    elif (directory / "pytorch_model.bin").is_file():
        try:
            import torch
        except ImportError as error:
            raise UnsupportedCheckpoint(
                f"{directory}/pytorch_model.bin needs torch to read; convert it to "
                "model.safetensors or install torch"
            ) from error
        state = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
        tensors = {k: v.float().numpy() for k, v in state.items()}
    else:
        raise FileNotFoundError(
            f"{directory} holds no weights: expected model.safetensors, "
            "model.safetensors.index.json or pytorch_model.bin"
        )
    return {k: np.asarray(v, np.float32) for k, v in tensors.items()}


class Tensors:
    """Name -> array lookup that strips known prefixes and reports missing names clearly."""

    def __init__(self, tensors: Mapping[str, np.ndarray], prefixes: tuple[str, ...] = ()):
        self.tensors = {}
        for name, value in tensors.items():
            for prefix in prefixes:
                if name.startswith(prefix):
                    name = name[len(prefix) :]
                    break
            self.tensors[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str, *alternatives: str) -> np.ndarray:
        for candidate in (name, *alternatives):
            if candidate in self.tensors:
                return self.tensors[candidate]
        raise UnsupportedCheckpoint(f"the checkpoint has no tensor {name!r}")


# ---------------------------------------------------------------------------------- layouts


def in_heads(weight: np.ndarray, heads: int) -> np.ndarray:  # [heads*hd, d] -> [d, heads, hd]
    return weight.T.reshape(weight.shape[1], heads, -1)


def out_heads(weight: np.ndarray, heads: int) -> np.ndarray:  # [d, heads*hd] -> [heads, hd, d]
    return weight.T.reshape(heads, -1, weight.shape[0])


def norm(config: ModelConfig, scale: np.ndarray, bias: np.ndarray | None = None) -> Params:
    """A norm's parameters under the name config.norm_type gives it."""
    if config.norm_type == "rmsnorm":
        return {"rms_norm": {"scale": scale}}
    return {"layer_norm": {"scale": scale, "bias": bias}}


def dense(kernel: np.ndarray, bias: np.ndarray | None) -> Params:
    return {"kernel": kernel} if bias is None else {"kernel": kernel, "bias": bias}


# ---------------------------------------------------------------------------------- writing


def unstack(params: Params, num_layers: int) -> Params:
    """The unrolled layout of `params` (undoes nn.scan's stacked "layers")."""
    import jax

    stack = dict(params["decoder"]["stack"])
    if "layers" in stack:
        stacked = stack.pop("layers")
        for i in range(num_layers):
            stack[f"layer_{i}"] = jax.tree.map(lambda x, i=i: x[i], stacked)
    return {**params, "decoder": {**params["decoder"], "stack": stack}}


def write_folder(
    directory: str | Path, hf_config: dict[str, Any], tensors: dict[str, np.ndarray]
) -> None:
    """Writes config.json and model.safetensors (PyTorch-format metadata) into `directory`,
    creating it if needed."""
    from safetensors.numpy import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()},
              str(directory / "model.safetensors"), metadata={"format": "pt"})
