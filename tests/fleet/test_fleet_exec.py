"""Emitted tasks run as SkyPilot runs them, on this machine: each host a fresh "VM" (its own HOME and working
directory) that gets the task's file_mounts, runs its setup in a fresh virtualenv (the suite's dependencies,
only the carried wheel installed) and its run command with SkyPilot's per-host variables. A 2-worker
extraction fleet on local paths, then an SAE fleet on 2 nodes: both complete, `harvest verify` passes, and
every host ran the harvest its setup installed."""

from __future__ import annotations

import json
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from extract_helpers import text_streams
from fleet_helpers import write_fleet

from harvest.cli import main
from harvest.fleet.plan import COORDINATOR_PORT
from harvest.storage import Storage

pytestmark = pytest.mark.slow

SAE_STEPS = 4


class Vm:
    """One host of a task, prepared as SkyPilot prepares it: file_mounts copied to their destinations under
    its HOME (`~/...`) or at their absolute paths, then the setup, in a fresh virtualenv on PATH."""

    def __init__(self, root: Path, name: str, task: dict, cache: Path):
        self.dir, self.task = root / name, task
        self.home, self.venv = self.dir / "home", self.dir / "venv"
        self.home.mkdir(parents=True)
        self.env = {"HOME": str(self.home), "PATH": f"{self.venv / 'bin'}:/usr/bin:/bin", "HARVEST_CACHE": str(cache),
                    "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
                    "HF_HUB_OFFLINE": "1", **task["envs"]}
        for dest, source in task.get("file_mounts", {}).items():
            target = self.home / dest[2:] if dest.startswith("~/") else Path(dest)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(source, target)

    def start_setup(self) -> subprocess.Popen:
        subprocess.run([sys.executable, "-m", "venv", str(self.venv)], check=True, capture_output=True)
        (purelib,) = Path(self.venv, "lib").glob("python3*/site-packages")
        (purelib / "suite-dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
        env = {**self.env, "PIP_NO_INDEX": "1", "PIP_NO_DEPS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        return self._bash(self.task["setup"], env, "setup")

    def start_run(self, rank: int, num_nodes: int) -> subprocess.Popen:
        """The run command with what SkyPilot sets on each host (harvest.fleet.container.SKYPILOT_ENV)."""
        env = {**self.env, "SKYPILOT_NODE_RANK": str(rank), "SKYPILOT_NUM_NODES": str(num_nodes),
               "SKYPILOT_NODE_IPS": "127.0.0.1\n" * num_nodes, "SKYPILOT_NUM_GPUS_PER_NODE": "0",
               "SKYPILOT_TASK_ID": f"sky-managed-{self.task['name']}"}
        return self._bash(self.task["run"], env, "run")

    def _bash(self, command: str, env: dict, what: str) -> subprocess.Popen:
        workdir = self.dir / "work"
        workdir.mkdir(exist_ok=True)
        with open(self.dir / f"{what}.log", "wb") as log:
            proc = subprocess.Popen(["bash", "-c", command], cwd=workdir, env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
        proc.log = self.dir / f"{what}.log"
        return proc

    def harvest_in_use(self) -> str:
        """Where this host's `harvest` imports from, and its distribution's version."""
        probe = "import harvest, importlib.metadata as m; print(harvest.__file__, m.version('harvest-activations'))"
        return subprocess.run([str(self.venv / "bin" / "python"), "-c", probe], env=self.env, capture_output=True,
                              text=True, check=True).stdout.strip()


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> None:
    for proc in procs:
        code = proc.wait(timeout=timeout)
        assert code == 0, proc.log.read_text(errors="replace")[-4000:]


def run_fleet(path: Path, root: Path, cache: Path) -> list[Vm]:
    """Plan and emit the fleet, then every task on its own VMs (one per node): the setups, then the runs."""
    tasks_dir = root / "tasks"
    assert main(["fleet", "plan", str(path), "--emit", str(tasks_dir)]) == 0
    tasks = [yaml.safe_load(p.read_text()) for p in sorted(tasks_dir.glob("*.yaml"))]
    vms = [(Vm(root, f"{task['name']}-node{rank}", task, cache), rank, task.get("num_nodes", 1))
           for task in tasks for rank in range(task.get("num_nodes", 1))]
    finish([vm.start_setup() for vm, *_ in vms])
    finish([vm.start_run(rank, nodes) for vm, rank, nodes in vms])
    return [vm for vm, *_ in vms]


def test_an_extraction_fleet_then_an_sae_fleet_run_from_their_emitted_tasks(tmp_path, capsys):
    checkpoint, _, streams = text_streams(tmp_path, 4, n=48, devices=1)
    cache = tmp_path / "cache"
    run = tmp_path / "acts"
    extraction = write_fleet(tmp_path / "fleet.yaml", {
        "name": "exec", "data": str(streams), "shared_paths": True,
        "extract": {"model": str(checkpoint), "points": "resid_post:1", "max_seq_len": 64, "batch_size": 2},
        "groups": [{"name": "cpus", "accelerator": "cpu", "regions": ["local"], "workers": 2, "out": str(run)}]})
    vms = run_fleet(extraction, tmp_path / "extract", cache)
    assert [vm.task["name"] for vm in vms] == ["exec.cpus.0", "exec.cpus.1"]
    for vm in vms:
        assert vm.task["setup"] == f'pip install "$HOME/.harvest/dist/{Path(*vm.task["file_mounts"]).name}"'
        where, version = vm.harvest_in_use().split()
        assert where.startswith(str(vm.venv)) and version == "0.1.0"  # the carried wheel, not the suite's
    capsys.readouterr()
    assert main(["verify", str(run)]) == 0, capsys.readouterr().out
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"OK {run}: 4 streams")

    sae_out = tmp_path / "sae"
    sae = write_fleet(tmp_path / "sae-fleet.yaml", {
        "name": "exec-sae", "data": str(run), "shared_paths": True,
        "sae": {"tensors": "resid_post.1", "expansion": 2, "k": 4, "batch_tokens": 32, "tokens": 32 * SAE_STEPS,
                "warmup": 1, "checkpoint_every": 2, "log_every": 1},
        "groups": [{"name": "pair", "accelerator": "cpu", "num_nodes": 2, "regions": ["local"], "workers": 1,
                    "out": str(sae_out)}]})
    vms = run_fleet(sae, tmp_path / "sae-run", cache)
    (task,) = {vm.task["name"]: vm.task for vm in vms}.values()
    assert task["num_nodes"] == 2 and f':{COORDINATOR_PORT}" --num-processes "$SKYPILOT_NUM_NODES"' in task["run"]
    assert task["setup"].endswith('[train]"')  # the trainer's optax and orbax
    metrics = Storage(str(sae_out)).read_bytes("metrics.jsonl").decode().splitlines()
    assert json.loads(metrics[-1])["step"] == SAE_STEPS
    assert main(["verify", str(run)]) == 0
