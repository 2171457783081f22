"""Which (query block, key block) pairs of a packed batch can see each other: the index side of
block-sparse attention.

A row of 1024 tokens holding 16 short samples needs ~sum(len_i^2) attention scores, not 1024^2. Cut each
row into blocks of `block` tokens; a query block needs the key blocks from the start of the segment its
first query belongs to up to itself (padding queries: only their own block). The pairs are listed from the
segment ids inside the jitted program (no per-token loop), row by row, each query block's keys in order,
then padded to one length per batch shape (the causal triangle of every row), so that a run compiles once;
the attention loops over the real pairs only. Padding pairs point at the query block `rows * blocks_per_row`,
past the last real one.

A row's pairs depend on that row alone, and the attention folds them in the listed order: a row rounds
the same way whatever rows share its batch (resume re-batches rows and must repeat bit for bit).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 64  # tokens per block: measured against 32 and 128 on CPU (8 x 1024 rows of 15-720-token samples)


def block_len(seq: int) -> int:
    """Block length for rows of `seq` tokens: BLOCK, or the whole row when seq is not a multiple of it."""
    return BLOCK if seq % BLOCK == 0 else seq


def block_pairs(segment_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(query block, key block) flat indices [P] int32 (row * blocks_per_row + block). P is the same for every
    batch of this shape (the causal triangle of every row): one compiled shape."""
    segment_ids = jnp.asarray(segment_ids)
    rows, seq = segment_ids.shape
    block = block_len(seq)
    n = seq // block
    idx = jnp.arange(seq)
    starts = jnp.concatenate([jnp.ones((rows, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    segment_start = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    own = jnp.arange(n)
    # Per query block: the key block where its first query's segment starts (padding: its own block).
    first_key = jnp.where(segment_ids[:, ::block] == 0, own, segment_start[:, ::block] // block).ravel()
    counts = jnp.tile(own, rows) - first_key + 1
    ends = jnp.cumsum(counts)
    t = jnp.arange(rows * n * (n + 1) // 2)
    q = jnp.searchsorted(ends, t, side="right")  # rows * n past the real pairs: padding
    at = jnp.minimum(q, rows * n - 1)
    k = jnp.where(q < rows * n, at // n * n + first_key[at] + t - (ends[at] - counts[at]), 0)
    return q.astype(jnp.int32), k.astype(jnp.int32)
