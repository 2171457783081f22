"""AdamW with warmup, a decay schedule and global-norm clipping (optax). Accumulation happens in the
step (decoder/step.py), so one optimizer update is one training step and the schedule counts steps."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from harvest.decoder.config import TrainConfig


def learning_rate(cfg: TrainConfig):
    """step -> lr: linear warmup to `lr` over `warmup` steps (the first step already moves), then cosine or
    linear decay to lr * min_lr_ratio at `steps`, or constant."""
    peak, floor = cfg.lr, cfg.lr * cfg.min_lr_ratio
    decay_steps = max(cfg.steps - cfg.warmup, 1)

    def lr(step):
        step = jnp.asarray(step, jnp.float32)
        warm = peak * jnp.minimum(1.0, (step + 1) / max(cfg.warmup, 1))
        done = jnp.clip((step - cfg.warmup) / decay_steps, 0.0, 1.0)
        if cfg.schedule == "cosine":
            after = floor + (peak - floor) * 0.5 * (1 + jnp.cos(math.pi * done))
        elif cfg.schedule == "linear":
            after = peak + (floor - peak) * done
        else:
            after = jnp.asarray(peak, jnp.float32)
        return jnp.where(step < cfg.warmup, warm, after)

    return lr


def decay_mask(params: dict) -> dict:
    """Weight decay on matrices only: norms and biases keep their values."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: not str(path[-1].key).endswith(("norm", "bias")), params)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    adamw = optax.adamw(learning_rate(cfg), b1=cfg.b1, b2=cfg.b2, eps=1e-8, weight_decay=cfg.weight_decay,
                        mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip), adamw) if cfg.grad_clip > 0 else adamw
