"""`harvest sae train`: SAEs on a run's activations, a trainer on the runtime (harvest.training.run); a
checkpoint holds the params, Adam's state, the dead-latent counters and every reader's position."""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from harvest.config import stable_hash
from harvest.model import default_compute_dtype
from harvest.runtime.mesh import describe
from harvest.sae import data as D
from harvest.sae import model as M
from harvest.sae.config import SaeConfig
from harvest.sae.step import fresh_state, init_state, make_eval, make_optimizer, make_step, state_shardings
from harvest.storage import Storage
from harvest.training.checkpoint import Checkpoints, abstract
from harvest.training.record import RunRecord, SaeDetails, read_run
from harvest.training.trainer import Trainer

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


class SaeTrainer(Trainer):
    """One SAE a tensor, all trained in one pass over the runs' activations; the data position is every reader's,
    the state also holds the dead-latent counters. With --follow the readers follow runs still being written
    (harvest.read.rounds), one process reading, and the step reached is saved whenever a reader starts waiting."""

    kind, what, settings_what = "sae", "an SAE run", "the SAE training settings"

    def prepare(self, mesh, out: Storage) -> RunRecord:
        cfg = self.cfg
        self.steps, self.mesh, self.out, self.tensors = cfg.steps, mesh, out, list(cfg.tensor_names)
        self.follow = cfg.follow_poll if cfg.follow else None
        if self.follow and jax.process_count() > 1:
            raise D.SaeInputError(f"--follow reads the run with one process, and {jax.process_count()} were started: "
                                  "train on one host (its devices all on --mesh), or without --follow once the run is "
                                  "complete")
        self.inputs = inputs = D.open_inputs(cfg.runs, cfg.tensor_names, cfg.holdout_streams, cfg.seed, self.follow)
        self.specs = specs_of(cfg, inputs.widths)
        self.part = D.check_batch(cfg.batch_tokens, len(inputs.runs), mesh)
        self.scales = {t: float(np.sqrt(w / max(inputs.mean_square_norm(t), 1e-12)))
                       if cfg.normalize == "run-stats" else 1.0 for t, w in inputs.widths.items()}
        self.compute_dtype = cfg.compute_dtype or default_compute_dtype()
        self.ratio, self.medians = ratio, medians = _norm_rule(cfg, inputs, self.tensors, out)
        self.eval_rows = (D.held_out(inputs, self.tensors, self.part, mesh, cfg.seed, EVAL_BATCHES, cfg.skip_first,
                                     ratio, medians) if cfg.eval_every else None)
        saes = {t: {**s._asdict(), "scale": self.scales[t], "holdout_streams": inputs.holdout, "max_norm": ratio,
                    **({"median_norm": [m[t] for m in medians],
                        "norm_limit": [ratio * m[t] for m in medians]} if ratio else {})}
                for t, s in self.specs.items()}
        return RunRecord(self.kind, cfg.to_dict(),
                         {**cfg.run_settings(), "mesh": describe(mesh), "processes": jax.process_count()},
                         describe(mesh), stable_hash(cfg.shared_settings()), self.compute_dtype,
                         details=SaeDetails(saes))

    def agreed(self) -> dict[str, Any]:
        return {"median_norms": self.medians}

    def abstract_state(self):
        cfg, specs = self.cfg, self.specs
        self.optimizers = {t: make_optimizer(cfg.learning_rate(s.latents), cfg.warmup, self.steps, cfg.schedule)
                           for t, s in specs.items()}
        params_shape = {t: jax.eval_shape(lambda s=s: M.init_params(jax.random.key(0), s, jnp.zeros(s.width)))
                        for t, s in specs.items()}
        self.shardings = state_shardings(specs, self.optimizers, self.mesh, params_shape)
        state_shape = jax.eval_shape(lambda p: fresh_state(p, self.optimizers, specs), params_shape)
        return abstract(state_shape, self.shardings)

    def resume(self, state, data, checkpoints) -> int:
        cfg = self.cfg
        self.state = state  # None: no step ran and no checkpoint exists (the init needs a first batch)
        self.positions: list[dict] = []  # the readers' states after the last step: what a save while waiting holds

        def save_while_waiting() -> None:
            """--follow: a reader waits for shards; the step reached is saved, so a preemption meanwhile loses
            nothing."""
            if self.state is not None and int(self.state["step"]) not in checkpoints.steps():
                checkpoints.save(int(self.state["step"]), self.state, {"readers": [self.positions]}, force=True)

        self.batches = D.readers(self.inputs, self.tensors, self.part, self.mesh, cfg.seed, skip_first=cfg.skip_first,
                                 follow=self.follow, book=self.out.child(FOLLOW), on_wait=save_while_waiting,
                                 max_norm=self.ratio, medians=self.medians)
        if data is not None:
            for reader, position in zip(self.batches, data["readers"][jax.process_index()]):
                reader.load_state_dict(position)
        self.step_fn = make_step(self.specs, self.optimizers, self.shardings, self.mesh, dead_tokens=cfg.dead_tokens,
                                 scales=self.scales, compute_dtype=self.compute_dtype)
        self.evaluate = (make_eval(self.specs, self.shardings, self.mesh, scales=self.scales,
                                   compute_dtype=self.compute_dtype) if cfg.eval_every else None)
        return 0 if state is None else int(state["step"])

    def advance(self, step: int) -> dict:
        if self.follow:
            self.positions[:] = [b.state_dict() for b in self.batches]
        started = time.perf_counter()
        batch = D.next_batch(self.batches, self.tensors)
        waited = time.perf_counter()
        if self.state is None:
            self.state = _initial_state(self.cfg, self.specs, self.optimizers, self.shardings, batch, self.scales)
        self.state, metrics = self.step_fn(self.state, batch)
        profile = None
        if self.cfg.profile:  # the step waited for: (reader, step) seconds
            jax.block_until_ready(self.state)
            profile = (waited - started, time.perf_counter() - waited)
        held = (self.evaluate(self.state["params"], self.eval_rows)
                if self.evaluate and step % self.cfg.eval_every == 0 else None)
        return {"train": metrics, "held": held, "left_out": D.left_out(self.batches) if self.ratio else None,
                "profile": profile}

    def log_now(self, metrics: dict) -> bool:
        return metrics["held"] is not None

    def save(self, checkpoints: Checkpoints, step: int) -> None:
        if self.state is not None:
            checkpoints.save(step, self.state, {"readers": D.gather_states(self.batches)}, force=True)

    def record(self, step: int, metrics: list[dict], steps: int, seconds: float) -> dict[str, Any]:
        """Per tensor fvu, l0, dead_fraction, aux_loss (their mean over tensors at the top level) and tokens/s; at
        an evaluation (`eval_every`) also eval_fvu, eval_l0, eval_dead_fraction on the held-out rows."""
        now = metrics[-1]
        values = {t: {k: float(v) for k, v in m.items()} for t, m in now["train"].items()}
        for t, m in (now["held"] or {}).items():
            values[t].update({f"eval_{k}": float(v) for k, v in m.items()})
        keys = ("fvu", "l0", "dead_fraction", "aux_loss") + (EVAL_KEYS if now["held"] else ())
        mean = {k: float(np.mean([m[k] for m in values.values()])) for k in keys}
        window = int(max(m["dead_window"] for m in values.values()))
        left_out = now["left_out"]
        massive = {} if left_out is None else {"massive_left_out": left_out[0],
                                               "massive_share": left_out[0] / max(left_out[1], 1)}
        timed = [m["profile"] for m in metrics if m["profile"] is not None]
        profile = {} if not timed else {"reader_ms": 1e3 * float(np.mean([t[0] for t in timed])),
                                        "step_ms": 1e3 * float(np.mean([t[1] for t in timed]))}
        return {"step": step, "tokens": step * self.cfg.batch_tokens, **mean, "dead_window": window, **massive,
                "tokens_per_s": steps * self.cfg.batch_tokens / seconds, **profile, "time": time.time(),
                "tensors": values}

    def line(self, r: dict[str, Any]) -> str:
        left_out = (f"left out {r['massive_left_out']:,} ({r['massive_share']:.2%}) over {self.ratio:g}x median  "
                    if "massive_left_out" in r else "")
        profile = f"  reader {r['reader_ms']:.1f} ms/step, step {r['step_ms']:.1f} ms/step" if "step_ms" in r else ""
        held = (f"  eval fvu {r['eval_fvu']:.4f} l0 {r['eval_l0']:.1f} dead {r['eval_dead_fraction']:.1%}"
                if "eval_fvu" in r else "")
        return (f"step {r['step']}/{self.steps}  fvu {r['fvu']:.4f}  l0 {r['l0']:.1f}  "
                f"dead {r['dead_fraction']:.1%} (none in {_tokens(r['dead_window'])})  aux {r['aux_loss']:.3g}  "
                f"{left_out}{r['tokens_per_s']:,.0f} tokens/s{profile}{held}")

    def final(self, step: int, last: dict[str, Any]) -> tuple[dict[str, Any], str]:
        final = {"tokens": step * self.cfg.batch_tokens,
                 **{k: last.get(k) for k in ("fvu", "l0", "dead_fraction", "dead_window")},
                 **({"max_norm": self.ratio, "median_norm": self.medians,
                     "massive_left_out": last.get("massive_left_out"),
                     "massive_share": last.get("massive_share")} if self.ratio else {})}
        return final, f"fvu {final['fvu']}, l0 {final['l0']}, dead {final['dead_fraction']}"


def _norm_rule(cfg: SaeConfig, inputs: D.Inputs, tensors: list[str], out: Storage
               ) -> tuple[float, list[dict[str, float]]]:
    """--max-norm's R and, per run, {tensor: median token norm}: as the SAE run recorded them when it started (a
    resumed run keeps its limits, whatever was committed since; one started before the rule existed, none),
    else the config's R and the runs' own medians (a seeded sample)."""
    old = read_run(out, SaeTrainer.kind, SaeTrainer.what)
    saes = old.details.saes if old is not None else {}
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


def _tokens(n: int) -> str:
    """4096 -> '4,096 tokens', 10,000,000 -> '10M tokens'."""
    return f"{n / 1e6:g}M tokens" if n >= 10**6 and n % 10**5 == 0 else f"{n:,} tokens"
