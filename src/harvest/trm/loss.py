"""TRM's losses: stablemax cross-entropy on the answer tokens and the halting head's binary cross-entropy
against "the whole answer is right", summed over the batch as the reference does (the step divides by the
global batch size).

Stablemax (Prieto et al. 2025, "Grokking at the edge of numerical stability") replaces exp with
s(x) = x + 1 for x >= 0 and 1 / (1 - x) for x < 0: p_i = s(x_i) / sum_j s(x_j).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _s(x: jax.Array) -> jax.Array:
    return jnp.where(x < 0, 1.0 / (1.0 - jnp.minimum(x, 0.0)), x + 1.0)


def log_stablemax(logits: jax.Array) -> jax.Array:
    s = _s(logits.astype(jnp.float32))
    return jnp.log(s) - jnp.log(jnp.sum(s, axis=-1, keepdims=True))


def stablemax_cross_entropy(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
    """-log p_label per position [B, S]; 0 where mask is False."""
    logp = jnp.take_along_axis(log_stablemax(logits), labels.astype(jnp.int32)[..., None], axis=-1)[..., 0]
    return jnp.where(mask, -logp, 0.0)


def halt_target(logits: jax.Array, labels: jax.Array, mask: jax.Array) -> jax.Array:
    """Per sample: every counted position predicted right (argmax). The Q head learns to predict this."""
    right = (jnp.argmax(logits, axis=-1) == labels) | ~mask
    return jnp.all(right, axis=-1)


def halt_bce(q_halt: jax.Array, target: jax.Array) -> jax.Array:
    """Binary cross-entropy with logits, per sample."""
    return jnp.logaddexp(0.0, q_halt) - q_halt * target.astype(jnp.float32)


def label_mask(labels: jax.Array, ignore_label_id: int | None) -> jax.Array:
    return jnp.ones(labels.shape, bool) if ignore_label_id is None else labels != ignore_label_id


def act_loss(logits: jax.Array, q_halt: jax.Array, labels: jax.Array, ignore_label_id: int | None):
    """(loss summed over the batch, parts): each sample's token loss is averaged over its counted positions;
    loss = lm + 0.5 * halt. Parts: lm_loss, halt_loss (sums) and per-sample `correct` (the halting target)."""
    mask = label_mask(labels, ignore_label_id)
    counts = jnp.maximum(jnp.sum(mask, axis=-1), 1)
    lm = jnp.sum(jnp.sum(stablemax_cross_entropy(logits, labels, mask), axis=-1) / counts)
    correct = jax.lax.stop_gradient(halt_target(logits, labels, mask))
    halt = jnp.sum(halt_bce(q_halt, correct))
    return lm + 0.5 * halt, {"lm_loss": lm, "halt_loss": halt, "correct": correct, "mask": mask}
