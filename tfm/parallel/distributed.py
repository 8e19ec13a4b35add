"""Multi-process start-up: call `maybe_initialize` once, first thing, before any JAX computation.

Config (dict or ml_collections ConfigDict; missing keys take these defaults):

  enabled: "auto"          "auto" | True | False (strings "true"/"false" also accepted)
  coordinator_address: ""  "host:port" of process 0; "" = unset
  num_processes: 0         0 = unset
  process_id: -1           -1 = unset
  local_device_ids: None   None | int | list of ints | "0,1" (devices this process drives)

- enabled=False: single process, whatever the environment says.
- explicit values (config, else the env vars TFM_COORDINATOR, TFM_NUM_PROCESSES,
  TFM_PROCESS_ID that scripts/launch.sh sets for local multi-process runs): those are used.
- enabled=True without explicit values: jax.distributed.initialize() detects the cluster
  (SLURM, Open MPI, Cloud TPU, Kubernetes) and fails if there is none.
- enabled="auto" without explicit values: initialises only when the environment shows several
  processes (SLURM srun with SLURM_NTASKS > 1, Open MPI with OMPI_COMM_WORLD_SIZE > 1, a TPU pod
  listing several TPU_WORKER_HOSTNAMES / TPU_PROCESS_ADDRESSES); else stays single-process.
  On Cloud TPU VMs whose pods are only visible through the metadata server, set enabled=True.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import jax

from tfm.checks import ConfigError, section_dict

logger = logging.getLogger(__name__)

DEFAULT_DISTRIBUTED: dict[str, Any] = {
    "enabled": "auto",
    "coordinator_address": "",
    "num_processes": 0,
    "process_id": -1,
    "local_device_ids": None,
}
ENV_COORDINATOR = "TFM_COORDINATOR"
ENV_NUM_PROCESSES = "TFM_NUM_PROCESSES"
ENV_PROCESS_ID = "TFM_PROCESS_ID"


def process_info() -> tuple[int, int]:
    """(process_index, process_count) of this JAX process (0, 1 when single-process)."""
    return jax.process_index(), jax.process_count()


def _int(field: str, value: Any, minimum: int) -> int:
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{field}={value!r} must be an integer >= {minimum}")
    return value


def _enabled(value: Any) -> bool | str:
    if isinstance(value, str) and value.lower() in ("auto", "true", "false"):
        return {"auto": "auto", "true": True, "false": False}[value.lower()]
    if isinstance(value, bool):
        return value
    raise ConfigError(f"distributed.enabled={value!r} is unknown; choose one of: auto, True, False")


def _device_ids(value: Any) -> list[int] | None:
    field = "distributed.local_device_ids"
    if value is None or value == "":
        return None
    if isinstance(value, str):
        value = [part for part in value.split(",") if part.strip()]
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"{field}={value!r} must be None, an integer or a list of integers")
    return [_int(field, item, 0) for item in value]


def _address(field: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{field}={value!r} must be a string 'host:port'")
    host, _, port = value.rpartition(":")
    if value and (not host or not port.isdigit() or not 0 < int(port) < 65536):
        raise ConfigError(f"{field}={value!r} must look like 'host:port' (e.g. 'localhost:1234')")
    return value


def detect_cluster(environ: Mapping[str, str] | None = None) -> str | None:
    """Name of the multi-process launcher the environment shows ("slurm", "ompi", "tpu_pod"),
    or None for a single process. Only cheap environment checks, no network."""
    env = os.environ if environ is None else environ

    def count(name: str) -> int:
        text = env.get(name, "")
        return int(text) if text.isdigit() else 0

    slurm_vars = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID",
                  "SLURM_LOCALID")
    if all(name in env for name in slurm_vars) and count("SLURM_NTASKS") > 1:
        return "slurm"
    if "OMPI_MCA_orte_hnp_uri" in env and count("OMPI_COMM_WORLD_SIZE") > 1:
        return "ompi"
    hosts = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
    if len([host for host in hosts.split(",") if host.strip()]) > 1:
        return "tpu_pod"
    return None


def _resolve(dist_config: Any, environ: Mapping[str, str]) -> dict[str, Any] | None:
    """Validated keyword arguments for jax.distributed.initialize, or None for single-process."""
    given = section_dict(dist_config, "distributed", list(DEFAULT_DISTRIBUTED))
    config = {**DEFAULT_DISTRIBUTED, **given}
    enabled = _enabled(config["enabled"])
    address = _address("distributed.coordinator_address", config["coordinator_address"])
    num_processes = _int("distributed.num_processes", config["num_processes"], 0)
    process_id = _int("distributed.process_id", config["process_id"], -1)
    device_ids = _device_ids(config["local_device_ids"])
    if enabled is False:
        return None
    # Environment variables from launch.sh fill what the config leaves unset.
    if not address and environ.get(ENV_COORDINATOR):
        address = _address(ENV_COORDINATOR, environ[ENV_COORDINATOR])
    if num_processes == 0 and environ.get(ENV_NUM_PROCESSES):
        num_processes = _int(ENV_NUM_PROCESSES, environ[ENV_NUM_PROCESSES], 1)
    if process_id == -1 and environ.get(ENV_PROCESS_ID):
        process_id = _int(ENV_PROCESS_ID, environ[ENV_PROCESS_ID], 0)
    explicit = bool(address) or num_processes > 0 or process_id >= 0
    cluster = detect_cluster(environ)
    if num_processes and process_id >= num_processes:
        raise ConfigError(
            f"distributed.process_id={process_id} must be < distributed.num_processes="
            f"{num_processes}"
        )
    if explicit and cluster is None:
        missing = [name for name, unset in (("coordinator_address", not address),
                                            ("num_processes", num_processes == 0),
                                            ("process_id", process_id == -1)) if unset]
        if missing and num_processes != 1:
            raise ConfigError(
                f"distributed.{missing[0]} is unset; without a detected cluster (SLURM, Open MPI, "
                "TPU pod) set coordinator_address, num_processes and process_id together (or "
                f"the env vars {ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID})"
            )
    if num_processes == 1:
        return None  # one process needs no coordination service
    if not explicit and enabled == "auto" and cluster is None:
        return None
    kwargs: dict[str, Any] = {}
    if address:
        kwargs["coordinator_address"] = address
    if num_processes:
        kwargs["num_processes"] = num_processes
    if process_id >= 0:
        kwargs["process_id"] = process_id
    if device_ids is not None:
        kwargs["local_device_ids"] = device_ids
    return kwargs


def maybe_initialize(dist_config: Any = None) -> tuple[int, int]:
    """Initialises jax.distributed when the config or the environment asks for several processes.

    Call once at start-up, before any other JAX call (jax.devices() included). Idempotent: a
    second call (or one after jax.distributed.initialize) does nothing. Returns
    (process_index, process_count). Raises ConfigError naming the bad `distributed.<field>`.
    """
    kwargs = _resolve(dist_config, os.environ)
    if kwargs is not None and not jax.distributed.is_initialized():
        logger.info("initialising jax.distributed with %s", kwargs or "cluster auto-detection")
        jax.distributed.initialize(**kwargs)
    index, count = process_info()
    if kwargs is not None:
        logger.info("process %d of %d, %d local devices of %d", index, count,
                    jax.local_device_count(), jax.device_count())
    return index, count
