"""`harvest fleet status`: one table per group, a row per worker, joining SkyPilot's job state with what
storage says of the worker's streams (committed sidecars, progress.json), then fleet totals and an ETA.
A stream whose worker has not reported for a while is stale: the command says so and exits 1.
A training fleet (train:, sae:) shows its one job instead: step, loss, tokens/s and the last checkpoint,
from the run's own records in its bucket (harvest.fleet.progress); stale when running but silent."""

from __future__ import annotations

import dataclasses
import time
from datetime import datetime, timezone
from typing import Any

from rich.console import Console, RenderableType
from rich.console import Group as Renderables
from rich.live import Live
from rich.table import Table
from rich.text import Text

from harvest.fleet.plan import Plan, Worker
from harvest.fleet.progress import STALE_AFTER_S, TrainingProgress, read_progress
from harvest.fleet.sky import JobRecord, Jobs
from harvest.ranges import format_ranges
from harvest.storage import Storage
from harvest.store.report import RunScanner, human_age, human_bytes, human_count, status_rows

_JOB_STYLE = {"RUNNING": "green", "RECOVERING": "yellow", "SUCCEEDED": "green", "PENDING": "dim", "STARTING": "cyan"}


@dataclasses.dataclass(frozen=True)
class WorkerStatus:
    worker: Worker
    job: JobRecord | None
    streams: list[dict[str, Any]]  # harvest.store.report.status_rows, one per stream of the worker

    @property
    def state(self) -> str:
        return self.job.status if self.job else "NOT LAUNCHED"

    @property
    def stale(self) -> list[int]:
        return [r["stream"] for r in self.streams if r["state"] == "stale"]

    def total(self, key: str) -> float:
        return sum(r[key] or 0 for r in self.streams)

    @property
    def done(self) -> int:
        return sum(r["state"] == "done" for r in self.streams)


@dataclasses.dataclass(frozen=True)
class FleetStatus:
    plan: Plan
    workers: list[WorkerStatus]

    @property
    def stale(self) -> list[tuple[Worker, list[int]]]:
        return [(w.worker, w.stale) for w in self.workers if w.stale]

    @property
    def finished(self) -> bool:
        return all(w.done == len(w.streams) for w in self.workers)


@dataclasses.dataclass(frozen=True)
class TrainingStatus:
    plan: Plan
    job: JobRecord | None
    progress: TrainingProgress
    build: JobRecord | None  # the puzzles build's job, where the fleet has one
    now: float

    @property
    def state(self) -> str:
        return self.job.status if self.job else "NOT LAUNCHED"

    @property
    def stale(self) -> bool:
        age = self.progress.age(self.now)
        return self.state == "RUNNING" and age is not None and age > STALE_AFTER_S

    @property
    def finished(self) -> bool:
        return self.job is not None and not self.job.active


def training_status(plan: Plan, jobs: Jobs, *, now: float | None = None) -> TrainingStatus:
    queued = {job.name: job for job in jobs.queue()}
    (worker,) = plan.workers
    return TrainingStatus(plan, queued.get(worker.job_name), read_progress(worker.group.out),
                          queued.get(plan.build.job_name) if plan.build else None, now or time.time())


def render_training(status: TrainingStatus) -> list[RenderableType]:
    plan, p, job = status.plan, status.progress, status.job
    (worker,) = plan.workers
    g = worker.group
    table = Table(title=f"{g.name}: {g.accelerator} in {', '.join(g.regions)} -> {g.out}", title_justify="left")
    for name in ("job", "state", "region", "recoveries", "step", p.loss_name, "tokens/s", "checkpoint",
                 "last metrics"):
        table.add_column(name, justify="left" if name in ("job", "state", "region") else "right")
    steps = plan.training.steps
    age = p.age(status.now)
    table.add_row(worker.job_name, Text(status.state, style=_JOB_STYLE.get(status.state, "red")),
                  (job.region if job else None) or "-", str(job.recoveries if job else "-"),
                  "-" if p.step is None else f"{p.step}/{steps if steps is not None else '?'}",
                  "-" if p.loss is None else f"{p.loss:.4g}",
                  human_count(p.tokens_per_s) if p.tokens_per_s else "-",
                  "-" if p.checkpoint is None else f"step {p.checkpoint}",
                  Text(human_age(age) + (" STALE" if status.stale else ""), style="bold red" if status.stale else ""))
    out: list[RenderableType] = [table]
    if plan.build is not None:
        state = status.build.status if status.build else ("done before" if plan.build.present else "NOT LAUNCHED")
        out.append(Text(f"puzzles build {plan.build.job_name}: {state} -> {plan.build.out}"))
    if status.stale:
        out.append(Text(f"stale: {worker.job_name} is RUNNING but has logged no metrics to {g.out} for "
                        f"{human_age(age).replace(' ago', '')}", style="bold red"))
    return out


def _pending(stream: int, total: int | None) -> dict[str, Any]:
    return {"stream": stream, "state": "pending", "records": 0, "total": total, "samples": 0, "tokens": 0,
            "shards": 0, "bytes": 0, "rate": 0.0, "byte_rate": 0.0, "worker": "-", "age": None}


def _group_rows(out: str, streams: list[int], counts: tuple[int, ...] | None, now: datetime) -> dict[int, dict]:
    """Per-stream status in one group's output (read-only); all pending before its run.json exists."""
    storage = Storage(out)
    if not storage.exists("run.json"):
        return {s: _pending(s, counts[s] if counts else None) for s in streams}
    scanner = RunScanner(storage)
    scanner.streams = streams
    return {r["stream"]: r for r in status_rows(scanner, now)}


def fleet_status(plan: Plan, jobs: Jobs, *, now: datetime | None = None) -> FleetStatus:
    now = now or datetime.now(timezone.utc)
    queued = {job.name: job for job in jobs.queue()}
    out: list[WorkerStatus] = []
    for group in plan.spec.groups:
        workers = plan.group_workers(group.name)
        rows = _group_rows(group.out, sorted(s for w in workers for s in w.streams), plan.counts, now)
        out += [WorkerStatus(w, queued.get(w.job_name), [rows[s] for s in w.streams]) for w in workers]
    return FleetStatus(plan, out)


def _eta(records: float, total: float | None, tokens: float, rate: float) -> str:
    """Remaining records at the tokens per record seen so far, over the current tokens/s."""
    if total is None or not rate or not records:
        return "-"
    seconds = (total - records) * (tokens / records) / rate
    return "done" if seconds <= 0 else human_age(seconds).replace(" ago", "")


def _records(records: float, total: float | None) -> str:
    return f"{human_count(records)}/{human_count(total)}" if total else f"{human_count(records)}/?"


def _sum_total(rows: list[WorkerStatus]) -> float | None:
    totals = [r["total"] for w in rows for r in w.streams]
    return None if any(t is None for t in totals) else sum(totals)


def render(status: FleetStatus) -> list[RenderableType]:
    out: list[RenderableType] = []
    for group in status.plan.spec.groups:
        rows = [w for w in status.workers if w.worker.group.name == group.name]
        table = Table(title=f"{group.name}: {group.accelerator} in {', '.join(group.regions)} -> {group.out}",
                      title_justify="left")
        for name in ("worker", "job", "region", "recoveries", "streams", "done", "records", "tokens/s", "bytes/s",
                     "last commit", "eta"):
            table.add_column(name, justify="left" if name in ("worker", "job", "region") else "right")
        for w in rows:
            ages = [r["age"] for r in w.streams if r["age"] is not None]
            stale = w.stale
            table.add_row(w.worker.worker_id, Text(w.state, style=_JOB_STYLE.get(w.state, "red")),
                          (w.job.region if w.job else None) or "-", str(w.job.recoveries if w.job else "-"),
                          format_ranges(w.worker.streams),
                          f"{w.done}/{len(w.streams)}", _records(w.total("records"), _sum_total([w])),
                          human_count(w.total("rate")) if w.total("rate") else "-",
                          human_bytes(w.total("byte_rate")) if w.total("byte_rate") else "-",
                          Text(human_age(min(ages) if ages else None) + (f" STALE {format_ranges(stale)}"
                                                                           if stale else ""),
                               style="bold red" if stale else ""),
                          _eta(w.total("records"), _sum_total([w]), w.total("tokens"), w.total("rate")))
        out.append(table)
    ws = status.workers
    records, tokens, rate, byte_rate = (sum(w.total(k) for w in ws) for k in ("records", "tokens", "rate", "byte_rate"))
    done, streams = sum(w.done for w in ws), sum(len(w.streams) for w in ws)
    running = sum(w.state == "RUNNING" for w in ws)
    line = (f"fleet {status.plan.spec.name}: {done}/{streams} streams done, "
            f"records {_records(records, _sum_total(ws))}, "
            f"{human_count(rate) if rate else 0} tokens/s ({human_bytes(byte_rate)}/s stored), "
            f"{running}/{len(ws)} workers running, "
            f"eta {_eta(records, _sum_total(ws), tokens, rate)}")
    out.append(Text(line, style="bold"))
    for worker, stale in status.stale:
        out.append(Text(f"stale: {worker.worker_id} has not committed to streams {format_ranges(stale)} "
                        f"in {worker.group.out} for a while (job {next(w.state for w in ws if w.worker is worker)})",
                        style="bold red"))
    return out


def show(plan: Plan, jobs: Jobs, *, watch: bool = False, interval: float = 30.0,
         console: Console | None = None, now: datetime | None = None) -> int:
    """Print the status (live with `watch`, until every stream is done, or the training job ends); 1 when a
    stream or the trainer is stale."""
    console = console or Console()
    if plan.training is not None:
        read, draw = (lambda: training_status(plan, jobs)), render_training
    else:
        read, draw = (lambda: fleet_status(plan, jobs, now=now)), render
    status = read()
    if not watch:
        for renderable in draw(status):
            console.print(renderable)
        return 1 if status.stale else 0
    try:
        with Live(Renderables(*draw(status)), console=console, refresh_per_second=1) as live:
            while not status.finished:
                time.sleep(interval)
                status = read()
                live.update(Renderables(*draw(status)))
    except KeyboardInterrupt:
        pass
    return 1 if status.stale else 0
