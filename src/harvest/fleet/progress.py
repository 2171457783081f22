"""A training job's progress, read from its run in the group's bucket (what `harvest fleet status` shows for
train: and sae: fleets): the newest record of RUN/metrics.jsonl, which process 0 of the trainer appends every
`log_every` steps (harvest.train.runlog.MetricsFile: step, loss or fvu, tokens/s, time), and the newest
complete checkpoint (every process's part of one attempt, harvest.store.step_parts). Read-only."""

from __future__ import annotations

import dataclasses
import json
import time

from harvest.storage import Storage
from harvest.store import step_parts

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
    last: dict = {}
    if storage.exists(METRICS):
        lines = storage.read_bytes(METRICS).decode().splitlines()
        last = json.loads(lines[-1]) if lines else {}
    checkpoints = storage.child(CHECKPOINTS)
    copies = step_parts.complete(checkpoints) if checkpoints.exists() else []
    name = "loss" if "loss" in last or "fvu" not in last else "fvu"
    return TrainingProgress(step=last.get("step"), loss=last.get(name), loss_name=name,
                            tokens_per_s=last.get("tokens_per_s"), checkpoint=copies[0][0] if copies else None,
                            updated=last.get("time"))
