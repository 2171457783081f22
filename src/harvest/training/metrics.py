"""The one metrics log of every trainer: RUN/metrics.jsonl (process 0), kept in step with the checkpoint a run
resumes from, optionally mirrored to curves (--log-to), and a line on the terminal every `log_every` steps.
A trainer says what its record and its line are; the log decides when, and times the steps between."""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import jax

from harvest.storage import Storage
from harvest.training.curves import open_curves
from harvest.training.record import RunRecord

METRICS = "metrics.jsonl"


class MetricsFile:
    """RUN/metrics.jsonl, written by process 0 only: records past the step a run resumed from are dropped
    (the resumed run writes them again). With `log_to` (--log-to), each record goes to those curves too."""

    def __init__(self, out: Storage, step: int, log_to: str | None = None, record: RunRecord | None = None):
        self.out = out
        self.writer = jax.process_index() == 0
        self.records: list[dict[str, Any]] = []
        if self.writer and out.exists(METRICS):
            lines = out.read_bytes(METRICS).decode().splitlines()
            self.records = [r for r in map(json.loads, lines) if r["step"] <= step]
        self.curves = open_curves(log_to, out, record) if self.writer else None

    def append(self, record: dict[str, Any]) -> None:
        if self.writer:
            self.records.append(record)
            self.out.write_bytes(METRICS, "".join(json.dumps(r) + "\n" for r in self.records).encode())
            if self.curves is not None:
                self.curves.append(self.records)

    def close(self) -> None:
        if self.curves is not None:
            self.curves.close()


# (step, the steps' metrics fetched from the device, steps since the last record, seconds since) -> the record
Reduce = Callable[[int, list[dict], int, float], dict[str, Any]]


class MetricsLog:
    """Every `every` steps, at the last step and whenever a step asks (`now`): the trainer's record of the steps
    since the last one (their metrics stay on the device until then: no sync per step), appended to the file and
    printed as the trainer's line."""

    def __init__(self, file: MetricsFile, step: int, steps: int, every: int, reduce: Reduce,
                 line: Callable[[dict[str, Any]], str]):
        self.file, self.steps, self.every, self.reduce, self.line = file, steps, every, reduce, line
        self._since = (step, time.monotonic())
        self._pending: list[dict] = []
        self.last: dict[str, Any] = {}

    def step(self, step: int, metrics: dict, now: bool = False) -> None:
        self._pending.append(metrics)
        if step % self.every and step != self.steps and not now:
            return
        fetched = jax.device_get(self._pending)
        first, then = self._since
        self.last = self.reduce(step, fetched, step - first, max(time.monotonic() - then, 1e-9))
        self._since, self._pending = (step, time.monotonic()), []
        self.file.append(self.last)
        if self.file.writer:
            print(self.line(self.last), flush=True)

    def close(self) -> None:
        self.file.close()
