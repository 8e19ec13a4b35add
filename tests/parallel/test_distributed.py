"""Tests for tfm/parallel/distributed.py: config validation in-process, and a real 2-process run on
localhost (2 simulated CPU devices per process, gloo collectives)."""

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tfm.checks import ConfigError
from tfm.parallel import distributed

REPO = Path(__file__).resolve().parents[2]
CLEAN_ENV: dict[str, str] = {}  # no SLURM / MPI / TPU / TFM_* variables


@pytest.mark.parametrize(
    "config, match",
    [
        ({"enabled": "maybe"}, r"distributed.enabled='maybe' is unknown"),
        ({"coordinator": "x:1"}, r"distributed.coordinator is unknown"),
        ({"coordinator_address": "localhost"}, r"distributed.coordinator_address='localhost' "
                                               r"must look like 'host:port'"),
        ({"num_processes": -2}, r"distributed.num_processes=-2 must be an integer >= 0"),
        ({"process_id": 2, "num_processes": 2, "coordinator_address": "h:1"},
         r"distributed.process_id=2 must be < distributed.num_processes=2"),
        ({"num_processes": 2, "process_id": 0}, r"distributed.coordinator_address is unset"),
        ({"local_device_ids": "a,b"}, r"distributed.local_device_ids='a' must be an integer"),
    ],
)
def test_config_errors_name_the_field(config, match):
    with pytest.raises(ConfigError, match=match):
        distributed._resolve(config, CLEAN_ENV)


def test_resolve_decisions():
    assert distributed._resolve(None, CLEAN_ENV) is None  # auto, nothing detected
    assert distributed._resolve({"enabled": False}, {"SLURM_NTASKS": "4"}) is None
    assert distributed._resolve({"enabled": True}, CLEAN_ENV) == {}  # jax auto-detects
    explicit = {"coordinator_address": "localhost:1234", "num_processes": 2, "process_id": 1,
                "local_device_ids": "0,1"}
    assert distributed._resolve(explicit, CLEAN_ENV) == {
        "coordinator_address": "localhost:1234", "num_processes": 2, "process_id": 1,
        "local_device_ids": [0, 1]}
    launch_env = {"TFM_COORDINATOR": "10.0.0.1:999", "TFM_NUM_PROCESSES": "4",
                  "TFM_PROCESS_ID": "3"}
    assert distributed._resolve({"enabled": "auto"}, launch_env) == {
        "coordinator_address": "10.0.0.1:999", "num_processes": 4, "process_id": 3}
    # Config values win over the environment; one process needs no initialisation.
    assert distributed._resolve({"num_processes": 1, "process_id": 0}, launch_env) is None
    with pytest.raises(ConfigError, match="TFM_PROCESS_ID='x'"):
        distributed._resolve(None, {**launch_env, "TFM_PROCESS_ID": "x"})


def test_detect_cluster():
    slurm = {"SLURM_JOB_ID": "1", "SLURM_STEP_NODELIST": "n[1-2]", "SLURM_NTASKS": "2",
             "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}
    assert distributed.detect_cluster(slurm) == "slurm"
    assert distributed.detect_cluster({**slurm, "SLURM_NTASKS": "1"}) is None
    assert distributed._resolve(None, slurm) == {}  # auto: let jax read SLURM
    ompi = {"OMPI_MCA_orte_hnp_uri": "1;tcp://h:1", "OMPI_COMM_WORLD_SIZE": "8"}
    assert distributed.detect_cluster(ompi) == "ompi"
    assert distributed.detect_cluster({"TPU_WORKER_HOSTNAMES": "a,b"}) == "tpu_pod"
    assert distributed.detect_cluster({"TPU_WORKER_HOSTNAMES": "a"}) is None
    assert distributed.detect_cluster(CLEAN_ENV) is None


def test_single_process_maybe_initialize(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "OMPI_", "TPU_", "TFM_")):
            monkeypatch.delenv(name)
    assert distributed.maybe_initialize({"enabled": "auto"}) == (0, 1)
    assert distributed.maybe_initialize(None) == (0, 1)  # idempotent
    assert distributed.process_info() == (0, 1)


WORKER = textwrap.dedent(
    """
    import json, sys
    from tfm.parallel.distributed import maybe_initialize
    process_id, port, out_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    if process_id == 0:  # explicit config
        config = {"enabled": True, "coordinator_address": f"localhost:{port}",
                  "num_processes": 2, "process_id": 0}
    else:  # "auto" reading TFM_* variables, as launch.sh sets them
        config = {"enabled": "auto"}
    info = maybe_initialize(config)
    assert maybe_initialize(config) == info  # idempotent
    import jax, jax.numpy as jnp, numpy as np
    from tfm.parallel import sharding
    mesh = sharding.make_mesh({"data": -1})
    mesh_2x2 = sharding.make_mesh({"data": 2, "fsdp": 2})
    # Each process holds 2 rows: process p's rows are 10 * p + [[0, 1], [2, 3]].
    local = np.arange(4, dtype=np.float32).reshape(2, 2) + 10 * process_id
    batch = sharding.shard_batch({"x": local}, mesh_2x2)
    column_sums = jax.jit(lambda b: jnp.sum(b["x"], axis=0),
                          out_shardings=sharding.replicated(mesh_2x2))(batch)
    json.dump({
        "info": list(info), "devices": jax.device_count(), "local": jax.local_device_count(),
        "global_shape": list(batch["x"].shape),
        "column_sums": np.asarray(column_sums).tolist(),
        "mesh_shape": dict(mesh.shape),
        "mesh_processes": [[d.process_index for d in row.ravel()] for row in mesh.devices],
        "mesh_2x2_processes": [[d.process_index for d in row.ravel()] for row in mesh_2x2.devices],
    }, open(out_path, "w"))
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def test_two_processes_on_localhost(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = _free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "TPU_", "TFM_"))}
    env.update(XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    procs = []
    for process_id in range(2):
        proc_env = dict(env)
        if process_id == 1:
            proc_env.update(TFM_COORDINATOR=f"localhost:{port}", TFM_NUM_PROCESSES="2",
                            TFM_PROCESS_ID="1")
        procs.append(subprocess.Popen(
            [sys.executable, str(script), str(process_id), str(port),
             str(tmp_path / f"out{process_id}.json")],
            env=proc_env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=120)[0].decode(errors="replace"))
    finally:
        for proc in procs:  # never leave a process waiting for its peer
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for process_id, proc in enumerate(procs):
        assert proc.returncode == 0, f"process {process_id} failed:\n{logs[process_id][-3000:]}"
    for process_id in range(2):
        result = json.loads((tmp_path / f"out{process_id}.json").read_text())
        assert result["info"] == [process_id, 2]
        assert (result["devices"], result["local"]) == (4, 2)
        assert result["global_shape"] == [4, 2]
        # Rows 0,1,2,3 and 10,11,12,13 in two columns: 0+2+10+12, 1+3+11+13.
        assert result["column_sums"] == [24.0, 28.0]
        assert result["mesh_shape"] == {"data": 4, "fsdp": 1, "context": 1, "tensor": 1}
        # data crosses hosts; fsdp stays inside one host.
        assert result["mesh_processes"] == [[0], [0], [1], [1]]
        assert result["mesh_2x2_processes"] == [[0, 0], [1, 1]]
