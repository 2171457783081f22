"""`harvest train` of a decoder, a trainer on the runtime (harvest.training.run): a HF checkpoint (or a shape
from scratch) trained on packed rows of a streams directory; a checkpoint holds the params, AdamW's state and
every stream group's position, so a resumed run reads on where it stopped."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from harvest.config import stable_hash
from harvest.data import prompts, streams
from harvest.decoder.config import TrainConfig
from harvest.decoder.data import BatchFeeder, Groups, Position, row_source
from harvest.decoder.optimizer import learning_rate, make_optimizer
from harvest.decoder.step import batch_sharding, init_state, make_step, state_shardings
from harvest.errors import UserError
from harvest.model import default_compute_dtype
from harvest.model.attention import resolve as resolve_attention
from harvest.model.config import ModelConfig
from harvest.model.flops import train_flops_per_token
from harvest.model.init import init_params
from harvest.model.weights import load_params, param_specs, resolve_checkpoint, tree_set
from harvest.runtime.chips import peak_flops_per_device
from harvest.runtime.mesh import data_slots, describe
from harvest.storage import Storage
from harvest.training.checkpoint import Checkpoints, abstract
from harvest.training.record import DecoderDetails, RunRecord
from harvest.training.trainer import Trainer


def model_config(cfg: TrainConfig) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, the HF config.json fields it came from): from --model's checkpoint or from --shape."""
    if cfg.shape is not None:
        return ModelConfig.from_hf(cfg.shape, "--shape"), dict(cfg.shape)
    path = resolve_checkpoint(cfg.model)
    model = ModelConfig.from_dir(path)
    return model, json.loads((path / "config.json").read_text())


class DecoderTrainer(Trainer):
    """A decoder from a HF checkpoint (or from scratch) on packed token rows; its data position is every stream
    group's."""

    kind, what, settings_what = "train", "a training run", "the training settings"

    def prepare(self, mesh, out: Storage) -> RunRecord:
        cfg = self.cfg
        self.steps, self.mesh = cfg.steps, mesh
        self.model, hf_config = model_config(cfg)
        self.data = streams.open_data(cfg.data)
        self.groups = Groups(self.data.num_streams, cfg.batch_size)
        slots = data_slots(mesh)
        if (cfg.batch_size // cfg.grad_accum) % slots:
            raise UserError(f"--batch-size {cfg.batch_size} / --grad-accum {cfg.grad_accum} = "
                            f"{cfg.batch_size // cfg.grad_accum} rows per micro-batch, not a multiple of the mesh's "
                            f"{slots} data slots (data x fsdp of {describe(mesh)})")
        tokenizer_dir = resolve_checkpoint(cfg.tokenizer or cfg.model)
        self.tokenizer = prompts.load_tokenizer(tokenizer_dir)
        if len(self.tokenizer) > self.model.vocab_size:
            raise UserError(f"tokenizer {tokenizer_dir} has {len(self.tokenizer)} tokens, more than the model's "
                            f"vocab_size {self.model.vocab_size}")
        self.compute_dtype = cfg.compute_dtype or default_compute_dtype()
        self.attention = resolve_attention(cfg.attention, self.model.sliding_windows, cfg.seq_len,
                                           backward=True, softcap=self.model.attn_softcap)
        details = DecoderDetails(hf_config, str(tokenizer_dir), self.model.model_type, _num_params(self.model))
        return RunRecord(self.kind, cfg.to_dict(), cfg.run_settings(), describe(mesh),
                         stable_hash(cfg.shared_settings()), self.compute_dtype, self.attention, details)

    def abstract_state(self):
        self.optimizer = make_optimizer(self.cfg)
        params_shape = _params_shape(self.model, self.cfg.param_dtype)
        self.shardings = state_shardings(self.optimizer, self.model, self.mesh, params_shape)
        state_shape = jax.eval_shape(lambda p: {"step": jnp.zeros((), jnp.int32), "params": p,
                                                "opt_state": self.optimizer.init(p)}, params_shape)
        return abstract(state_shape, self.shardings)

    def resume(self, state, data, checkpoints) -> int:
        cfg = self.cfg
        if state is None:
            state = init_state(_initial_params(cfg, self.model, self.mesh), self.optimizer, self.shardings)
            positions = [Position()] * self.groups.count
        else:
            positions = [Position.from_json(p) for p in data["groups"]]
        self.state = state
        self.shape = (cfg.batch_size, cfg.seq_len)
        self.sharding = batch_sharding(self.shape, self.mesh)
        local_rows = sorted({r for index in self.sharding.addressable_devices_indices_map(self.shape).values()
                             for r in range(*index[0].indices(cfg.batch_size))})
        render = prompts.make_renderer(cfg.format, self.tokenizer, text_field=cfg.text_field, seed=cfg.seed)
        rows_from = row_source(self.data, render, prompts.encoder(self.tokenizer, cfg.format), seq_len=cfg.seq_len,
                               long=cfg.long)
        self.feeder = BatchFeeder(self.groups, local_rows, rows_from, positions, cfg.seq_len)
        self.step_fn = make_step(self.model, self.mesh, self.optimizer, self.shardings,
                                 compute_dtype=self.compute_dtype, remat=cfg.remat, grad_accum=cfg.grad_accum,
                                 batch_shape=self.shape, lr_at=learning_rate(cfg), attention=self.attention)
        self.flops_per_step = train_flops_per_token(self.model, cfg.seq_len) * cfg.batch_size * cfg.seq_len
        self.peak = peak_flops_per_device(self.compute_dtype) * jax.device_count()
        return int(state["step"])

    def advance(self, step: int) -> dict:
        tokens, segments = self.feeder.next_batch()
        self.state, metrics = self.step_fn(self.state, self._place(tokens), self._place(segments))
        return metrics

    def _place(self, host: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(self.shape, self.sharding, lambda index: host[index])

    def save(self, checkpoints: Checkpoints, step: int) -> None:
        positions = _all_positions(self.feeder.positions(), self.groups.count)
        checkpoints.save(step, self.state, {"groups": [p.to_json() for p in positions]}, force=True)

    def record(self, step: int, metrics: list[dict], steps: int, seconds: float) -> dict[str, Any]:
        """Loss, grad norm, lr, tokens/s (real tokens, padding not counted) and MFU."""
        values = {k: float(v) for k, v in metrics[-1].items()}
        tokens = float(sum(m["tokens"] for m in metrics))
        return {"step": step, "loss": values["loss"], "grad_norm": values["grad_norm"], "lr": values["lr"],
                "tokens_per_s": tokens / seconds, "mfu": self.flops_per_step * steps / seconds / self.peak,
                "time": time.time()}

    def line(self, r: dict[str, Any]) -> str:
        return (f"step {r['step']}/{self.steps}  loss {r['loss']:.4f}  grad_norm {r['grad_norm']:.3g}  "
                f"lr {r['lr']:.3g}  {r['tokens_per_s']:,.0f} tokens/s  mfu {r['mfu']:.1%}")

    def final(self, step: int, last: dict[str, Any]) -> tuple[dict[str, Any], str]:
        return {"loss": last.get("loss")}, f"loss {last.get('loss')}"


def _num_params(model: ModelConfig) -> int:
    return int(sum(np.prod(((model.num_layers,) if s.layered else ()) + s.shape)
                   for s in param_specs(model, head=True).values()))


def _params_shape(model: ModelConfig, dtype: str) -> dict:
    tree: dict = {}
    for path, spec in param_specs(model, head=True).items():
        shape = ((model.num_layers,) if spec.layered else ()) + spec.shape
        tree_set(tree, path, jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)))
    return tree


def _initial_params(cfg: TrainConfig, model: ModelConfig, mesh) -> dict:
    if cfg.model is not None:
        return load_params(resolve_checkpoint(cfg.model), model, dtype=jnp.dtype(cfg.param_dtype), mesh=mesh,
                           head=True)
    return init_params(model, cfg.seed, mesh, dtype=cfg.param_dtype)


def _all_positions(mine: dict[int, Position], count: int) -> list[Position]:
    """Every group's position: each process knows its own groups'; one small gather joins them."""
    table = np.full((count, len(dataclasses.fields(Position))), -1, np.int64)
    for group, position in mine.items():
        table[group] = position.to_json()
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        table = multihost_utils.process_allgather(table).max(axis=0)
    return [Position.from_json(row) for row in table]
