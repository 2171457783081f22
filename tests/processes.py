"""Subprocesses for the tests: a free loopback port, an environment cleared of cluster settings for a pod of
processes on this machine, starting a pod and waiting for it, and reading a run's output up to a line."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

# What a cluster sets (SLURM, TPU VMs, Kubernetes, MPI): a pod started by a test must not see them.
CLUSTER_ENV = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID",
               "SLURM_STEP_NUM_NODES", "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "TPU_WORKER_ID",
               "MEGASCALE_COORDINATOR_ADDRESS", "KUBERNETES_SERVICE_HOST", "OMPI_MCA_orte_hnp_uri")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pod_env(devices: int = 4) -> dict[str, str]:
    """This environment without multi-host settings or a cluster's, each process with `devices` CPU devices."""
    from harvest.runtime import distributed as D

    env = {k: v for k, v in os.environ.items() if k not in D.ENV.values() and k not in CLUSTER_ENV}
    return {**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}


def two_process_env(tmp_path: Path) -> dict:
    """pod_env for 2 processes x 4 devices, with their own harvest cache."""
    return {**pod_env(4), "HARVEST_CACHE": str(tmp_path / "cache")}


def run_processes(commands: list[list[str]], env: dict, logs: Path, timeout_s: float = 240) -> list[int]:
    """Start every command, wait for all (killing any still running at the timeout); their exit codes."""
    procs = []
    for i, cmd in enumerate(commands):
        with open(logs / f"process{i}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


def read_until(proc: subprocess.Popen, text: str, timeout_s: float = 120) -> None:
    """Read the run's output up to a line holding `text`."""
    deadline = time.monotonic() + timeout_s
    while text not in (line := proc.stdout.readline()):
        assert line or proc.poll() is None, f"the run ended before printing {text!r}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout_s} s"
