"""The one place harvest calls SkyPilot: managed jobs launched, listed and cancelled through its Python SDK
(skypilot 0.14). Everything else in the fleet works on JobRecord, so the tests feed recorded queue records
through `records_from_queue`: no cloud is reachable there.

SkyPilot cannot share harvest's environment: skypilot 0.14.1 requires click<8.2, and huggingface_hub (>=1.31,
which transformers 5 needs) click>=8.4.2. So the SDK runs in SkyPilot's own interpreter (a pipx/uv tool
install, found through `sky` on PATH or $HARVEST_SKYPILOT_PYTHON); requests and answers cross as JSON.

The SDK starts a local API server (about ten processes) when none answers. A harvest command that caused that
stops it when it exits (`sky api stop`'s call), or says how to. Before the first managed job SkyPilot has no
jobs controller, and its queue raises ClusterDoesNotExist: that is an empty queue, not an error.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Iterable, Protocol

from harvest.errors import UserError

SKYPILOT = "skypilot[gcp]==0.14.1"  # the SDK version this module speaks to

# ManagedJobStatus values (sky/jobs/state.py) of a job that holds or is getting a VM: `up` leaves it be.
ACTIVE = frozenset({"PENDING", "SUBMITTED", "STARTING", "RUNNING", "RECOVERING", "WINDING_DOWN", "CANCELLING"})
FINISHED_OK = "SUCCEEDED"


@dataclasses.dataclass(frozen=True)
class JobRecord:
    """What the fleet needs of one managed job in SkyPilot's queue."""

    job_id: int
    name: str
    status: str  # ManagedJobStatus value: PENDING, STARTING, RUNNING, RECOVERING, SUCCEEDED, FAILED, ...
    recoveries: int = 0
    region: str | None = None
    submitted_at: float | None = None

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    @classmethod
    def from_sdk(cls, record: Any) -> JobRecord:
        """From one record of sky.jobs.queue_v2 (a ManagedJobRecord model, or the dict older servers send)."""
        raw = record.model_dump() if hasattr(record, "model_dump") else dict(record)
        status = raw.get("status")
        return cls(job_id=int(raw.get("job_id") or 0), name=str(raw.get("job_name") or raw.get("task_name") or ""),
                   status=str(getattr(status, "value", status) or "UNKNOWN"),
                   recoveries=int(raw.get("recovery_count") or 0), region=raw.get("region"),
                   submitted_at=raw.get("submitted_at"))


def records_from_queue(records: Iterable[Any]) -> list[JobRecord]:
    """The newest record per job name (a relaunched worker has older, finished ones too)."""
    newest: dict[str, JobRecord] = {}
    for job in map(JobRecord.from_sdk, records):
        if job.name not in newest or job.job_id > newest[job.name].job_id:
            newest[job.name] = job
    return list(newest.values())


class Jobs(Protocol):
    """Managed jobs as the fleet uses them."""

    def queue(self) -> list[JobRecord]: ...

    def launch(self, task: dict[str, Any], name: str) -> None: ...

    def cancel(self, name: str) -> None: ...


_SDK = r"""
import json, sys
import sky
import sky.exceptions
import sky.jobs.constants
from sky.server import common as server_common

op, answer = sys.argv[1], sys.argv[2]
request = json.loads(sys.stdin.read())


def server_up():
    server_common.get_api_server_status_response.cache_clear()
    return server_common.get_api_server_status().status == server_common.ApiServerStatus.HEALTHY


result = {"result": None}
local_down = op != "stop" and server_common.is_api_server_local() and not server_up()
try:
    if op == "queue":
        fields = [*sky.jobs.constants.DEFAULT_MANAGED_JOB_FIELDS, "region"]
        try:
            records, *_ = sky.get(sky.jobs.queue_v2(refresh=True, skip_finished=False, fields=fields))
        except sky.exceptions.ClusterDoesNotExist:  # no jobs controller yet: no managed job was ever launched
            records = []
        result["result"] = [r.model_dump(mode="json") if hasattr(r, "model_dump") else r for r in records]
    elif op == "launch":
        sky.get(sky.jobs.launch(sky.Task.from_yaml_config(request["task"]), name=request["name"]))
    elif op == "cancel":
        sky.get(sky.jobs.cancel(name=request["name"]))
    elif op == "stop":
        sky.api_stop()
finally:
    result["started_server"] = local_down and server_up()
    with open(answer, "w") as f:
        json.dump(result, f)
"""
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def skypilot_python() -> str:
    """SkyPilot's interpreter: $HARVEST_SKYPILOT_PYTHON, else the one running `sky` (its script's #! line)."""
    explicit = os.environ.get("HARVEST_SKYPILOT_PYTHON")
    if explicit:
        return explicit
    cli = shutil.which("sky")
    if cli:
        with open(cli, "rb") as f:
            first = f.readline().decode(errors="replace").strip()
        if first.startswith("#!") and "python" in first:
            return first[2:].split()[0]
    raise UserError(f"SkyPilot not found: install it in its own environment (pipx install '{SKYPILOT}', or "
                    f"uv tool install), run `sky check`, or set HARVEST_SKYPILOT_PYTHON to its python")


class SkyJobs:
    """Jobs through SkyPilot's SDK, run in SkyPilot's interpreter (found at the first call); each call waits
    for its request. A local API server that a call started is stopped when this process exits."""

    def __init__(self, python: str | None = None):
        self._python = python
        self.started_server = False

    @property
    def python(self) -> str:
        if self._python is None:
            self._python = skypilot_python()
        return self._python

    def _call(self, op: str, request: dict[str, Any]) -> Any:
        with tempfile.TemporaryDirectory(prefix="harvest-sky-") as tmp:
            answer = os.path.join(tmp, "answer.json")
            try:
                done = subprocess.run([self.python, "-c", _SDK, op, answer], input=json.dumps(request), text=True,
                                      stdout=sys.stderr, stderr=subprocess.PIPE)
            except (FileNotFoundError, PermissionError) as e:  # no such interpreter, or not one
                raise UserError(f"SkyPilot {op} failed: cannot run {self.python} ({e.strerror}); set "
                                f"HARVEST_SKYPILOT_PYTHON to SkyPilot's python") from None
            result = {}
            if os.path.exists(answer):
                with open(answer) as f:
                    result = json.load(f)
            if result.get("started_server") and not self.started_server:
                self.started_server = True
                atexit.register(self.stop_server)
            if done.returncode != 0:
                last = (_ANSI.sub("", done.stderr).strip().splitlines() or ["no message"])[-1]
                raise UserError(f"SkyPilot {op} failed ({self.python}): {last}")
            return result["result"]

    def stop_server(self) -> None:
        """Stop the local API server a call of this process started (SkyPilot's `sky api stop`)."""
        try:
            self._call("stop", {})
            print("stopped the SkyPilot API server this command started", file=sys.stderr)
        except UserError as e:
            print(f"this command started SkyPilot's API server and could not stop it ({e}); stop it with "
                  f"`sky api stop`", file=sys.stderr)

    def queue(self) -> list[JobRecord]:
        return records_from_queue(self._call("queue", {}))

    def launch(self, task: dict[str, Any], name: str) -> None:
        self._call("launch", {"task": task, "name": name})

    def cancel(self, name: str) -> None:
        self._call("cancel", {"name": name})
