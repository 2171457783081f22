"""`harvest train`: the training loop on the multi-host runtime, resumable from its checkpoints.

Order matters: everything a user can get wrong (config, shape, mesh, data, disagreeing processes, a run
made with other settings) is refused before the first byte is written. Then the newest checkpoint, if
any, is restored (state and data position) and the loop runs to `steps`, logging metrics, saving every
`checkpoint_every` steps; SIGTERM (the preemption notice) saves at once and stops: short of `steps`, the
command exits 75 (retry later), and rerunning it resumes.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from harvest.config import build, load_yaml, stable_hash
from harvest.data import prompts, streams
from harvest.errors import UserError
from harvest.model import default_compute_dtype
from harvest.model.attention import resolve as resolve_attention
from harvest.model.config import ModelConfig
from harvest.model.flops import train_flops_per_token
from harvest.model.init import init_params
from harvest.model.weights import load_params, param_specs, resolve_checkpoint, tree_set
from harvest.runtime import cache, distributed
from harvest.runtime.chips import peak_flops_per_device
from harvest.runtime.mesh import data_slots, describe, make_mesh
from harvest.storage import Storage
from harvest.train import curves
from harvest.train.checkpoint import CHECKPOINTS, Checkpoints, abstract
from harvest.train.config import TrainConfig
from harvest.train.data import BatchFeeder, Groups, Position, row_source
from harvest.train.optimizer import learning_rate, make_optimizer
from harvest.train.loop import run_steps
from harvest.train.runlog import HOLD_AT, MetricsFile, RunRecord, check_run, write_run
from harvest.train.step import batch_sharding, init_state, make_step, state_shardings
from harvest.train.trm.settings import TrmTrainConfig, build_trm, trm_model

__all__ = ["HOLD_AT", "model_config", "run_train", "train_config"]
KIND = "train"


def train_config(yaml_path: str | None, flags: dict[str, Any]) -> TrainConfig | TrmTrainConfig:
    """The run's config from YAML and flags: a TRM's when the model is one (see harvest.train.trm.settings)."""
    model = trm_model(flags["model"] if flags.get("model") is not None else load_yaml(yaml_path).get("model"))
    if model is not None:
        return build_trm(yaml_path, flags, model)
    return build(TrainConfig, yaml_path, flags)


def model_config(cfg: TrainConfig) -> tuple[ModelConfig, dict[str, Any]]:
    """(ModelConfig, the HF config.json fields it came from): from --model's checkpoint or from --shape."""
    if cfg.shape is not None:
        return ModelConfig.from_hf(cfg.shape, "--shape"), dict(cfg.shape)
    path = resolve_checkpoint(cfg.model)
    model = ModelConfig.from_dir(path)
    return model, json.loads((path / "config.json").read_text())


def run_train(cfg: TrainConfig | TrmTrainConfig) -> dict[str, Any]:
    """Train (or resume) to cfg.steps; returns the summary printed at the end."""
    if isinstance(cfg, TrmTrainConfig):
        from harvest.train.trm.job import run_trm_train

        return run_trm_train(cfg)
    distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, timeout_s=cfg.peer_timeout)
    cache.keep_compiled(not cfg.no_compile_cache)
    mesh = make_mesh(cfg.mesh or f"fsdp={jax.device_count()}")
    model, hf_config = model_config(cfg)
    data = streams.open_data(cfg.data)
    groups = Groups(data.num_streams, cfg.batch_size)
    slots = data_slots(mesh)
    if (cfg.batch_size // cfg.grad_accum) % slots:
        raise UserError(f"--batch-size {cfg.batch_size} / --grad-accum {cfg.grad_accum} = "
                        f"{cfg.batch_size // cfg.grad_accum} rows per micro-batch, not a multiple of the mesh's "
                        f"{slots} data slots (data x fsdp of {describe(mesh)})")
    tokenizer_dir = resolve_checkpoint(cfg.tokenizer or cfg.model)
    tokenizer = prompts.load_tokenizer(tokenizer_dir)
    if len(tokenizer) > model.vocab_size:
        raise UserError(f"tokenizer {tokenizer_dir} has {len(tokenizer)} tokens, more than the model's "
                        f"vocab_size {model.vocab_size}")
    compute_dtype = cfg.compute_dtype or default_compute_dtype()
    attention = resolve_attention(cfg.attention, model.sliding_windows, cfg.seq_len, mesh, backward=True)
    record = RunRecord(KIND, cfg.to_dict(), cfg.run_settings(), describe(mesh), stable_hash(cfg.shared_settings()),
                       compute_dtype, attention, {"hf_config": hf_config, "tokenizer": str(tokenizer_dir),
                                                  "model_type": model.model_type, "num_params": _num_params(model)})
    distributed.agree({**cfg.shared_settings(), "mesh": record.mesh, "harvest_version": record.harvest_version},
                      "the training settings")
    out = Storage(cfg.out)
    curves.require(cfg.log_to)
    record = check_run(out, record, "a training run")  # the last refusal: nothing is written before it

    optimizer = make_optimizer(cfg)
    params_shape = _params_shape(model, cfg.param_dtype)
    shardings = state_shardings(optimizer, model, mesh, params_shape)
    checkpoints = Checkpoints(out.url_of(CHECKPOINTS), every=cfg.checkpoint_every, keep=cfg.keep)
    state_shape = jax.eval_shape(lambda p: {"step": jnp.zeros((), jnp.int32), "params": p,
                                            "opt_state": optimizer.init(p)}, params_shape)
    restored = checkpoints.restore_latest(abstract(state_shape, shardings))
    if restored is None:
        state = init_state(_initial_params(cfg, model, mesh), optimizer, shardings)
        positions = [Position()] * groups.count
        saved_at = None
    else:
        saved_at, state, saved = restored
        positions = [Position.from_json(p) for p in saved["groups"]]
    write_run(out, record)

    shape = (cfg.batch_size, cfg.seq_len)
    sharding = batch_sharding(shape, mesh)
    local_rows = sorted({r for index in sharding.addressable_devices_indices_map(shape).values()
                         for r in range(*index[0].indices(cfg.batch_size))})
    render = prompts.make_renderer(cfg.format, tokenizer, text_field=cfg.text_field, seed=cfg.seed)
    rows_from = row_source(data, render, prompts.encoder(tokenizer, cfg.format), seq_len=cfg.seq_len, long=cfg.long)
    feeder = BatchFeeder(groups, local_rows, rows_from, positions, cfg.seq_len)
    step_fn = make_step(model, mesh, optimizer, shardings, compute_dtype=compute_dtype, remat=cfg.remat,
                        grad_accum=cfg.grad_accum, batch_shape=shape, lr_at=learning_rate(cfg),
                        attention=attention)
    log = MetricsLog(out, int(state["step"]), model, cfg, compute_dtype, record)

    def place(host: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(shape, sharding, lambda index: host[index])

    def save(step: int) -> None:
        data_state = {"groups": [p.to_json() for p in _all_positions(feeder.positions(), groups.count)]}
        checkpoints.save(step, state, data_state, force=True)

    def advance(step: int) -> None:
        nonlocal state
        tokens, segments = feeder.next_batch()
        state, metrics = step_fn(state, place(tokens), place(segments))
        log.step(step, metrics)

    start = time.monotonic()
    step = run_steps(int(state["step"]), cfg.steps, advance, save, checkpoints=checkpoints,
                     every=cfg.checkpoint_every, saved_at=saved_at, name="harvest-train-done")
    log.file.close()
    return {"out": out.url, "step": step, "steps": cfg.steps, "preempted": step < cfg.steps,
            "loss": log.last.get("loss"), "seconds": round(time.monotonic() - start, 1)}


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


class MetricsLog:
    """Every `log_every` steps: loss, grad norm, lr, tokens/s (real tokens, padding not counted) and MFU,
    as a line on the terminal and a record in RUN/metrics.jsonl (process 0; records past a resumed step
    are dropped)."""

    def __init__(self, out: Storage, step: int, model: ModelConfig, cfg: TrainConfig, compute_dtype: str,
                 record: RunRecord):
        self.file = MetricsFile(out, step, cfg.log_to, record)
        self.flops_per_step = train_flops_per_token(model, cfg.seq_len) * cfg.batch_size * cfg.seq_len
        self.peak = peak_flops_per_device(compute_dtype) * jax.device_count()
        self.cfg = cfg
        self._since = (step, time.monotonic())
        self._tokens = 0  # on device until a log line needs it: no sync per step
        self.last: dict[str, Any] = {}

    def step(self, step: int, metrics: dict) -> None:
        self._tokens = self._tokens + metrics["tokens"]
        if step % self.cfg.log_every and step != self.cfg.steps:
            return
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        first, then = self._since
        elapsed = max(time.monotonic() - then, 1e-9)
        self.last = {"step": step, "loss": values["loss"], "grad_norm": values["grad_norm"], "lr": values["lr"],
                     "tokens_per_s": float(self._tokens) / elapsed,
                     "mfu": self.flops_per_step * (step - first) / elapsed / self.peak, "time": time.time()}
        self._since, self._tokens = (step, time.monotonic()), 0
        self.file.append(self.last)
        if self.file.writer:
            print(f"step {step}/{self.cfg.steps}  loss {values['loss']:.4f}  grad_norm {values['grad_norm']:.3g}  "
                  f"lr {values['lr']:.3g}  {self.last['tokens_per_s']:,.0f} tokens/s  mfu {self.last['mfu']:.1%}",
                  flush=True)
