"""A training job's progress, read from its run in the group's bucket (what `harvest fleet status` shows for
train: and sae: fleets): the newest record of RUN/metrics.jsonl, which process 0 of the trainer appends every
`log_every` steps (harvest.train.runlog.MetricsFile: step, loss or fvu, tokens/s, time), and the newest
complete checkpoint (every process's part of one attempt, harvest.train.step_parts). Read-only."""

from __future__ import annotations

import dataclasses
import json
import time

from harvest.storage import Storage
from harvest.train import step_parts

TAIL_BYTES = 64 * 1024  # the newest record is in the file's last bytes (a week's file holds ~100k records)
# A running trainer that has logged nothing for this long is stale (a hung host, a stuck collective).
STALE_AFTER_S = 30 * 60


@dataclasses.dataclass(frozen=True)
class TrainingProgress:
    step: int | None  # of the newest metrics record
    loss: float | None  # loss (decoder, TRM) or fvu (SAE)
    loss_name: str
    tokens_per_s: float | None
    checkpoint: int | None  # the newest complete checkpoint's step
    updated: float | None  # the newest record's wall time (the trainer's clock)

    def age(self, now: float | None = None) -> float | None:
        return None if self.updated is None else max(0.0, (now or time.time()) - self.updated)


def read_progress(out: str) -> TrainingProgress:
    """The run's progress at `out`; all None before its first metrics record and checkpoint."""
    from harvest.train.checkpoint import CHECKPOINTS
    from harvest.train.runlog import METRICS

    storage = Storage(out)
    last = _last_record(storage, METRICS) if storage.exists(METRICS) else {}
    checkpoints = storage.child(CHECKPOINTS)
    copies = step_parts.complete(checkpoints) if checkpoints.exists() else []
    name = "loss" if "loss" in last or "fvu" not in last else "fvu"
    return TrainingProgress(step=last.get("step"), loss=last.get(name), loss_name=name,
                            tokens_per_s=last.get("tokens_per_s"), checkpoint=copies[0][0] if copies else None,
                            updated=last.get("time"))


def _last_record(storage: Storage, name: str) -> dict:
    """The last complete line of a JSON-lines file, from a ranged read of its tail."""
    size = storage.size(name)
    tail = storage.read_range(name, max(0, size - TAIL_BYTES), size).decode(errors="replace")
    lines = [line for line in tail.splitlines() if line.strip()]
    return json.loads(lines[-1]) if lines else {}
