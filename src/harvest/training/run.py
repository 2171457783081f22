"""run(trainer): the one order every trainer runs in. Everything a user can get wrong is refused before the
first byte is written (the trainer's checks, the processes' agreement, a run made with other settings); then
the newest intact checkpoint is restored and the loop runs to the last step, logging and checkpointing;
SIGTERM saves at once and stops short (the command exits 75: rerunning it resumes)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from harvest.runtime import cache, distributed
from harvest.runtime.mesh import make_mesh
from harvest.storage import Storage
from harvest.training import curves, kinds
from harvest.training.checkpoint import CHECKPOINTS, Checkpoints
from harvest.training.loop import run_steps
from harvest.training.metrics import MetricsFile, MetricsLog
from harvest.training.record import check_run, write_run
from harvest.training.trainer import Trainer


@dataclasses.dataclass(frozen=True)
class Summary:
    """What a training command prints at the end: where it stands, and the trainer's own numbers (`final`)."""

    out: str
    step: int
    steps: int
    final: dict[str, Any]
    said: str  # `final` as the command prints it
    seconds: float

    @property
    def preempted(self) -> bool:
        return self.step < self.steps

    def to_json(self) -> dict[str, Any]:
        return {"out": self.out, "step": self.step, "steps": self.steps, "preempted": self.preempted, **self.final,
                "seconds": self.seconds}


def run(trainer: Trainer) -> Summary:
    """Train (or resume) to the trainer's last step."""
    cfg = trainer.cfg
    distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, timeout_s=cfg.peer_timeout)
    cache.keep_compiled(not cfg.no_compile_cache)
    mesh = make_mesh(cfg.mesh or kinds.KINDS[trainer.kind].default_mesh.format(jax.device_count()))
    out = Storage(cfg.out)
    record = trainer.prepare(mesh, out)
    distributed.agree({**cfg.shared_settings(), "mesh": record.mesh, "harvest_version": record.harvest_version,
                       **trainer.agreed()}, trainer.settings_what)
    curves.require(cfg.log_to)
    record = check_run(out, record, trainer.what)  # the last refusal: nothing is written before it

    checkpoints = Checkpoints(out.url_of(CHECKPOINTS), every=cfg.checkpoint_every, keep=cfg.keep)
    restored = checkpoints.restore_latest(trainer.abstract_state())
    saved_at, state, data = restored if restored is not None else (None, None, None)
    step = trainer.resume(state, data, checkpoints)
    write_run(out, record)

    log = MetricsLog(MetricsFile(out, step, cfg.log_to, record), step, trainer.steps, cfg.log_every,
                     trainer.record, trainer.line)

    def advance(at: int) -> None:
        metrics = trainer.advance(at)
        log.step(at, metrics, trainer.log_now(metrics))

    start = time.monotonic()
    step = run_steps(step, trainer.steps, advance, lambda at: trainer.save(checkpoints, at), checkpoints=checkpoints,
                     every=cfg.checkpoint_every, saved_at=saved_at, name=f"harvest-{trainer.kind}-done")
    log.close()
    final, said = trainer.final(step, log.last)
    return Summary(out.url, step, trainer.steps, final, said, round(time.monotonic() - start, 1))


def train(cfg: Any) -> dict[str, Any]:
    """Train (or resume) with the trainer of cfg's kind; the summary as JSON (bench, tests)."""
    return run(kinds.trainer_for(cfg)).to_json()
