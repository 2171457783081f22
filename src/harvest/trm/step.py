"""The TRM training state, one jitted deep-supervision training step, and evaluation.

State: {step, params (AdamATan2), opt_state, ema (the weights' EMA, when on), puzzle_emb (the sign-SGD table),
states (the fixed starting y, z), key}. Small enough to replicate on every device; the batch and the carry
are split over the mesh's data axes (data x fsdp), as the decoder trainer splits its batch. One step is one
supervision step of every slot (see carry.py); its gradients are the batch mean, so any mesh gives the same
update.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from harvest.runtime.mesh import logical_sharding
from harvest.trm.carry import empty_carry, halt, reset
from harvest.trm.hparams import TrmConfig, TrmOptim
from harvest.trm.loss import act_loss
from harvest.trm.model import forward, init_params, init_puzzle_table, init_states
from harvest.trm.optim import ema_update, make_weights_optimizer, sparse_sign_sgd, warmup_then_constant


def init_state(cfg: TrmConfig, optim: TrmOptim, seed: int) -> dict:
    k_params, k_states, k_run = jax.random.split(jax.random.key(seed), 3)
    params = init_params(cfg, k_params)
    state = {"step": jnp.zeros((), jnp.int32), "params": params,
             "opt_state": make_weights_optimizer(optim).init(params),
             "puzzle_emb": init_puzzle_table(cfg), "states": init_states(cfg, k_states),
             "key": jax.random.key_data(k_run)}
    if optim.ema_rate is not None:
        state["ema"] = jax.tree.map(jnp.copy, params)  # its own buffers: the step donates the state
    return state


def batch_shardings(tree, mesh: Mesh):
    """Every array split on its first (batch) dim over the data axes, where they divide it."""
    return jax.tree.map(lambda x: logical_sharding(x.shape, ("batch",) + (None,) * (x.ndim - 1), mesh), tree)


def replicated(tree, mesh: Mesh):
    return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), tree)


def _puzzle_rows(cfg: TrmConfig, table: jax.Array, ids: jax.Array) -> jax.Array:
    return table[ids] if cfg.prefix_len else jnp.zeros((ids.shape[0], 0), jnp.float32)


def _metrics(carry: dict, halted: jax.Array, parts: dict, q_halt: jax.Array, logits: jax.Array, batch_size: int):
    """The reference's train metrics: losses per sample of the batch; the rest over the samples that halted."""
    mask = parts["mask"]
    done = halted & jnp.any(mask, axis=-1)
    count = jnp.sum(done)
    per = jnp.maximum(count, 1).astype(jnp.float32)
    token_acc = jnp.sum((jnp.argmax(logits, -1) == carry["labels"]) & mask, -1) / jnp.maximum(jnp.sum(mask, -1), 1)
    return {"lm_loss": parts["lm_loss"] / batch_size, "halt_loss": parts["halt_loss"] / batch_size,
            "count": count,
            "accuracy": jnp.sum(jnp.where(done, token_acc, 0.0)) / per,
            "exact_accuracy": jnp.sum(done & parts["correct"]) / per,
            "q_halt_accuracy": jnp.sum(done & ((q_halt >= 0) == parts["correct"])) / per,
            "steps": jnp.sum(jnp.where(done, carry["steps"], 0)) / per}


def train_step_fn(cfg: TrmConfig, optim: TrmOptim):
    """(state, carry, batch) -> (state, carry, metrics), not jitted. batch: inputs, labels [B, seq_len],
    puzzle_identifiers [B]; the carry from empty_carry(cfg, B) or the previous step."""
    weights_opt = make_weights_optimizer(optim)
    lr_at = warmup_then_constant(optim.lr, optim.warmup)
    puzzle_lr_at = warmup_then_constant(optim.puzzle_emb_lr, optim.warmup)

    def step(state, carry, batch):
        carry = reset(carry, batch, state["states"])
        b = carry["inputs"].shape[0]
        ids = carry["puzzle_identifiers"]

        def loss(params, rows):
            (y, z), logits, q_halt = forward(cfg, params, rows, carry["inputs"], carry["y"], carry["z"])
            total, parts = act_loss(logits, q_halt, carry["labels"], cfg.ignore_label_id)
            return total / b, (y, z, logits, q_halt, parts)

        rows = _puzzle_rows(cfg, state["puzzle_emb"], ids)
        (value, (y, z, logits, q_halt, parts)), (g_params, g_rows) = jax.value_and_grad(
            loss, argnums=(0, 1), has_aux=True)(state["params"], rows)
        updates, opt_state = weights_opt.update(g_params, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        new = {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}
        if cfg.prefix_len:
            new["puzzle_emb"] = sparse_sign_sgd(state["puzzle_emb"], ids, g_rows, puzzle_lr_at(state["step"]),
                                                optim.puzzle_emb_weight_decay)
        if "ema" in state:
            new["ema"] = ema_update(state["ema"], params, optim.ema_rate)

        steps = carry["steps"] + 1
        key = jax.random.fold_in(jax.random.wrap_key_data(state["key"]), state["step"])
        halted = halt(cfg, steps, jax.lax.stop_gradient(q_halt), key)
        carry = {**carry, "y": y.astype(carry["y"].dtype), "z": z.astype(carry["z"].dtype), "steps": steps,
                 "halted": halted}
        metrics = {"loss": value, "lr": lr_at(state["step"]),
                   **_metrics(carry, halted, parts, q_halt, logits, b)}
        return new, carry, metrics

    return step


def make_train_step(cfg: TrmConfig, optim: TrmOptim, mesh: Mesh, state: dict, batch_size: int):
    """The jitted step on `mesh`: state replicated and donated, carry and batch split over the data axes."""
    carry = jax.eval_shape(lambda: empty_carry(cfg, batch_size))
    batch = {k: carry[k] for k in ("inputs", "labels", "puzzle_identifiers")}
    state_sh, carry_sh, batch_sh = replicated(state, mesh), batch_shardings(carry, mesh), batch_shardings(batch, mesh)
    metrics_sh = NamedSharding(mesh, PartitionSpec())
    return jax.jit(train_step_fn(cfg, optim), in_shardings=(state_sh, carry_sh, batch_sh),
                   out_shardings=(state_sh, carry_sh, metrics_sh), donate_argnums=(0, 1))


def predict_fn(cfg: TrmConfig):
    """(params, puzzle_emb, states, batch) -> {preds [B, seq_len], q_halt [B]} after halt_max_steps
    supervision steps from a fresh carry (evaluation halts nobody early). Pass the EMA as params to evaluate
    it, as the reference does."""

    def predict(params, puzzle_emb, states, batch):
        carry = reset(empty_carry(cfg, batch["inputs"].shape[0]), batch, states)
        rows = _puzzle_rows(cfg, puzzle_emb, carry["puzzle_identifiers"])

        def one(_, yz):
            (y, z), _, _ = forward(cfg, params, rows, carry["inputs"], *yz)
            return y.astype(jnp.float32), z.astype(jnp.float32)

        y, z = jax.lax.fori_loop(0, cfg.halt_max_steps - 1, one, (carry["y"], carry["z"]))
        _, logits, q_halt = forward(cfg, params, rows, carry["inputs"], y, z)
        return {"preds": jnp.argmax(logits, -1).astype(jnp.int32), "q_halt": q_halt}

    return predict
