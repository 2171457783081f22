"""Helpers for the fleet tests: the users' four-region fleet, SkyPilot's job queue as recorded records, the
CLI run in this process, emitted tasks loaded by SkyPilot itself and a task's command run as one host would.
The fleets here name neither install nor image, as the README's do: their tasks carry this checkout's wheel.

RecordedJobs stands in for the one boundary no test can reach (SkyPilot's API server and a cloud): it holds
job records shaped as `sky.jobs.queue_v2` returns them (as JSON, the way SkyJobs receives them) and hands them
to harvest.fleet.sky for parsing, exactly as SkyJobs does; a launch queues a PENDING record.
"""

from __future__ import annotations

import copy
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from harvest.cli import main
from harvest.errors import UserError
from harvest.fleet.sky import records_from_queue, skypilot_python

FOUR_REGIONS = {
    "name": "arc-qwen05",
    "extract": {"model": "Qwen/Qwen2.5-0.5B", "format": "arc", "points": "resid_post:12-23"},
    "groups": [
        {"name": "us-central1-v5e", "accelerator": "tpu-v5litepod-8", "regions": ["us-central1"], "workers": 8,
         "spot": True, "streams": "0-7", "out": "gs://activations-us/arc-qwen05", "mesh": "data=8"},
        {"name": "us-west4-v5e", "accelerator": "tpu-v5litepod-8", "regions": ["us-west4"], "workers": 8,
         "spot": True, "streams": "8-15", "out": "gs://activations-us/arc-qwen05"},
        {"name": "us-east5-v6e", "accelerator": "tpu-v6e-8", "regions": ["us-east5", "us-east1"], "workers": 8,
         "spot": True, "streams": "auto", "out": "gs://activations-us/arc-qwen05", "mesh": "data=4,model=2"},
        {"name": "europe-west4-v6e", "accelerator": "tpu-v6e-8", "regions": ["europe-west4"], "workers": 8,
         "spot": True, "streams": "auto", "out": "gs://activations-eu/arc-qwen05"},
    ],
}


def built_wheel(root: Path) -> Path:
    """The checkout's wheel, as `fleet plan --emit` and `fleet up` build it, for task_config's carrying tasks."""
    from harvest.fleet.carry import build_wheel

    return build_wheel(root)


def write_fleet(path: Path, fleet: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(fleet, sort_keys=False))
    return path


class RecordedJobs:
    """SkyPilot's managed-job queue, from recorded records (see the module doc)."""

    def __init__(self, records: list[dict[str, Any]] | None = None):
        self.records = list(records or [])
        self.launched: list[str] = []
        self.tasks: list[dict[str, Any]] = []
        self.cancelled: list[str] = []
        self._ids = itertools.count(1 + max((r["job_id"] for r in self.records), default=0))

    def queue(self):
        return records_from_queue(self.records)

    def launch(self, task: dict[str, Any], name: str) -> None:
        assert task["name"] == name
        self.launched.append(name)
        self.tasks.append(task)
        self.records.append(record(next(self._ids), name, "PENDING"))

    def cancel(self, name: str) -> None:
        self.cancelled.append(name)
        for r in self.records:
            if r["job_name"] == name:
                r["status"] = "CANCELLED"


def record(job_id: int, name: str, status: str, recoveries: int = 0, region: str = "us-central1") -> dict:
    """One job record as sky.jobs.queue_v2 returns it (the fields of its ManagedJobRecord)."""
    return {"job_id": job_id, "task_id": 0, "job_name": name, "task_name": name, "resources": "1x[TPU]",
            "submitted_at": 1.7e9, "end_at": None, "job_duration": 60.0, "recovery_count": recoveries,
            "status": status, "region": region, "pool": None}


# The seeds' training workloads as fleets: a decoder on a v4-64 with the seed's (data 4, model 4, fsdp 2) mesh,
# a TRM on a v4-64 (its `data` filled in by the test: a bucket holding a puzzle dataset), SAEs on 2 GPU nodes.
DECODER_POD = {
    "name": "qwen-pretrain",
    "data": "gs://corpus-us/fineweb-edu-streams",
    "train": {"model": "Qwen/Qwen2.5-0.5B", "seq_len": 2048, "batch_size": 256, "steps": 20000,
              "mesh": "data=4,model=4,fsdp=2", "checkpoint_every": 500},
    "groups": [{"name": "v4-pod", "accelerator": "tpu-v4-64", "regions": ["us-central2"], "workers": 1,
                "out": "gs://checkpoints-us/qwen-pretrain"}],
}
TRM_POD = {
    "name": "trm-sudoku",
    "train": {"model": {"type": "trm", "preset": "trm-sudoku-mlp"}, "batch_size": 768, "checkpoint_every": 1000},
    "groups": [{"name": "v4-pod", "accelerator": "tpu-v4-64", "regions": ["us-central2", "us-east1"],
                "workers": 1, "out": "gs://checkpoints-us/trm-sudoku"}],
}
SAE_GPUS = {
    "name": "sae-qwen05",
    "data": "gs://activations-us/arc-qwen05,gs://activations-eu/arc-qwen05",
    "sae": {"tensors": ["resid_post.12", "resid_post.18"], "expansion": 32, "k": 64, "batch_tokens": 8192},
    "groups": [{"name": "h100s", "accelerator": "H100:8", "num_nodes": 2, "regions": ["us-east4"], "workers": 1,
                "spot": False, "mesh": "data=2,model=8", "out": "gs://saes-us/qwen05"}],
}


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """The real CLI in this process (plan needs no cloud): (exit code, stdout, stderr)."""
    code = main(list(args))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# Run in SkyPilot's own interpreter (it cannot share harvest's environment, see harvest.fleet.sky).
_LOAD_TASKS = r"""
import json, sys
import sky
out = []
for path in sys.argv[1:]:
    task = sky.Task.from_yaml(path)
    out.append({"name": task.name, "num_nodes": task.num_nodes, "setup": task.setup, "run": task.run,
                "file_mounts": task.file_mounts,
                "envs": task.envs, "secrets": [ref.name for ref in task.managed_secret_refs], "resources": [
                    {"accelerators": r.accelerators, "use_spot": r.use_spot, "region": r.region,
                     "job_recovery": r.job_recovery} for r in task.resources]})
print(json.dumps(out))
"""


def skypilot_or_skip() -> str:
    try:
        return skypilot_python()
    except UserError as e:
        pytest.skip(f"SkyPilot not installed (`make test` installs it in .venv-sky): {e}")


def load_tasks(paths: list) -> list[dict]:
    """Task files as SkyPilot's own parser reads them."""
    loaded = subprocess.run([skypilot_or_skip(), "-c", _LOAD_TASKS, *map(str, paths)], capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    return json.loads(loaded.stdout.strip().splitlines()[-1])


def run_as_host(task: dict, command: str, tmp_path: Path, env: dict) -> list[str]:
    """The task's run command on one host as SkyPilot runs it (`env`: its variables there), through a `command`
    (harvest, docker) on PATH that prints the arguments it got; returns them."""
    shim = tmp_path / "bin" / command
    if not shim.exists():
        shim.parent.mkdir(exist_ok=True)
        shim.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
        shim.chmod(0o755)
    done = subprocess.run(["bash", "-c", task["run"]], env={"PATH": f"{shim.parent}:/usr/bin:/bin", **env},
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout)


def edit_fleet(fleet: dict, **changes) -> dict:
    edited = copy.deepcopy(fleet)
    for key, value in changes.items():
        if key.startswith("g"):  # g0_streams=... edits groups[0].streams
            index, field = key[1:].split("_", 1)
            edited["groups"][int(index)][field] = value
        else:
            edited[key] = value
    return edited
