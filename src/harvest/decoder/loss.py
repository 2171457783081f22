"""Causal LM loss over packed rows: each token predicts the next one of its own sample only.

A row packs several samples (segment ids 1, 2, ...; 0 = padding). The target of position t is token
t+1 when both lie in the same sample; the last token of a sample, and padding, predict nothing. Sums
(not means) come back, so gradient accumulation and data-parallel shards add up to the loss of the
whole batch exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from harvest.model.config import ModelConfig
from harvest.model.transformer import logits


def target_mask(segment_ids: jax.Array) -> jax.Array:
    """[batch, seq-1] True where position t has a next token in its own sample."""
    return (segment_ids[:, 1:] == segment_ids[:, :-1]) & (segment_ids[:, 1:] != 0)


def loss_sum(params: dict, tokens: jax.Array, segment_ids: jax.Array, *, cfg: ModelConfig, compute_dtype,
             remat: str, constrain=None, attention: str = "dense", mesh=None) -> jax.Array:
    """Sum over the batch of next-token cross-entropy (fp32 softmax), over target_mask's positions."""
    out = logits(params, tokens, segment_ids, cfg=cfg, compute_dtype=compute_dtype, remat=remat,
                 constrain=constrain, attention=attention, mesh=mesh)[:, :-1].astype(jnp.float32)
    picked = jnp.take_along_axis(out, tokens[:, 1:, None], axis=-1)[..., 0]
    nll = jax.nn.logsumexp(out, axis=-1) - picked
    return jnp.sum(jnp.where(target_mask(segment_ids), nll, 0.0))
