"""`harvest train` of a TRM: deep-supervision training on a puzzle dataset, a trainer on the runtime
(harvest.training.run)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np

from harvest.config import stable_hash
from harvest.errors import UserError
from harvest.puzzles.format import open_puzzles
from harvest.runtime.mesh import data_slots, describe
from harvest.storage import Storage
from harvest.training.checkpoint import Checkpoints, abstract
from harvest.training.record import RunRecord, TrmDetails
from harvest.training.trainer import Trainer
from harvest.trm.carry import empty_carry
from harvest.trm.data import batches, epoch_examples
from harvest.trm.hparams import TrmConfig, TrmOptim
from harvest.trm.step import batch_shardings, init_state, make_train_step, replicated

# Metrics averaged over the samples that halted in the interval (weighted by how many halted each step).
HALTED = ("accuracy", "exact_accuracy", "q_halt_accuracy", "steps")


class TrmInputError(UserError):
    pass


def state_shapes(model: TrmConfig, optim: TrmOptim, seed: int) -> dict:
    """The checkpoint's tree: the training state, and the carry under "carry"."""
    return jax.eval_shape(lambda: {**init_state(model, optim, seed), "carry": empty_carry(model, optim.batch_size)})


def state_shardings(shapes: dict, mesh) -> dict:
    """The state replicated, the carry split over the data axes as the step wants them."""
    state = {k: v for k, v in shapes.items() if k != "carry"}
    return {**replicated(state, mesh), "carry": batch_shardings(shapes["carry"], mesh)}


class TrmTrainer(Trainer):
    """Deep supervision on a puzzle dataset. A checkpoint holds the whole state (weights, AdamATan2 moments, EMA,
    puzzle embeddings, the fixed starting y and z, the halting key) and the carry (every slot's sample, y, z and
    step count); the batches are a pure function of (seed, step), so a resumed run continues exactly. Every
    process reads the whole training split (2 x seq_len bytes an example) and places its own rows."""

    kind, what, settings_what = "trm", "a TRM training run", "the TRM training settings"

    def prepare(self, mesh, out: Storage) -> RunRecord:
        cfg = self.cfg
        self.mesh = mesh
        if mesh.shape["model"] > 1:
            raise TrmInputError(f"--mesh {describe(mesh)}: a TRM is replicated, not split over model; put the "
                                "devices on data (and fsdp)")
        slots = data_slots(mesh)
        if cfg.batch_size % slots:
            raise TrmInputError(f"--batch-size {cfg.batch_size} is not a multiple of the mesh's {slots} data slots "
                                f"(data x fsdp of {describe(mesh)})")
        dataset = open_puzzles(cfg.data)
        self.model, self.optim = model, optim = cfg.resolve(dataset.info)
        self.train = dataset.split("train")
        epoch = len(epoch_examples(self.train, cfg.seed, 0)[0])
        if epoch < cfg.batch_size:
            raise TrmInputError(f"--batch-size {cfg.batch_size}: an epoch of {cfg.data} (one puzzle per group) has "
                                f"only {epoch} examples")
        self.steps = cfg.steps if cfg.steps is not None else optim.total_steps(dataset.info)
        trm = {"model": dataclasses.asdict(model), "optim": dataclasses.asdict(optim)}
        return RunRecord(self.kind, cfg.to_dict(), {**trm, "data": cfg.data, "seed": cfg.seed}, describe(mesh),
                         stable_hash(cfg.shared_settings()),
                         details=TrmDetails(self.steps, trm, dataset.info.kind, _num_params(model, optim)))

    def abstract_state(self):
        shapes = state_shapes(self.model, self.optim, self.cfg.seed)
        self.shardings = state_shardings(shapes, self.mesh)
        return abstract(shapes, self.shardings)

    def resume(self, state, data, checkpoints) -> int:
        cfg, model = self.cfg, self.model
        if state is None:
            state = jax.jit(lambda: {**init_state(model, self.optim, cfg.seed),
                                     "carry": empty_carry(model, cfg.batch_size)}, out_shardings=self.shardings)()
        self.carry = state.pop("carry")
        self.state = state
        self.step_fn = make_train_step(model, self.optim, self.mesh, state, cfg.batch_size)
        self.batch_sh = batch_shardings({k: self.carry[k] for k in ("inputs", "labels", "puzzle_identifiers")},
                                        self.mesh)
        self.feed = batches(self.train, cfg.batch_size, cfg.seed, start=int(state["step"]))
        self.tokens_per_step = cfg.batch_size * model.seq_len
        return int(state["step"])

    def advance(self, step: int) -> dict:
        batch = {k: jax.make_array_from_callback(v.shape, self.batch_sh[k], lambda index, v=v: v[index])
                 for k, v in next(self.feed).items()}
        self.state, self.carry, metrics = self.step_fn(self.state, self.carry, batch)
        return metrics

    def save(self, checkpoints: Checkpoints, step: int) -> None:
        checkpoints.save(step, {**self.state, "carry": self.carry}, {"batch": step}, force=True)

    def record(self, step: int, metrics: list[dict], steps: int, seconds: float) -> dict[str, Any]:
        """Loss (and its parts); over the samples that halted since the last record their exact accuracy (whole
        grid right), token accuracy, Q-halt accuracy and mean halting step; lr and grid tokens/s."""
        values = {k: np.array([float(m[k]) for m in metrics]) for k in metrics[-1]}
        halted = values["count"]
        mean = {k: float(np.sum(values[k] * halted) / max(np.sum(halted), 1)) for k in HALTED}
        return {"step": step, "loss": float(values["loss"].mean()), "lm_loss": float(values["lm_loss"].mean()),
                "halt_loss": float(values["halt_loss"].mean()), "exact_accuracy": mean["exact_accuracy"],
                "accuracy": mean["accuracy"], "q_halt_accuracy": mean["q_halt_accuracy"],
                "halt_step": mean["steps"], "halted": int(halted.sum()), "lr": float(values["lr"][-1]),
                "tokens_per_s": steps * self.tokens_per_step / seconds, "time": time.time()}

    def line(self, r: dict[str, Any]) -> str:
        return (f"step {r['step']}/{self.steps}  loss {r['loss']:.4f}  exact {r['exact_accuracy']:.1%}  "
                f"accuracy {r['accuracy']:.1%}  halt step {r['halt_step']:.2f}  lr {r['lr']:.3g}  "
                f"{r['tokens_per_s']:,.0f} tokens/s")

    def final(self, step: int, last: dict[str, Any]) -> tuple[dict[str, Any], str]:
        return {"loss": last.get("loss")}, f"loss {last.get('loss')}"


def _num_params(model: TrmConfig, optim: TrmOptim) -> int:
    shapes = jax.eval_shape(lambda: init_state(model, optim, 0))
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(shapes["params"])))
