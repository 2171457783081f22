"""The one reader of a training run (run.json, the newest metrics record, the complete checkpoints): what
`harvest status` draws and `harvest fleet status` shows for its training job. Read-only, and cheap on a
bucket: the newest record comes from a ranged read of the metrics file's tail."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from harvest.storage import Storage
from harvest.training import step_parts
from harvest.training.checkpoint import CHECKPOINTS
from harvest.training.kinds import KINDS
from harvest.training.metrics import METRICS
from harvest.training.record import DETAILS, RUN_JSON, RunRecord

TAIL_BYTES = 64 * 1024  # the newest record is in the file's last bytes (a week's file holds ~100k records)


@dataclasses.dataclass(frozen=True)
class TrainingRun:
    url: str
    record: RunRecord | None  # None before the trainer started
    last: dict[str, Any]  # the newest metrics record, {} before the first
    checkpoints: list[int]  # the complete checkpoints' steps, oldest first

    @property
    def loss_name(self) -> str:
        """The metric shown as the loss: the decoder's and the TRM's loss, the SAEs' fvu."""
        return KINDS[self.record.kind].loss if self.record is not None else "loss"

    @property
    def loss(self) -> float | None:
        return self.last.get(self.loss_name)

    @property
    def step(self) -> int | None:
        return self.last.get("step")

    @property
    def tokens_per_s(self) -> float | None:
        return self.last.get("tokens_per_s")

    @property
    def checkpoint(self) -> int | None:
        return self.checkpoints[-1] if self.checkpoints else None

    @property
    def updated(self) -> float | None:
        """The newest record's wall time (the trainer's clock)."""
        return self.last.get("time")

    def age(self, now: float | None = None) -> float | None:
        return None if self.updated is None else max(0.0, (now or time.time()) - self.updated)


def read_training(url: str | Storage) -> TrainingRun:
    """The training run at `url`, as far as it got (all empty before the trainer starts)."""
    storage = url if isinstance(url, Storage) else Storage(url)
    data = storage.read_json(RUN_JSON) if storage.exists(RUN_JSON) else None
    record = RunRecord.from_json(data) if isinstance(data, dict) and data.get("kind") in DETAILS else None
    last = _last_record(storage, METRICS) if storage.exists(METRICS) else {}
    checkpoints = storage.child(CHECKPOINTS)
    steps = step_parts.complete_steps(checkpoints) if checkpoints.exists() else []
    return TrainingRun(storage.url, record, last, steps)


def _last_record(storage: Storage, name: str) -> dict:
    """The last complete line of a JSON-lines file, from a ranged read of its tail."""
    size = storage.size(name)
    tail = storage.read_range(name, max(0, size - TAIL_BYTES), size).decode(errors="replace")
    lines = [line for line in tail.splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else {}
