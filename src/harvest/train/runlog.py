"""What every training loop on the runtime shares (`harvest train`, `harvest sae train`): the run's
run.json and the refusal to continue a run made with other settings, metrics.jsonl (kept in step with
the checkpoint a run resumes from), SIGTERM as a flag the loop polls, and the tests' hold at a step."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax

from harvest.errors import UserError
from harvest.runtime import sigterm
from harvest.storage import Storage

RUN_JSON = "run.json"
METRICS = "metrics.jsonl"
# Tests: after this step the loop waits for SIGTERM, so a test's signal lands short of the end by construction.
HOLD_AT = "HARVEST_TRAIN_HOLD_AT_STEP"


class RunMismatch(UserError):
    pass


def check_run(out: Storage, info: dict[str, Any], what: str) -> None:
    """Refuse to continue a run of another kind, or one made with other run settings, showing the difference.
    `info` holds "kind" and "run_settings"; `what` names the kind in the message ("a training run")."""
    if not out.exists(RUN_JSON):
        return
    old = out.read_json(RUN_JSON)
    if old.get("kind") != info["kind"]:
        raise RunMismatch(f"{out.url} holds something other than {what}; use another --out")
    before, now = old.get("run_settings") or {}, info["run_settings"]
    differ = [f"{k}: {before.get(k)!r} -> {now[k]!r}" for k in now if before.get(k) != now[k]]
    if differ:
        raise RunMismatch(f"{out.url} holds {what} made with other settings ({'; '.join(differ)}); use another --out")


class MetricsFile:
    """RUN/metrics.jsonl, written by process 0 only: records past the step a run resumed from are dropped
    (the resumed run writes them again)."""

    def __init__(self, out: Storage, step: int):
        self.out = out
        self.writer = jax.process_index() == 0
        self.records: list[dict[str, Any]] = []
        if self.writer and out.exists(METRICS):
            lines = out.read_bytes(METRICS).decode().splitlines()
            self.records = [r for r in map(json.loads, lines) if r["step"] <= step]

    def append(self, record: dict[str, Any]) -> None:
        if self.writer:
            self.records.append(record)
            self.out.write_bytes(METRICS, "".join(json.dumps(r) + "\n" for r in self.records).encode())


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
