"""What every training loop on the runtime shares (`harvest train`, `harvest sae train`, the TRM trainer): the
run's record (run.json) and the refusal to continue a run made with other settings, metrics.jsonl (kept in
step with the checkpoint a run resumes from), SIGTERM as a flag the loop polls, and the tests' hold at a step."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import uuid
from typing import Any

import jax

from harvest.errors import UserError
from harvest.runtime import sigterm
from harvest.storage import Storage
from harvest.train.curves import open_curves
from harvest.version import harvest_version

RUN_JSON = "run.json"
METRICS = "metrics.jsonl"
# Tests: after this step the loop waits for SIGTERM, so a test's signal lands short of the end by construction.
HOLD_AT = "HARVEST_TRAIN_HOLD_AT_STEP"


FORMAT_VERSION = 1  # of run.json; records written before it carry none (0) and no run_id


class RunMismatch(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """A training run's run.json: what made it (all settings, those a resumed run must keep, the mesh, the
    attention kernel, the compute dtype) and what its kind adds (`details`: the HF config of a decoder, the SAEs'
    specs, the TRM's model, ...), stored beside the named fields as top-level keys. `run_id` names the run to
    curve loggers (the W&B run a resumed run continues)."""

    kind: str
    config: dict[str, Any]
    run_settings: dict[str, Any]
    mesh: str
    config_sha256: str
    compute_dtype: str | None = None
    kernel: str | None = None
    details: dict[str, Any] = dataclasses.field(default_factory=dict)
    harvest_version: str = dataclasses.field(default_factory=harvest_version)
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:16])
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        named = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "details"}
        return {**self.details, **named}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        names = {f.name for f in dataclasses.fields(cls)} - {"details"}
        named = {k: v for k, v in data.items() if k in names}
        # Before format 1: no run_id, no version, the decoder's kernel under "attention".
        return cls(**{"run_id": "", "format_version": 0, "kernel": data.get("attention"), **named},
                   details={k: v for k, v in data.items() if k not in names | {"attention"}})


def read_run(out: Storage, kind: str | None = None, what: str = "a harvest training run") -> RunRecord | None:
    """The run's record, None where there is none yet; with `kind`, a record of another kind is refused in one
    line (`what` names the kind wanted, "a training run")."""
    if not out.exists(RUN_JSON):
        return None
    data = out.read_json(RUN_JSON)
    if not isinstance(data, dict) or "kind" not in data:
        raise RunMismatch(f"{out.url}: its run.json is not {what}'s; use another --out")
    if kind is not None and data["kind"] != kind:
        raise RunMismatch(f"{out.url} holds something other than {what} (a run of kind {data['kind']!r}); "
                          "use another --out")
    return RunRecord.from_json(data)


def check_run(out: Storage, record: RunRecord, what: str) -> RunRecord:
    """Refuse to continue a run of another kind, or one made with other run settings, showing the difference;
    returns the record in force: the stored one when the run exists (its run_id kept), else `record`."""
    old = read_run(out, record.kind, what)
    if old is None:
        return record
    before, now = old.run_settings or {}, record.run_settings
    differ = [f"{k}: {before.get(k)!r} -> {now[k]!r}" for k in now if before.get(k) != now[k]]
    if differ:
        raise RunMismatch(f"{out.url} holds {what} made with other settings ({'; '.join(differ)}); use another --out")
    return old


def write_run(out: Storage, record: RunRecord) -> None:
    """Process 0 writes the record once, when the run starts; a resumed run keeps the first."""
    if jax.process_index() == 0 and not out.exists(RUN_JSON):
        out.write_json(RUN_JSON, record.to_json())


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


class SigtermFlag(sigterm.SigtermFlag):
    """harvest.runtime.sigterm's flag (the loop saves and stops at the next step), and the tests' hold."""

    def __enter__(self):
        self._hold_at = int(os.environ.get(HOLD_AT, -1))
        return super().__enter__()

    def hold(self, step: int) -> None:
        """At the step HARVEST_TRAIN_HOLD_AT_STEP names, wait for SIGTERM (tests)."""
        if step == self._hold_at:
            print(f"holding at step {step} until SIGTERM ({HOLD_AT})", flush=True)
            while not self.raised:
                time.sleep(0.02)
