"""TRM's optimizers: AdamATan2 for the weights (optax has none; this is the reference's adam-atan2 package's
rule as an optax GradientTransformation), sign-SGD for the puzzle embeddings a batch uses, the weights' EMA,
and the reference's schedule (linear warmup, then constant).

AdamATan2 (Everett et al. 2024, "Scaling Exponents Across Parameterizations and Optimizers") replaces Adam's
m / (sqrt(v) + eps) by atan2(m, sqrt(v)), which is bounded and needs no epsilon. With bias corrections
c1 = 1 - b1^t, c2 = 1 - b2^t and decoupled weight decay:
    p <- p (1 - lr wd) - (lr / c1) atan2(m, sqrt(v) / sqrt(c2)).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from harvest.trm.hparams import TrmOptim


def warmup_then_constant(peak: float, warmup: int) -> Callable:
    """step (0-based) -> lr: peak x (step + 1) / warmup during warmup (the first step already moves), then peak."""
    return lambda step: peak * jnp.minimum(1.0, (jnp.asarray(step, jnp.float32) + 1) / max(warmup, 1))


class AdamAtan2State(NamedTuple):
    count: jax.Array
    mu: optax.Updates
    nu: optax.Updates


def adam_atan2(learning_rate: float | Callable, b1: float = 0.9, b2: float = 0.95,
               weight_decay: float = 0.0) -> optax.GradientTransformation:
    """The update to add to params (optax.apply_updates). learning_rate: a float or step (0-based) -> lr."""
    lr_at = learning_rate if callable(learning_rate) else (lambda _: learning_rate)

    def init(params):
        zeros = jax.tree.map(jnp.zeros_like, params)
        return AdamAtan2State(jnp.zeros((), jnp.int32), zeros, jax.tree.map(jnp.zeros_like, params))

    def update(grads, state, params):
        count = state.count + 1
        mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
        nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
        t = count.astype(jnp.float32)
        lr = lr_at(state.count)
        step_size = lr / (1 - b1 ** t)
        root_c2 = jnp.sqrt(1 - b2 ** t)
        updates = jax.tree.map(
            lambda p, m, v: -lr * weight_decay * p - step_size * jnp.arctan2(m, jnp.sqrt(v) / root_c2),
            params, mu, nu)
        return updates, AdamAtan2State(count, mu, nu)

    return optax.GradientTransformation(init, update)


def make_weights_optimizer(optim: TrmOptim) -> optax.GradientTransformation:
    return adam_atan2(warmup_then_constant(optim.lr, optim.warmup), optim.b1, optim.b2, optim.weight_decay)


def sparse_sign_sgd(table: jax.Array, ids: jax.Array, row_grads: jax.Array, lr, weight_decay: float) -> jax.Array:
    """The puzzle-embedding step: for each id in the batch, its rows' gradients summed (an id may appear
    several times), then row <- row (1 - lr wd) - lr sign(summed gradient). Rows of ids not in the batch are
    untouched. The B x B same-id matrix sums duplicates with fixed shapes (B is the global batch)."""
    same = (ids[:, None] == ids[None, :]).astype(row_grads.dtype)
    summed = same @ row_grads
    rows = table[ids] * (1 - lr * weight_decay) - lr * jnp.sign(summed)
    return table.at[ids].set(rows.astype(table.dtype))


def ema_update(ema: dict, params: dict, rate: float) -> dict:
    """ema <- rate ema + (1 - rate) params (the reference's EMAHelper, started from the initial weights)."""
    return jax.tree.map(lambda e, p: rate * e + (1 - rate) * p, ema, params)
