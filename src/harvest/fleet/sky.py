"""The one place harvest calls SkyPilot (`pip install 'harvest[fleet]'`): managed jobs launched, listed and
cancelled through its Python SDK (skypilot 0.14). Everything else in the fleet works on JobRecord, so the
tests feed recorded queue records through `records_from_queue`: no cloud is reachable there."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Protocol

from harvest.errors import UserError

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


class SkyJobs:
    """Jobs through SkyPilot's SDK (each call is a request to its API server, waited for)."""

    def __init__(self):
        try:
            import sky
        except ImportError:
            raise UserError("SkyPilot is not installed: pip install 'harvest[fleet]' (skypilot[gcp]), "
                            "then `sky check` to set up the cloud account") from None
        self.sky = sky

    def queue(self) -> list[JobRecord]:
        records, *_ = self.sky.get(self.sky.jobs.queue_v2(refresh=True, skip_finished=False))
        return records_from_queue(records)

    def launch(self, task: dict[str, Any], name: str) -> None:
        self.sky.get(self.sky.jobs.launch(self.sky.Task.from_yaml_config(task), name=name))

    def cancel(self, name: str) -> None:
        self.sky.get(self.sky.jobs.cancel(name=name))
