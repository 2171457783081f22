"""TRM's forward pass: one supervision step of recursive reasoning, and the carry that deep supervision keeps
between steps.

The paper's x, y, z are here the embedded input, the answer state y (the reference's z_H) and the latent z
(its z_L). One supervision step runs H_cycles times: L_cycles updates z <- net(z, y + x), then y <- net(y, z).
All but the last H cycle run on stop_gradient'ed weights and inputs, so no gradient flows through them and
autodiff stores nothing for them; the returned y, z are cut from the graph (the next step starts from values).
Logits come from y's grid positions, the halting logit from y's first position.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from harvest.trm.hparams import TrmConfig
from harvest.trm.layers import block, dense, init_block, rope_tables, trunc_normal


def init_params(cfg: TrmConfig, key: jax.Array) -> dict:
    """The trained weights (AdamATan2 moves them; the puzzle embeddings are a separate table)."""
    keys = jax.random.split(key, 4 + cfg.L_layers)
    embed_std = 1.0 / math.sqrt(cfg.hidden)
    params = {
        "embed": trunc_normal(keys[0], (cfg.vocab_size, cfg.hidden), embed_std),
        "lm_head": dense(keys[1], cfg.hidden, cfg.vocab_size),
        # Q head near zero with a -5 bias: every sample starts out "continue" (the reference's bootstrapping).
        # Only the halt logit: the reference's "continue" logit is unused with its no_ACT_continue default.
        "q_head": {"w": jnp.zeros((cfg.hidden, 1), jnp.float32), "b": jnp.full((1,), -5.0, jnp.float32)},
        "blocks": [init_block(k, cfg) for k in keys[4:]],
    }
    if cfg.pos_encodings == "learned":
        params["pos"] = trunc_normal(keys[2], (cfg.total_len, cfg.hidden), embed_std)
    return params


def init_states(cfg: TrmConfig, key: jax.Array) -> dict:
    """The fixed starting y and z of every sample (random, never trained: the reference's H_init, L_init)."""
    ky, kz = jax.random.split(key)
    return {"y": trunc_normal(ky, (cfg.hidden,), 1.0), "z": trunc_normal(kz, (cfg.hidden,), 1.0)}


def init_puzzle_table(cfg: TrmConfig) -> jax.Array:
    """Puzzle embeddings start at zero; sign-SGD moves the rows a batch uses."""
    return jnp.zeros((cfg.num_puzzle_identifiers, cfg.puzzle_emb_ndim), jnp.float32)


def embed(cfg: TrmConfig, params: dict, inputs: jax.Array, puzzle_rows: jax.Array) -> jax.Array:
    """x [B, total_len, hidden]: the puzzle embedding as prefix tokens (zero-padded to prefix_len x hidden),
    then the tokens; learned positions averaged in (x 1/sqrt 2); everything scaled by sqrt(hidden)."""
    dtype = jnp.dtype(cfg.compute_dtype)
    x = params["embed"].astype(dtype)[inputs.astype(jnp.int32)]
    if cfg.prefix_len:
        b = inputs.shape[0]
        rows = puzzle_rows.astype(dtype)
        rows = jnp.pad(rows, ((0, 0), (0, cfg.prefix_len * cfg.hidden - cfg.puzzle_emb_ndim)))
        x = jnp.concatenate([rows.reshape(b, cfg.prefix_len, cfg.hidden), x], axis=1)
    if cfg.pos_encodings == "learned":
        x = (x + params["pos"].astype(dtype)) / math.sqrt(2)
    return x * math.sqrt(cfg.hidden)


def net(cfg: TrmConfig, params: dict, h: jax.Array, injection: jax.Array, rope) -> jax.Array:
    """The one network every update uses: the injection added to the state, then the blocks."""
    h = h + injection
    for p in params["blocks"]:
        h = block(p, h, cfg, rope)
    return h


def latent_recursion(cfg: TrmConfig, params: dict, x: jax.Array, y: jax.Array, z: jax.Array, rope):
    """One H cycle: L_cycles updates of z from (y + x), then one update of y from z."""
    z = jax.lax.fori_loop(0, cfg.L_cycles, lambda _, z: net(cfg, params, z, y + x, rope), z)
    return net(cfg, params, y, z, rope), z


def deep_recursion(cfg: TrmConfig, params: dict, x: jax.Array, y: jax.Array, z: jax.Array):
    """H_cycles - 1 cycles without gradient, then one with: (y, z) after the step."""
    rope = rope_tables(cfg)
    frozen, x_frozen = jax.lax.stop_gradient(params), jax.lax.stop_gradient(x)
    y, z = jax.lax.stop_gradient((y, z))
    y, z = jax.lax.fori_loop(0, cfg.H_cycles - 1,
                             lambda _, yz: latent_recursion(cfg, frozen, x_frozen, *yz, rope), (y, z))
    return latent_recursion(cfg, params, x, y, z, rope)


def heads(cfg: TrmConfig, params: dict, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [B, seq_len, vocab] (float32) of the grid positions; q_halt [B] from the first position."""
    logits = (y[:, cfg.prefix_len:] @ params["lm_head"].astype(y.dtype)).astype(jnp.float32)
    q = y[:, 0].astype(jnp.float32) @ params["q_head"]["w"] + params["q_head"]["b"]
    return logits, q[:, 0]


def forward(cfg: TrmConfig, params: dict, puzzle_rows: jax.Array, inputs: jax.Array, y: jax.Array, z: jax.Array):
    """One supervision step: ((y, z) to carry, without gradient), logits, q_halt logits."""
    x = embed(cfg, params, inputs, puzzle_rows)
    y, z = deep_recursion(cfg, params, x, y.astype(x.dtype), z.astype(x.dtype))
    logits, q_halt = heads(cfg, params, y)
    return jax.lax.stop_gradient((y, z)), logits, q_halt
