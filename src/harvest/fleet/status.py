"""`harvest fleet status`: one table, a row per worker, joining SkyPilot's job state (not launched, pending,
running, recovering, done, failed, cancelled) with what storage says of the worker's streams (committed
sidecars, progress.json), then fleet totals and an ETA. Storage is read whatever SkyPilot says: before the
first launch (no jobs controller yet) every worker is not launched; when SkyPilot cannot be asked, the states
are unknown, its error is one line under the table and the command exits 2.
A stream whose worker has not reported for a while is stale: the command says so and exits 1.
A training fleet (train:, sae:) shows its one job instead: step, loss, tokens/s and the last checkpoint,
from the run's own records in its bucket (harvest.training.reader); stale when running but silent.
A features fleet shows each rank's job and where its pass stands, from OUT/scan/ (its part written: done; a
saved state: resumable), and whether the last rank has written the site (OUT/features.json, written last)."""

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

from harvest.console import table_console
from harvest.errors import UserError
from harvest.fleet.plan import Plan, Worker
from harvest.fleet.sky import JobRecord, Jobs
from harvest.ranges import format_ranges
from harvest.sae.features.record import FEATURES_JSON
from harvest.sae.features.scan import SCAN, part_path, state_path
from harvest.storage import Storage
from harvest.store.report import RunScanner, human_age, human_bytes, human_count, status_rows
from harvest.training.reader import TrainingRun, read_training

# A running trainer that has logged nothing for this long is stale (a hung host, a stuck collective).
STALE_AFTER_S = 30 * 60

# A worker's state from its job's ManagedJobStatus (sky/jobs/state.py); every FAILED_* status is "failed".
_STATES = {"PENDING": "pending", "SUBMITTED": "pending", "STARTING": "pending", "RUNNING": "running",
           "RECOVERING": "recovering", "SUCCEEDED": "done", "CANCELLING": "cancelled", "CANCELLED": "cancelled"}
_STATE_STYLE = {"running": "green", "recovering": "yellow", "done": "green", "pending": "cyan",
                "not launched": "dim", "unknown": "dim"}


def job_state(job: JobRecord | None, known: bool = True) -> str:
    """not launched, pending, running, recovering, done, failed or cancelled; unknown when SkyPilot could not
    be asked."""
    if not known:
        return "unknown"
    if job is None:
        return "not launched"
    return _STATES.get(job.status, "failed" if job.status.startswith("FAILED") else job.status.lower())


@dataclasses.dataclass(frozen=True)
class Queue:
    """SkyPilot's managed jobs by name, or the one line saying why they could not be read."""

    jobs: dict[str, JobRecord]
    error: str | None = None

    @classmethod
    def read(cls, jobs: Jobs) -> Queue:
        try:
            return cls({job.name: job for job in jobs.queue()})
        except UserError as e:
            return cls({}, str(e))


@dataclasses.dataclass(frozen=True)
class WorkerStatus:
    worker: Worker
    job: JobRecord | None
    streams: list[dict[str, Any]]  # harvest.store.report.status_rows, one per stream of the worker
    known: bool = True  # SkyPilot answered

    @property
    def state(self) -> str:
        return job_state(self.job, self.known)

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
    error: str | None = None  # SkyPilot's, in one line

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
    progress: TrainingRun
    build: JobRecord | None  # the puzzles build's job, where the fleet has one
    now: float
    error: str | None = None  # SkyPilot's, in one line

    @property
    def state(self) -> str:
        return job_state(self.job, self.error is None)

    @property
    def stale(self) -> bool:
        age = self.progress.age(self.now)
        return self.state == "running" and age is not None and age > STALE_AFTER_S

    @property
    def finished(self) -> bool:
        return self.job is not None and not self.job.active


def training_status(plan: Plan, jobs: Jobs, *, now: float | None = None) -> TrainingStatus:
    queue = Queue.read(jobs)
    (worker,) = plan.workers
    return TrainingStatus(plan, queue.jobs.get(worker.job_name), read_training(worker.group.out),
                          queue.jobs.get(plan.build.job_name) if plan.build else None, now or time.time(), queue.error)


def render_training(status: TrainingStatus) -> list[RenderableType]:
    plan, p, job = status.plan, status.progress, status.job
    (worker,) = plan.workers
    g = worker.group
    table = Table(title=f"{g.name}: {g.accelerator} in {', '.join(g.regions)} -> {g.out}", title_justify="left")
    for name in ("job", "state", "skypilot", "region", "recoveries", "step", p.loss_name, "tokens/s", "checkpoint",
                 "last metrics"):
        table.add_column(name, justify="left" if name in ("job", "state", "skypilot", "region") else "right")
    steps = plan.training.steps
    age = p.age(status.now)
    table.add_row(worker.job_name, Text(status.state, style=_STATE_STYLE.get(status.state, "red")),
                  job.status if job else "-", (job.region if job else None) or "-", str(job.recoveries if job else "-"),
                  "-" if p.step is None else f"{p.step}/{steps if steps is not None else '?'}",
                  "-" if p.loss is None else f"{p.loss:.4g}",
                  human_count(p.tokens_per_s) if p.tokens_per_s else "-",
                  "-" if p.checkpoint is None else f"step {p.checkpoint}",
                  Text(human_age(age) + (" STALE" if status.stale else ""), style="bold red" if status.stale else ""))
    out: list[RenderableType] = [table]
    if plan.build is not None:
        state = "done before" if plan.build.present and status.build is None else \
            job_state(status.build, status.error is None)
        out.append(Text(f"puzzles build {plan.build.job_name}: {state} -> {plan.build.out}"))
    if status.stale:
        out.append(Text(f"stale: {worker.job_name} is running but has logged no metrics to {g.out} for "
                        f"{human_age(age).replace(' ago', '')}", style="bold red"))
    return out + _error_line(status.error)


@dataclasses.dataclass(frozen=True)
class FeaturesStatus:
    plan: Plan
    jobs: list[JobRecord | None]  # each rank's, in rank order
    parts: frozenset[int]  # ranks whose part is in OUT/scan/ (their pass is done)
    saved: frozenset[int]  # ranks with a saved state there (a rerun resumes from it)
    built: bool  # OUT/features.json: the site is written
    error: str | None = None  # SkyPilot's, in one line
    stale = False  # a pass reports nothing between its saves; its job's state says whether it runs

    @property
    def finished(self) -> bool:
        return self.built or all(job is not None and not job.active for job in self.jobs)


def features_status(plan: Plan, jobs: Jobs) -> FeaturesStatus:
    queue = Queue.read(jobs)
    out, world = Storage(plan.workers[0].group.out), len(plan.workers)
    names = {f"{SCAN}/{name}" for name in out.listdir(SCAN)}
    return FeaturesStatus(plan, [queue.jobs.get(w.job_name) for w in plan.workers],
                          frozenset(r for r in range(world) if part_path(r, world) in names),
                          frozenset(r for r in range(world) if state_path(r, world) in names),
                          out.exists(FEATURES_JSON), queue.error)


def render_features(status: FeaturesStatus) -> list[RenderableType]:
    plan, known = status.plan, status.error is None
    out, world = plan.workers[0].group.out, len(plan.workers)
    table = Table(title=f"fleet {plan.spec.name}: features of {plan.spec.data}, {world} ranks -> {out}",
                  title_justify="left")
    for name in ("worker", "accelerator", "region", "state", "skypilot", "recoveries", "rank", "pass"):
        table.add_column(name, justify="right" if name in ("recoveries", "rank") else "left")
    for w, job in zip(plan.workers, status.jobs, strict=True):
        state = job_state(job, known)
        stage = "part written" if w.rank in status.parts else "state saved" if w.rank in status.saved else "-"
        table.add_row(w.worker_id, w.group.accelerator, (job.region if job else None) or ",".join(w.group.regions),
                      Text(state, style=_STATE_STYLE.get(state, "red")), job.status if job else "-",
                      str(job.recoveries if job else "-"), f"{w.rank} of {world}", stage)
    site = f"site written: {out}/index.html" if status.built else \
        "site not written yet (the last rank to finish merges the parts and writes it)"
    line = Text(f"fleet {plan.spec.name}: {len(status.parts)}/{world} ranks done (parts in {out}/{SCAN}/), {site}",
                style="bold")
    return [table, line, *_error_line(status.error)]


def _error_line(error: str | None) -> list[RenderableType]:
    return [] if error is None else [Text(f"job states unknown: {error}", style="bold red")]


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
    queue = Queue.read(jobs)
    out: list[WorkerStatus] = []
    for group in plan.spec.groups:
        workers = plan.group_workers(group.name)
        rows = _group_rows(group.out, sorted(s for w in workers for s in w.streams), plan.counts, now)
        out += [WorkerStatus(w, queue.jobs.get(w.job_name), [rows[s] for s in w.streams], queue.error is None)
                for w in workers]
    return FleetStatus(plan, out, queue.error)


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
    spec = status.plan.spec
    outs = {g.out for g in spec.groups}
    table = Table(title=f"fleet {spec.name}: {len(status.workers)} workers" +
                  (f" -> {next(iter(outs))}" if len(outs) == 1 else ""), title_justify="left")
    for name in ("worker", "accelerator", "region", "state", "skypilot", "recoveries", "streams", "done", "records",
                 "tokens/s", "bytes/s", "last commit", "eta"):
        table.add_column(name, justify="left" if name in ("worker", "accelerator", "region", "state", "skypilot")
                         else "right")
    for w in status.workers:
        ages = [r["age"] for r in w.streams if r["age"] is not None]
        stale, job, g = w.stale, w.job, w.worker.group
        table.add_row(w.worker.worker_id, g.accelerator, (job.region if job else None) or ",".join(g.regions),
                      Text(w.state, style=_STATE_STYLE.get(w.state, "red")), job.status if job else "-",
                      str(job.recoveries if job else "-"), format_ranges(w.worker.streams),
                      f"{w.done}/{len(w.streams)}", _records(w.total("records"), _sum_total([w])),
                      human_count(w.total("rate")) if w.total("rate") else "-",
                      human_bytes(w.total("byte_rate")) if w.total("byte_rate") else "-",
                      Text(human_age(min(ages) if ages else None) + (f" STALE {format_ranges(stale)}"
                                                                       if stale else ""),
                           style="bold red" if stale else ""),
                      _eta(w.total("records"), _sum_total([w]), w.total("tokens"), w.total("rate")))
    out: list[RenderableType] = [table]
    if len(outs) > 1:
        out += [Text(f"{g.name}: {g.accelerator} in {', '.join(g.regions)} -> {g.out}") for g in spec.groups]
    ws = status.workers
    records, tokens, rate, byte_rate = (sum(w.total(k) for w in ws) for k in ("records", "tokens", "rate", "byte_rate"))
    done, streams = sum(w.done for w in ws), sum(len(w.streams) for w in ws)
    states: dict[str, int] = {}
    for w in ws:
        states[w.state] = states.get(w.state, 0) + 1
    line = (f"fleet {spec.name}: {done}/{streams} streams done, "
            f"records {_records(records, _sum_total(ws))}, "
            f"{human_count(rate) if rate else 0} tokens/s ({human_bytes(byte_rate)}/s stored), "
            f"workers {', '.join(f'{n} {state}' for state, n in states.items())}, "
            f"eta {_eta(records, _sum_total(ws), tokens, rate)}")
    out.append(Text(line, style="bold"))
    for worker, stale in status.stale:
        out.append(Text(f"stale: {worker.worker_id} has not committed to streams {format_ranges(stale)} "
                        f"in {worker.group.out} for a while (job {next(w.state for w in ws if w.worker is worker)})",
                        style="bold red"))
    return out + _error_line(status.error)


def show(plan: Plan, jobs: Jobs, *, watch: bool = False, interval: float = 30.0,
         console: Console | None = None, now: datetime | None = None) -> int:
    """Print the status (live with `watch`, until every stream is done, the training job ends, or the features
    site is written); 1 when a stream or the trainer is stale, 2 when SkyPilot could not be asked."""
    console = console or table_console()
    if plan.training is not None:
        read, draw = (lambda: training_status(plan, jobs)), render_training
    elif plan.spec.job == "features":
        read, draw = (lambda: features_status(plan, jobs)), render_features
    else:
        read, draw = (lambda: fleet_status(plan, jobs, now=now)), render
    status = read()
    if watch:
        try:
            with Live(Renderables(*draw(status)), console=console, refresh_per_second=1) as live:
                while not status.finished:
                    time.sleep(interval)
                    status = read()
                    live.update(Renderables(*draw(status)))
        except KeyboardInterrupt:
            pass
    else:
        for renderable in draw(status):
            console.print(renderable)
    return 2 if status.error else 1 if status.stale else 0
