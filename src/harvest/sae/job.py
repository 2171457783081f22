"""`harvest sae train`: SAEs on a run's activations, on the training runtime, resumable from its checkpoints.

As `harvest train`: everything a user can get wrong is refused before the first byte is written, every
process agrees on the settings, the newest intact checkpoint (params, Adam, the readers' positions, the
dead-latent counters) is restored, and the loop runs to the token budget, logging every `log_every`
steps and saving every `checkpoint_every`; SIGTERM saves at once and stops (exit 75 short of the budget).
With --follow the readers follow runs still being written (harvest.read.rounds), one process reading, and the
step reached is saved whenever a reader starts waiting for shards.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from harvest.config import stable_hash
from harvest.model import default_compute_dtype
from harvest.runtime import cache, distributed
from harvest.runtime.mesh import describe, make_mesh
from harvest.sae import data as D
from harvest.sae import model as M
from harvest.sae.config import SaeConfig
from harvest.sae.step import fresh_state, init_state, make_eval, make_optimizer, make_step, state_shardings
from harvest.storage import Storage
from harvest.train import curves
from harvest.train.checkpoint import CHECKPOINTS, Checkpoints, abstract
from harvest.train.loop import run_steps
from harvest.train.runlog import MetricsFile, RunRecord, check_run, read_run, write_run

KIND = "sae"
EVAL_BATCHES = 8  # batches of held-out rows each --eval-every evaluation reads
EVAL_KEYS = ("eval_fvu", "eval_l0", "eval_dead_fraction")
FOLLOW = "follow"  # --follow: the rounds each run's reader took, OUT/follow/run_R/epoch_00000/round_RRRRRR.json


def specs_of(cfg: SaeConfig, widths: dict[str, int]) -> dict[str, M.Spec]:
    specs = {}
    for name, width in widths.items():
        latents = cfg.num_latents(width)
        if cfg.architecture in ("topk", "batchtopk") and cfg.k >= latents:
            raise D.SaeInputError(f"--k {cfg.k} must be smaller than the {latents} latents of the {name} SAE")
        specs[name] = M.Spec(cfg.architecture, width, latents, cfg.k, min(cfg.aux_k or max(width // 2, 1), latents),
                             cfg.aux_coeff, cfg.l1_coeff, cfg.jumprelu_bandwidth)
    return specs


def run_sae_train(cfg: SaeConfig) -> dict[str, Any]:
    """Train (or resume) to cfg.tokens; returns the summary printed at the end."""
    distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, timeout_s=cfg.peer_timeout)
    cache.keep_compiled(not cfg.no_compile_cache)
    mesh = make_mesh(cfg.mesh or f"data={jax.device_count()}")
    tensors = list(cfg.tensor_names)
    follow = cfg.follow_poll if cfg.follow else None
    if follow and jax.process_count() > 1:
        raise D.SaeInputError(f"--follow reads the run with one process, and {jax.process_count()} were started: "
                              "train on one host (its devices all on --mesh), or without --follow once the run is "
                              "complete")
    inputs = D.open_inputs(cfg.runs, cfg.tensor_names, cfg.holdout_streams, cfg.seed, follow)
    specs = specs_of(cfg, inputs.widths)
    part = D.check_batch(cfg.batch_tokens, len(inputs.runs), mesh)
    scales = {t: float(np.sqrt(w / max(inputs.mean_square_norm(t), 1e-12))) if cfg.normalize == "run-stats" else 1.0
              for t, w in inputs.widths.items()}
    compute_dtype = cfg.compute_dtype or default_compute_dtype()
    out = Storage(cfg.out)
    ratio, medians = _norm_rule(cfg, inputs, tensors, out)
    eval_rows = (D.held_out(inputs, tensors, part, mesh, cfg.seed, EVAL_BATCHES, cfg.skip_first, ratio, medians)
                 if cfg.eval_every else None)
    saes = {t: {**s._asdict(), "scale": scales[t], "holdout_streams": inputs.holdout, "max_norm": ratio,
                **({"median_norm": [m[t] for m in medians],
                    "norm_limit": [ratio * m[t] for m in medians]} if ratio else {})}
            for t, s in specs.items()}
    record = RunRecord(KIND, cfg.to_dict(),
                       {**cfg.run_settings(), "mesh": describe(mesh), "processes": jax.process_count()},
                       describe(mesh), stable_hash(cfg.shared_settings()), compute_dtype, details={"saes": saes})
    distributed.agree({**cfg.shared_settings(), "mesh": record.mesh, "harvest_version": record.harvest_version,
                       "median_norms": medians}, "the SAE training settings")
    curves.require(cfg.log_to)
    record = check_run(out, record, "an SAE run")  # the last refusal: nothing is written before it

    steps = cfg.steps
    optimizers = {t: make_optimizer(cfg.learning_rate(s.latents), cfg.warmup, steps, cfg.schedule)
                  for t, s in specs.items()}
    params_shape = {t: jax.eval_shape(lambda s=s: M.init_params(jax.random.key(0), s, jnp.zeros(s.width)))
                    for t, s in specs.items()}
    shardings = state_shardings(specs, optimizers, mesh, params_shape)
    state_shape = jax.eval_shape(lambda p: fresh_state(p, optimizers, specs), params_shape)
    checkpoints = Checkpoints(out.url_of(CHECKPOINTS), every=cfg.checkpoint_every, keep=cfg.keep)
    restored = checkpoints.restore_latest(abstract(state_shape, shardings))
    positions: list[dict] = []  # the readers' states after the last step: what a save while waiting holds

    def save_while_waiting() -> None:
        """--follow: a reader waits for shards; the step reached is saved, so a preemption meanwhile loses nothing."""
        if state is not None and int(state["step"]) not in checkpoints.steps():
            checkpoints.save(int(state["step"]), state, {"readers": [positions]}, force=True)

    batches = D.readers(inputs, tensors, part, mesh, cfg.seed, skip_first=cfg.skip_first, follow=follow,
                        book=out.child(FOLLOW), on_wait=save_while_waiting, max_norm=ratio, medians=medians)
    if restored is None:
        state, saved_at = None, None
    else:
        saved_at, state, saved = restored
        for reader, position in zip(batches, saved["readers"][jax.process_index()]):
            reader.load_state_dict(position)
    write_run(out, record)

    step_fn = make_step(specs, optimizers, shardings, mesh, dead_tokens=cfg.dead_tokens, scales=scales,
                        compute_dtype=compute_dtype)
    evaluate = make_eval(specs, shardings, mesh, scales=scales, compute_dtype=compute_dtype) if cfg.eval_every else None
    log = SaeMetrics(out, 0 if state is None else int(state["step"]), cfg, record, ratio)

    def save(at: int) -> None:
        if state is not None:  # None: no step ran and no checkpoint exists (the init needs a first batch)
            checkpoints.save(at, state, {"readers": D.gather_states(batches)}, force=True)

    def advance(step: int) -> None:
        nonlocal state
        if follow:
            positions[:] = [b.state_dict() for b in batches]
        batch = D.next_batch(batches, tensors)
        if state is None:
            state = _initial_state(cfg, specs, optimizers, shardings, batch, scales)
        state, metrics = step_fn(state, batch)
        held = evaluate(state["params"], eval_rows) if evaluate and step % cfg.eval_every == 0 else None
        log.step(step, metrics, held, D.left_out(batches) if ratio else None)

    start = time.monotonic()
    step = run_steps(0 if state is None else int(state["step"]), steps, advance, save, checkpoints=checkpoints,
                     every=cfg.checkpoint_every, saved_at=saved_at, name="harvest-sae-done")
    log.file.close()
    return {"out": out.url, "step": step, "steps": steps, "preempted": step < steps, "tokens": step * cfg.batch_tokens,
            **{k: log.last.get(k) for k in ("fvu", "l0", "dead_fraction", "dead_window")},
            **({"max_norm": ratio, "median_norm": medians, "massive_left_out": log.last.get("massive_left_out"),
                "massive_share": log.last.get("massive_share")} if ratio else {}),
            "seconds": round(time.monotonic() - start, 1)}


def _norm_rule(cfg: SaeConfig, inputs: D.Inputs, tensors: list[str], out: Storage
               ) -> tuple[float, list[dict[str, float]]]:
    """--max-norm's R and, per run, {tensor: median token norm}: as the SAE run recorded them when it started (a
    resumed run keeps its limits, whatever was committed since; one started before the rule existed, none),
    else the config's R and the runs' own medians (a seeded sample)."""
    old = read_run(out, KIND, "an SAE run")
    saes = (old.details or {}).get("saes", {}) if old is not None else {}
    if saes and all("max_norm" not in saes.get(t, {}) for t in tensors):  # trained before --max-norm existed
        return float(cfg.max_norm or 0), [{} for _ in inputs.runs]
    ratio = cfg.norm_ratio
    if not ratio:
        return 0.0, [{} for _ in inputs.runs]
    if all("median_norm" in saes.get(t, {}) for t in tensors):
        return ratio, [{t: float(saes[t]["median_norm"][r]) for t in tensors} for r in range(len(inputs.runs))]
    return ratio, inputs.median_norms(tensors)


def _initial_state(cfg: SaeConfig, specs: dict[str, M.Spec], optimizers: dict, shardings: dict,
                   batch: dict[str, jax.Array], scales: dict[str, float]) -> dict:
    """The init of every SAE (seeded), its decoder bias from the first batch (as sparsify does)."""
    centre = {"mean": lambda x: jnp.mean(x, axis=0), "geometric-median": M.geometric_median,
              "zeros": lambda x: jnp.zeros(x.shape[1], jnp.float32)}[cfg.b_dec_init]

    def make(batch):
        return {n: M.init_params(jax.random.fold_in(jax.random.key(cfg.seed), i), s,
                                 centre(batch[n].astype(jnp.float32) * scales[n]), cfg.jumprelu_init_threshold)
                for i, (n, s) in enumerate(specs.items())}

    params = jax.jit(make, out_shardings=shardings["params"])(batch)
    return init_state(params, optimizers, specs, shardings)


class SaeMetrics:
    """Every `log_every` steps: per tensor fvu, l0, dead_fraction, aux_loss (their mean over tensors at the
    top level) and tokens/s, as a line on the terminal and a record in RUN/metrics.jsonl; at an evaluation
    (`eval_every`) also eval_fvu, eval_l0, eval_dead_fraction on the held-out rows."""

    def __init__(self, out: Storage, step: int, cfg: SaeConfig, record: RunRecord, ratio: float = 0.0):
        self.file = MetricsFile(out, step, cfg.log_to, record)
        self.cfg, self.ratio = cfg, ratio
        self._since = (step, time.monotonic())
        self.last: dict[str, Any] = {}

    def step(self, step: int, metrics: dict, held: dict | None = None, left_out: tuple[int, int] | None = None) -> None:
        if step % self.cfg.log_every and step != self.cfg.steps and held is None:
            return
        values = {t: {k: float(v) for k, v in m.items()} for t, m in jax.device_get(metrics).items()}
        for t, m in jax.device_get(held or {}).items():
            values[t].update({f"eval_{k}": float(v) for k, v in m.items()})
        first, then = self._since
        elapsed = max(time.monotonic() - then, 1e-9)
        keys = ("fvu", "l0", "dead_fraction", "aux_loss") + (EVAL_KEYS if held else ())
        mean = {k: float(np.mean([m[k] for m in values.values()])) for k in keys}
        window = int(max(m["dead_window"] for m in values.values()))
        massive = {} if left_out is None else {"massive_left_out": left_out[0],
                                               "massive_share": left_out[0] / max(left_out[1], 1)}
        self.last = {"step": step, "tokens": step * self.cfg.batch_tokens, **mean, "dead_window": window, **massive,
                     "tokens_per_s": (step - first) * self.cfg.batch_tokens / elapsed, "time": time.time(),
                     "tensors": values}
        self._since = (step, time.monotonic())
        self.file.append(self.last)
        if self.file.writer:
            print(f"step {step}/{self.cfg.steps}  fvu {mean['fvu']:.4f}  l0 {mean['l0']:.1f}  "
                  f"dead {mean['dead_fraction']:.1%} (none in {_tokens(window)})  aux {mean['aux_loss']:.3g}  "
                  + (f"left out {massive['massive_left_out']:,} ({massive['massive_share']:.2%}) over "
                     f"{self.ratio:g}x median  " if massive else "") +
                  f"{self.last['tokens_per_s']:,.0f} tokens/s" + (f"  eval fvu {mean['eval_fvu']:.4f} l0 "
                  f"{mean['eval_l0']:.1f} dead {mean['eval_dead_fraction']:.1%}" if held else ""), flush=True)


def _tokens(n: int) -> str:
    """4096 -> '4,096 tokens', 10,000,000 -> '10M tokens'."""
    return f"{n / 1e6:g}M tokens" if n >= 10**6 and n % 10**5 == 0 else f"{n:,} tokens"
