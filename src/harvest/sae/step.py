"""The SAE training state and one jitted step over a global batch, latents sharded over `model`.

State: {step, params: {tensor: params}, opt_state: {tensor: Adam's}, idle: {tensor: tokens since each latent
last fired, [L] int32}}. A batchtopk SAE's inference threshold is a param the step sets, not Adam. Every
array with a latent dimension is split over the mesh's `model` axis; the batch over (data, fsdp). One step
trains every SAE on its tensor's rows (sums of independent losses: one pass over the data for all of them).
The evaluation (--eval-every) runs the same SAEs at inference over held-out rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from harvest.sae import cpu_kernels
from harvest.sae import model as M
from harvest.sae.topk import DATA_AXES

IDLE_CAP = 2**30  # tokens since firing saturate here (int32)


def learning_rate(peak: float, warmup: int, steps: int, schedule: str):
    """sparsify's adam schedule: lr rises linearly from 0 over `warmup` steps (the first update is 0), then
    falls linearly to 0 at `steps` (or cosine, or stays)."""

    def lr(count):
        count = jnp.asarray(count, jnp.float32)
        warm = count / max(warmup, 1)
        done = jnp.clip((count - warmup) / max(steps - warmup, 1), 0.0, 1.0)
        after = {"linear": 1.0 - done, "cosine": 0.5 * (1 + jnp.cos(math.pi * done)),
                 "constant": jnp.ones_like(done)}[schedule]
        return peak * jnp.where(count < warmup, warm, after)

    return lr


def make_optimizer(peak: float, warmup: int, steps: int, schedule: str) -> optax.GradientTransformation:
    """Adam as torch's (betas 0.9, 0.999, eps 1e-8 added to sqrt(v_hat))."""
    return optax.adam(learning_rate(peak, warmup, steps, schedule), b1=0.9, b2=0.999, eps=1e-8)


def param_specs(spec: M.Spec) -> dict[str, PartitionSpec]:
    out = {"W_enc": PartitionSpec(None, "model"), "b_enc": PartitionSpec("model"),
           "W_dec": PartitionSpec("model", None), "b_dec": PartitionSpec()}
    if spec.architecture == "jumprelu":
        out["log_threshold"] = PartitionSpec("model")
    if spec.architecture == "batchtopk":
        out["threshold"] = PartitionSpec()
    return out


def state_shardings(specs: dict[str, M.Spec], optimizers: dict[str, optax.GradientTransformation], mesh: Mesh,
                    params_shape: dict) -> dict:
    """Shardings of the state: latents over `model` (where it divides them), scalars replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())

    def named(spec: PartitionSpec, shape) -> NamedSharding:
        fits = all(axis is None or dim % mesh.shape[axis] == 0 for dim, axis in zip(shape.shape, spec))
        return NamedSharding(mesh, spec if fits else PartitionSpec())

    params, opt, idle = {}, {}, {}
    for name, spec in specs.items():
        params[name] = {k: named(p, params_shape[name][k]) for k, p in param_specs(spec).items()}
        opt_shape = jax.eval_shape(optimizers[name].init, params_shape[name])
        opt[name] = optax.tree_map_params(optimizers[name], lambda _, s: s, opt_shape, params[name],
                                          transform_non_params=lambda _: replicated)
        idle[name] = named(PartitionSpec("model"), jax.ShapeDtypeStruct((spec.latents,), jnp.int32))
    return {"step": replicated, "params": params, "opt_state": opt, "idle": idle}


def fresh_state(params: dict, optimizers: dict, specs: dict[str, M.Spec]) -> dict:
    return {"step": jnp.zeros((), jnp.int32), "params": params,
            "opt_state": {n: optimizers[n].init(params[n]) for n in specs},
            "idle": {n: jnp.zeros(s.latents, jnp.int32) for n, s in specs.items()}}


def init_state(params: dict, optimizers: dict, specs: dict[str, M.Spec], shardings: dict) -> dict:
    return jax.jit(lambda p: fresh_state(p, optimizers, specs), out_shardings=shardings)(params)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(DATA_AXES))


def make_step(specs: dict[str, M.Spec], optimizers: dict, shardings: dict, mesh: Mesh, *, dead_tokens: int,
              scales: dict[str, float], compute_dtype: str):
    """jitted (state, {tensor: [B, d] rows}) -> (state, metrics); the state is donated. `scales` multiply
    the rows first (normalize: run-stats). With latents over `model` (> 1), the masked dense formulation
    with the two-stage top-k (sae/topk.py); else topk's sparse one, through sae/cpu_kernels on CPUs."""
    sharded = mesh if mesh.shape["model"] > 1 else None
    dtype = jnp.dtype(compute_dtype)
    kernels = mesh if cpu_kernels.usable(mesh, dtype) else None

    def one(name: str, spec: M.Spec, state: dict, x: jax.Array):
        params, idle = state["params"][name], state["idle"][name]
        x = x.astype(jnp.float32) * scales[name]
        dead = idle >= dead_tokens

        def objective(p):
            p = jax.tree.map(lambda a: a.astype(dtype), p)
            value, metrics = M.loss(p, x.astype(dtype), spec, dead, sharded, kernels)
            return value.astype(jnp.float32), metrics

        (_, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params)
        if spec.architecture in M.UNIT_DECODER:
            grads["W_dec"] = M.without_parallel_part(grads["W_dec"], params["W_dec"])
        updates, opt_state = optimizers[name].update(grads, state["opt_state"][name], params)
        params = optax.apply_updates(params, updates)
        if spec.architecture in M.UNIT_DECODER:
            params["W_dec"] = M.unit_rows(params["W_dec"])
        idle = jnp.where(metrics.pop("fired"), 0, jnp.minimum(idle + x.shape[0], IDLE_CAP))
        if "min_active" in metrics:  # batchtopk: a running mean of the smallest value that fired
            smallest = metrics.pop("min_active")
            params["threshold"] = jnp.where(state["step"] == 0, smallest, 0.99 * params["threshold"] + 0.01 * smallest)
        # dead: fired on none of the last W tokens, W = dead_tokens or every token trained while fewer (idle counts
        # from the first step: a latent that never fired has idle = the tokens trained); `sae eval` counts the same
        # over the tokens it reads
        cap = min(dead_tokens, IDLE_CAP)
        window = jnp.minimum(jnp.minimum(state["step"] + 1, cap // x.shape[0] + 1) * x.shape[0], cap)
        metrics["dead_fraction"] = jnp.mean((idle >= window).astype(jnp.float32))
        metrics["dead_window"] = window
        return params, opt_state, idle, metrics

    def step(state, batch):
        new = {"step": state["step"] + 1, "params": {}, "opt_state": {}, "idle": {}}
        metrics = {}
        for name, spec in specs.items():
            new["params"][name], new["opt_state"][name], new["idle"][name], metrics[name] = one(name, spec, state,
                                                                                                 batch[name])
        return new, metrics

    replicated = NamedSharding(mesh, PartitionSpec())
    rows = batch_sharding(mesh)
    return jax.jit(step, in_shardings=(shardings, {n: rows for n in specs}), out_shardings=(shardings, replicated),
                   donate_argnums=0)


def make_eval(specs: dict[str, M.Spec], shardings: dict, mesh: Mesh, *, scales: dict[str, float], compute_dtype: str):
    """jitted (params, {tensor: [n, B, d] rows}) -> {tensor: {fvu, l0, dead_fraction}} at inference over all
    n x B rows (dead: never fired on them), a batch at a time; latents over `model` as in the step."""
    dtype = jnp.dtype(compute_dtype)
    sharded = mesh if mesh.shape["model"] > 1 else None

    def one(spec: M.Spec, params: dict, rows: jax.Array, scale: float) -> dict:
        params = jax.tree.map(lambda a: a.astype(dtype), params)

        def add(totals, x):
            x = x.astype(jnp.float32) * scale
            latents = M.encode(params, x.astype(dtype), spec, inference=True, mesh=sharded)
            out = M.decode(params, latents).astype(jnp.float32)
            error, active, fired = totals
            return (error + jnp.sum(jnp.square(x - out)), active + jnp.sum(latents > 0),
                    fired | jnp.any(latents > 0, axis=0)), None

        start = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), jnp.zeros(spec.latents, bool))
        error, active, fired = jax.lax.scan(add, start, rows)[0]
        count = rows.shape[0] * rows.shape[1]
        return {"fvu": error / M.total_variance(rows.reshape(count, -1).astype(jnp.float32) * scale),
                "l0": active / count, "dead_fraction": 1 - jnp.mean(fired.astype(jnp.float32))}

    def evaluate(params, rows):
        return {name: one(spec, params[name], rows[name], scales[name]) for name, spec in specs.items()}

    stacked = NamedSharding(mesh, PartitionSpec(None, DATA_AXES))
    return jax.jit(evaluate, in_shardings=(shardings["params"], {n: stacked for n in specs}),
                   out_shardings=NamedSharding(mesh, PartitionSpec()))
