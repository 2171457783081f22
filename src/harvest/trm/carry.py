"""Deep supervision's carry: each batch slot holds one sample for up to halt_max_steps training steps.

A slot keeps its sample, its (y, z) and its step count across steps; when it halts, the next step gives it the
sample the new batch has in that slot, a fresh (y, z) and step 0 (the new batch's other samples are not used,
as in the reference). Training halts a sample when the Q head says its answer is right (q_halt > 0) or at
halt_max_steps; with probability halt_exploration_prob a sample must first reach a random 2..halt_max_steps
steps. Evaluation always runs halt_max_steps steps, so a batch finishes together.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from harvest.trm.hparams import TrmConfig

DATA = ("inputs", "labels", "puzzle_identifiers")


def empty_carry(cfg: TrmConfig, batch_size: int) -> dict:
    """Every slot halted, so the first step takes the whole batch."""
    shape = (batch_size, cfg.total_len, cfg.hidden)
    return {"y": jnp.zeros(shape, jnp.float32), "z": jnp.zeros(shape, jnp.float32),
            "steps": jnp.zeros((batch_size,), jnp.int32), "halted": jnp.ones((batch_size,), bool),
            "inputs": jnp.zeros((batch_size, cfg.seq_len), jnp.uint8),
            "labels": jnp.zeros((batch_size, cfg.seq_len), jnp.uint8),
            "puzzle_identifiers": jnp.zeros((batch_size,), jnp.int32)}


def reset(carry: dict, batch: dict, states: dict) -> dict:
    """Halted slots take the batch's sample, y and z from `states` (init_states) and step 0."""
    halted = carry["halted"]

    def pick(new, old):
        return jnp.where(halted.reshape((-1,) + (1,) * (old.ndim - 1)), new.astype(old.dtype), old)

    out = {k: pick(batch[k], carry[k]) for k in DATA}
    out["y"] = pick(states["y"], carry["y"])
    out["z"] = pick(states["z"], carry["z"])
    out["steps"] = jnp.where(halted, 0, carry["steps"])
    out["halted"] = halted
    return out


def halt(cfg: TrmConfig, steps: jax.Array, q_halt: jax.Array, key: jax.Array | None) -> jax.Array:
    """Which samples stop after this step (`steps` counts it). key None: evaluation (only at the limit)."""
    halted = steps >= cfg.halt_max_steps
    if key is None or cfg.halt_max_steps == 1:
        return halted
    explore_key, length_key = jax.random.split(key)
    explore = jax.random.uniform(explore_key, steps.shape) < cfg.halt_exploration_prob
    min_steps = jnp.where(explore, jax.random.randint(length_key, steps.shape, 2, cfg.halt_max_steps + 1), 0)
    return (halted | (q_halt > 0)) & (steps >= min_steps)
