"""`harvest fleet up` and `down`: launch the workers SkyPilot is not already running, cancel the ones it is.
Idempotent: a second `up` finds every job active and launches nothing. The fleet's secrets are read from
`up`'s own environment and handed to SkyPilot as task secrets: no file of the plan holds their values.
A TRM fleet whose dataset is missing first runs its one puzzles build and waits for the dataset's commit
marker, so the pod slice is asked for only once its data is there. A fleet that carries this checkout builds
its wheel once, at the first launch, and SkyPilot uploads it with each task (harvest.fleet.carry)."""

from __future__ import annotations

import functools
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from harvest.fleet.carry import build_wheel
from harvest.fleet.plan import Plan, Worker, build_task, task_config
from harvest.fleet.puzzles import dataset_present
from harvest.fleet.sky import FINISHED_OK, JobRecord, Jobs
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


def _launch(jobs: Jobs, task: dict[str, Any], secrets: dict[str, str]) -> None:
    if secrets:
        task["secrets"] = dict(secrets)
    jobs.launch(task, task["name"])


def up(plan: Plan, jobs: Jobs, *, poll: float = 30.0,
       say: Callable[[str], None] = print) -> tuple[list[Worker], list[Worker]]:
    """Launch each worker with no active or succeeded job, after the puzzles build where one is due;
    returns (launched, left as they are)."""
    secrets = secret_values(plan)  # before any launch: a missing one launches nothing
    with tempfile.TemporaryDirectory(prefix="harvest-up-") as tmp:
        @functools.cache
        def wheel() -> Path | None:  # built at the first launch; the launch requests have uploaded it by the end
            return build_wheel(tmp) if plan.spec.carries_checkout else None

        queued = {job.name: job for job in jobs.queue()}
        if plan.build is not None and not dataset_present(plan.build.out):
            queued = _build_first(plan, jobs, queued, secrets, poll, say, wheel)
        launched, kept = [], []
        for worker in plan.workers:
            job = queued.get(worker.job_name)
            if job is not None and (job.active or job.status == FINISHED_OK):
                kept.append(worker)
                continue
            _launch(jobs, task_config(worker, plan.spec, wheel()), secrets)
            launched.append(worker)
    return launched, kept


def _build_first(plan: Plan, jobs: Jobs, queued: dict[str, JobRecord], secrets: dict[str, str], poll: float,
                 say: Callable[[str], None], wheel: Callable[[], Path | None]) -> dict[str, JobRecord]:
    """Launch the puzzles build (unless it is running) and wait until its dataset is committed; one line if
    the build ends without it. Interrupted, the build goes on: the next `up` waits for it again."""
    build = plan.build
    job = queued.get(build.job_name)
    if job is None or not job.active:
        _launch(jobs, build_task(build, plan.spec, wheel()), secrets)
    say(f"puzzles build {build.job_name} running: the trainers start once {build.out} holds the dataset "
        f"(Ctrl-C leaves the build running; `harvest fleet up` again waits on)")
    started = time.monotonic()
    while True:
        queued = {job.name: job for job in jobs.queue()}
        if dataset_present(build.out):
            say(f"puzzles dataset ready at {build.out} after {time.monotonic() - started:.0f}s")
            return queued
        job = queued.get(build.job_name)
        if job is not None and not job.active:
            raise FleetError(f"{plan.spec.path}: puzzles build {build.job_name} ended {job.status} without "
                             f"writing a dataset to {build.out}; see `sky jobs logs --name {build.job_name}`, "
                             f"then rerun `harvest fleet up`")
        time.sleep(poll)


def down(plan: Plan, jobs: Jobs) -> list[Worker]:
    """Cancel each worker whose job is active, and the puzzles build if it runs; returns the workers."""
    queued = {job.name: job for job in jobs.queue()}
    cancelled = [w for w in plan.workers if (job := queued.get(w.job_name)) is not None and job.active]
    for worker in cancelled:
        jobs.cancel(worker.job_name)
    if plan.build is not None and (job := queued.get(plan.build.job_name)) is not None and job.active:
        jobs.cancel(plan.build.job_name)
    return cancelled
