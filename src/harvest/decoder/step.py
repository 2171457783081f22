"""The training state and one jitted optimizer step over a global batch, sharded on the mesh.

State: fp32 master params (or `param_dtype`) and AdamW's moments, both split over (fsdp, model) by the
logical rules extraction uses; the batch split over (data, fsdp). The step casts params to the compute
dtype inside the loss, accumulates gradients over `grad_accum` micro-batches with a scan, and divides
by the whole batch's target count, so any accumulation or mesh gives the same update.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from harvest.model.attention import resolve
from harvest.model.config import ModelConfig
from harvest.model.init import param_shardings
from harvest.runtime.mesh import constrainer, logical_sharding
from harvest.decoder.loss import loss_sum, target_mask


def state_shardings(optimizer: optax.GradientTransformation, cfg: ModelConfig, mesh: Mesh, params_shape) -> dict:
    """Shardings of {step, params, opt_state}: moments like their params, scalars replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    by_param = param_shardings(cfg, mesh)
    opt_shape = jax.eval_shape(optimizer.init, params_shape)
    opt = optax.tree_map_params(optimizer, lambda _, sharding: sharding, opt_shape, by_param,
                                transform_non_params=lambda _: replicated)
    return {"step": replicated, "params": by_param, "opt_state": opt}


def batch_sharding(shape: tuple[int, int], mesh: Mesh) -> NamedSharding:
    return logical_sharding(shape, ("batch", None), mesh)


def init_state(params: dict, optimizer: optax.GradientTransformation, shardings: dict) -> dict:
    make = jax.jit(lambda p: {"step": jnp.zeros((), jnp.int32), "params": p, "opt_state": optimizer.init(p)},
                   out_shardings=shardings)
    return make(params)


def make_step(cfg: ModelConfig, mesh: Mesh, optimizer: optax.GradientTransformation, shardings: dict, *,
              compute_dtype, remat: str, grad_accum: int, batch_shape: tuple[int, int], lr_at,
              attention: str = "dense"):
    """jitted (state, tokens, segments) -> (state, metrics); the state is donated. `attention` names the
    implementation (model.attention.KINDS, resolved for this backend, model and mesh; a kind that cannot serve
    them is refused here, before anything is traced)."""
    constrain = constrainer(mesh)
    batch = batch_sharding(batch_shape, mesh)
    attention = resolve(attention, cfg.sliding_windows, batch_shape[1], backward=True,
                        softcap=cfg.attn_softcap)
    loss = partial(loss_sum, cfg=cfg, compute_dtype=compute_dtype, remat=remat, constrain=constrain,
                   attention=attention, mesh=mesh)

    def micro(x):
        # Micro-batch a takes rows a, a+A, ...: each device's contiguous rows split evenly, nothing moves.
        rows, seq = x.shape
        return x.reshape(rows // grad_accum, grad_accum, seq).swapaxes(0, 1)

    def step(state, tokens, segments):
        params = state["params"]
        count = jnp.maximum(jnp.sum(target_mask(segments)), 1).astype(jnp.float32)

        def accumulate(carry, mb):
            total, grads = carry
            value, g = jax.value_and_grad(loss)(params, *mb)
            return (total + value, jax.tree.map(jnp.add, grads, g)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        (total, grads), _ = jax.lax.scan(accumulate, (jnp.zeros((), jnp.float32), zeros),
                                         (micro(tokens), micro(segments)))
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        metrics = {"loss": total / count, "grad_norm": optax.tree.norm(grads), "lr": lr_at(state["step"]),
                   "tokens": jnp.sum(segments != 0)}
        return {"step": state["step"] + 1, "params": optax.apply_updates(params, updates),
                "opt_state": opt_state}, metrics

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(step, in_shardings=(shardings, batch, batch), out_shardings=(shardings, replicated),
                   donate_argnums=0)
