"""`harvest fleet up` and `down`: launch the workers SkyPilot is not already running, cancel the ones it is.
Idempotent: a second `up` finds every job active and launches nothing."""

from __future__ import annotations

from harvest.fleet.plan import Plan, Worker, task_config
from harvest.fleet.sky import FINISHED_OK, Jobs


def up(plan: Plan, jobs: Jobs) -> tuple[list[Worker], list[Worker]]:
    """Launch each worker with no active or succeeded job; returns (launched, left as they are)."""
    queued = {job.name: job for job in jobs.queue()}
    launched, kept = [], []
    for worker in plan.workers:
        job = queued.get(worker.job_name)
        if job is not None and (job.active or job.status == FINISHED_OK):
            kept.append(worker)
            continue
        jobs.launch(task_config(worker, plan.spec), worker.job_name)
        launched.append(worker)
    return launched, kept


def down(plan: Plan, jobs: Jobs) -> list[Worker]:
    """Cancel each worker whose job is active; returns them."""
    queued = {job.name: job for job in jobs.queue()}
    cancelled = [w for w in plan.workers if (job := queued.get(w.job_name)) is not None and job.active]
    for worker in cancelled:
        jobs.cancel(worker.job_name)
    return cancelled
