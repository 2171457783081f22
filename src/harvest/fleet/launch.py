"""`harvest fleet up` and `down`: launch the workers SkyPilot is not already running, cancel the ones it is.
Idempotent: a second `up` finds every job active and launches nothing. The fleet's secrets are read from
`up`'s own environment and handed to SkyPilot as task secrets: no file of the plan holds their values."""

from __future__ import annotations

import os
from collections.abc import Mapping

from harvest.fleet.plan import Plan, Worker, task_config
from harvest.fleet.sky import FINISHED_OK, Jobs
from harvest.fleet.spec import FleetError


def secret_values(plan: Plan, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each of the fleet's secrets from the environment; all of them, or one line naming those unset."""
    env = os.environ if env is None else env
    missing = [name for name in plan.spec.secrets if not env.get(name)]
    if missing:
        raise FleetError(f"{plan.spec.path}: secrets: {', '.join(missing)} not set in this environment; export "
                         f"{'them' if len(missing) > 1 else 'it'} before `harvest fleet up` (the values go to "
                         f"SkyPilot as task secrets, never into a file)")
    return {name: env[name] for name in plan.spec.secrets}


def up(plan: Plan, jobs: Jobs) -> tuple[list[Worker], list[Worker]]:
    """Launch each worker with no active or succeeded job; returns (launched, left as they are)."""
    secrets = secret_values(plan)  # before any launch: a missing one launches nothing
    queued = {job.name: job for job in jobs.queue()}
    launched, kept = [], []
    for worker in plan.workers:
        job = queued.get(worker.job_name)
        if job is not None and (job.active or job.status == FINISHED_OK):
            kept.append(worker)
            continue
        task = task_config(worker, plan.spec)
        if secrets:
            task["secrets"] = dict(secrets)
        jobs.launch(task, worker.job_name)
        launched.append(worker)
    return launched, kept


def down(plan: Plan, jobs: Jobs) -> list[Worker]:
    """Cancel each worker whose job is active; returns them."""
    queued = {job.name: job for job in jobs.queue()}
    cancelled = [w for w in plan.workers if (job := queued.get(w.job_name)) is not None and job.active]
    for worker in cancelled:
        jobs.cancel(worker.job_name)
    return cancelled
