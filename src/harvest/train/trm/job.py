"""`harvest train` with a TRM model: deep-supervision training on a puzzle dataset, on the training runtime.

As the decoder trainer: everything a user can get wrong is refused before the first byte is written, every
process agrees on the settings, the newest intact checkpoint is restored and the loop runs to `steps`,
logging every `log_every` steps and saving every `checkpoint_every`; SIGTERM saves at once and stops (exit
75 short of the steps). A checkpoint holds the whole state (weights, AdamATan2 moments, EMA, puzzle
embeddings, the fixed starting y and z, the halting key) and the carry (every slot's sample, y, z and step
count); the batches are a pure function of (seed, step), so a resumed run continues exactly.
Every process reads the whole training split (bytes per example: 2 x seq_len) and places its own rows.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from harvest.config import stable_hash
from harvest.errors import UserError
from harvest.puzzles.format import open_puzzles
from harvest.runtime import cache, distributed
from harvest.runtime.mesh import data_slots, describe, make_mesh
from harvest.storage import Storage
from harvest.train import curves
from harvest.train.checkpoint import CHECKPOINTS, Checkpoints, abstract
from harvest.train.loop import run_steps
from harvest.train.runlog import MetricsFile, RunRecord, check_run, write_run
from harvest.train.trm.carry import empty_carry
from harvest.train.trm.config import TrmConfig, TrmOptim
from harvest.train.trm.data import batches, epoch_examples
from harvest.train.trm.settings import TrmTrainConfig
from harvest.train.trm.step import batch_shardings, init_state, make_train_step, replicated

KIND = "trm"


class TrmInputError(UserError):
    pass


def state_shapes(model: TrmConfig, optim: TrmOptim, seed: int) -> dict:
    """The checkpoint's tree: the training state, and the carry under "carry"."""
    return jax.eval_shape(lambda: {**init_state(model, optim, seed), "carry": empty_carry(model, optim.batch_size)})


def state_shardings(shapes: dict, mesh) -> dict:
    """The state replicated, the carry split over the data axes as the step wants them."""
    state = {k: v for k, v in shapes.items() if k != "carry"}
    return {**replicated(state, mesh), "carry": batch_shardings(shapes["carry"], mesh)}


def run_trm_train(cfg: TrmTrainConfig) -> dict[str, Any]:
    """Train (or resume) to the steps; returns the summary printed at the end."""
    distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, timeout_s=cfg.peer_timeout)
    cache.keep_compiled(not cfg.no_compile_cache)
    mesh = make_mesh(cfg.mesh or f"data={jax.device_count()}")
    if mesh.shape["model"] > 1:
        raise TrmInputError(f"--mesh {describe(mesh)}: a TRM is replicated, not split over model; put the devices "
                            "on data (and fsdp)")
    slots = data_slots(mesh)
    if cfg.batch_size % slots:
        raise TrmInputError(f"--batch-size {cfg.batch_size} is not a multiple of the mesh's {slots} data slots "
                            f"(data x fsdp of {describe(mesh)})")
    dataset = open_puzzles(cfg.data)
    model, optim = cfg.resolve(dataset.info)
    train = dataset.split("train")
    epoch = len(epoch_examples(train, cfg.seed, 0)[0])
    if epoch < cfg.batch_size:
        raise TrmInputError(f"--batch-size {cfg.batch_size}: an epoch of {cfg.data} (one puzzle per group) has only "
                            f"{epoch} examples")
    steps = cfg.steps if cfg.steps is not None else optim.total_steps(dataset.info)
    trm = {"model": dataclasses.asdict(model), "optim": dataclasses.asdict(optim)}
    record = RunRecord(KIND, cfg.to_dict(), {**trm, "data": cfg.data, "seed": cfg.seed}, describe(mesh),
                       stable_hash(cfg.shared_settings()),
                       details={"steps": steps, "trm": trm, "dataset": dataset.info.kind,
                                "num_params": _num_params(model, optim)})
    distributed.agree({**cfg.shared_settings(), "mesh": record.mesh, "harvest_version": record.harvest_version},
                      "the TRM training settings")
    out = Storage(cfg.out)
    curves.require(cfg.log_to)
    record = check_run(out, record, "a TRM training run")  # the last refusal: nothing is written before it

    shapes = state_shapes(model, optim, cfg.seed)
    shardings = state_shardings(shapes, mesh)
    checkpoints = Checkpoints(out.url_of(CHECKPOINTS), every=cfg.checkpoint_every, keep=cfg.keep)
    restored = checkpoints.restore_latest(abstract(shapes, shardings))
    if restored is None:
        state = jax.jit(lambda: {**init_state(model, optim, cfg.seed), "carry": empty_carry(model, cfg.batch_size)},
                        out_shardings=shardings)()
        saved_at = None
    else:
        saved_at, state, _ = restored
    carry = state.pop("carry")
    write_run(out, record)

    step_fn = make_train_step(model, optim, mesh, state, cfg.batch_size)
    batch_sh = batch_shardings({k: carry[k] for k in ("inputs", "labels", "puzzle_identifiers")}, mesh)
    log = TrmMetrics(MetricsFile(out, int(state["step"]), cfg.log_to, record), int(state["step"]), steps,
                     cfg.log_every, cfg.batch_size * model.seq_len)

    def place(batch: dict) -> dict:
        return {k: jax.make_array_from_callback(v.shape, batch_sh[k], lambda index, v=v: v[index])
                for k, v in batch.items()}

    def save(at: int) -> None:
        checkpoints.save(at, {**state, "carry": carry}, {"batch": at}, force=True)

    feed = batches(train, cfg.batch_size, cfg.seed, start=int(state["step"]))

    def advance(step: int) -> None:
        nonlocal state, carry
        state, carry, metrics = step_fn(state, carry, place(next(feed)))
        log.step(step, metrics)

    start = time.monotonic()
    step = run_steps(int(state["step"]), steps, advance, save, checkpoints=checkpoints, every=cfg.checkpoint_every,
                     saved_at=saved_at, name="harvest-trm-done")
    log.file.close()
    return {"out": out.url, "step": step, "steps": steps, "preempted": step < steps, "loss": log.last.get("loss"),
            "seconds": round(time.monotonic() - start, 1)}


def _num_params(model: TrmConfig, optim: TrmOptim) -> int:
    shapes = jax.eval_shape(lambda: init_state(model, optim, 0))
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes["params"])))


# Metrics averaged over the samples that halted in the interval (weighted by how many halted each step).
HALTED = ("accuracy", "exact_accuracy", "q_halt_accuracy", "steps")


class TrmMetrics:
    """Every `log_every` steps: loss (and its parts), over the samples that halted since the last line their
    exact accuracy (whole grid right), token accuracy, Q-halt accuracy and mean halting step, lr and grid
    tokens/s, on the terminal and in RUN/metrics.jsonl."""

    def __init__(self, file: MetricsFile, step: int, steps: int, every: int, tokens_per_step: int):
        self.file = file
        self.steps, self.every, self.tokens_per_step = steps, every, tokens_per_step
        self._since = (step, time.monotonic())
        self._pending: list[dict] = []  # on device until a log line needs them: no sync per step
        self.last: dict[str, Any] = {}

    def step(self, step: int, metrics: dict) -> None:
        self._pending.append(metrics)
        if step % self.every and step != self.steps:
            return
        values = {k: np.array([float(m[k]) for m in jax.device_get(self._pending)]) for k in metrics}
        halted = values["count"]
        mean = {k: float(np.sum(values[k] * halted) / max(np.sum(halted), 1)) for k in HALTED}
        first, then = self._since
        elapsed = max(time.monotonic() - then, 1e-9)
        self.last = {"step": step, "loss": float(values["loss"].mean()), "lm_loss": float(values["lm_loss"].mean()),
                     "halt_loss": float(values["halt_loss"].mean()), "exact_accuracy": mean["exact_accuracy"],
                     "accuracy": mean["accuracy"], "q_halt_accuracy": mean["q_halt_accuracy"],
                     "halt_step": mean["steps"], "halted": int(halted.sum()), "lr": float(values["lr"][-1]),
                     "tokens_per_s": (step - first) * self.tokens_per_step / elapsed, "time": time.time()}
        self._since, self._pending = (step, time.monotonic()), []
        self.file.append(self.last)
        if self.file.writer:
            print(f"step {step}/{self.steps}  loss {self.last['loss']:.4f}  exact {self.last['exact_accuracy']:.1%}  "
                  f"accuracy {self.last['accuracy']:.1%}  halt step {self.last['halt_step']:.2f}  "
                  f"lr {self.last['lr']:.3g}  {self.last['tokens_per_s']:,.0f} tokens/s", flush=True)
