"""Each packed piece's mean and M2 per dimension, computed on device beside its captures.

The sidecar's per-shard stats are float64 merges of its pieces' moments (store.stats.RunningStats.of_pieces):
the device reduces a row's tokens to one (mean, M2) per piece, so the host merges a few vectors per piece
instead of passing over every captured value twice (exact float64 on the host cost more CPU per GB than
hashing and writing together). A row's first `samples` samples (segment ids 1..samples, in row order) get device
moments; the host computes any further piece's own, from its values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Pieces per row with device moments: rows of short samples hold ~10-30 (lognormal text ~7 in 2048, ARC 1-2).
# Each costs a row 2 x 4 x width bytes per captured layer more to copy to the host (at 2048 tokens of
# bf16, 6%); a row's further pieces cost the host their own pass.
SLOTS = 32


def piece_moments(values: jax.Array, segment_ids: jax.Array, samples: int) -> tuple[jax.Array, jax.Array]:
    """values [layers, batch, seq, width] (as stored), segment_ids [batch, seq] (0: padding) -> (mean, M2), each
    float32 [layers, batch, samples, width]: [:, :, k] is segment k+1's (zeros where a row has fewer samples).
    Two passes (the mean, then squares around it) with float32 sums over one piece's tokens; the reductions are
    one-hot matmuls at full precision (no bf16 or tf32 passes on TPU or GPU)."""
    one_hot = (segment_ids[:, :, None] == jnp.arange(1, samples + 1, dtype=segment_ids.dtype)).astype(jnp.float32)
    counts = one_hot.sum(axis=1)  # [batch, samples]
    x = values.astype(jnp.float32)
    dot = jax.lax.Precision.HIGHEST
    sums = jnp.einsum("bsk,lbsw->lbkw", one_hot, x, precision=dot)
    mean = sums / jnp.maximum(counts, 1.0)[None, :, :, None]
    centered = x - jnp.einsum("bsk,lbkw->lbsw", one_hot, mean, precision=dot)
    return mean, jnp.einsum("bsk,lbsw->lbkw", one_hot, jnp.square(centered), precision=dot)
