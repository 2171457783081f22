"""Which (query block, key block) pairs of a packed batch can see each other: the host side of
block-sparse attention.

A row of 1024 tokens holding 16 short samples needs ~sum(len_i^2) attention scores, not 1024^2. Cut each
row into blocks of `block` tokens; a query block needs the key blocks from the start of the segment its
first query belongs to up to itself (padding queries: only their own block). The pairs are listed on the
host from the segment ids (numpy, no per-token loop), row by row, each query block's keys in order, then
padded to one length per batch shape (the causal triangle of every row), so that a run compiles once; the
attention loops over the real pairs only. Padding pairs point at the query block `rows * blocks_per_row`,
past the last real one.

A row's pairs depend on that row alone, and the attention folds them in the listed order: a row rounds
the same way whatever rows share its batch (resume re-batches rows and must repeat bit for bit).
"""

from __future__ import annotations

import numpy as np

BLOCK = 64  # tokens per block: measured against 32 and 128 on CPU (8 x 1024 rows of 15-720-token samples)


def block_len(seq: int) -> int:
    """Block length for rows of `seq` tokens: BLOCK, or the whole row when seq is not a multiple of it."""
    return BLOCK if seq % BLOCK == 0 else seq


def block_pairs(segment_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(query block, key block) flat indices [P] (row * blocks_per_row + block). P is the same for every batch
    of this shape (the causal triangle of every row): one compiled shape."""
    rows, seq = segment_ids.shape
    block = block_len(seq)
    n = seq // block
    idx = np.arange(seq)
    starts = np.ones((rows, seq), bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    segment_start = np.maximum.accumulate(np.where(starts, idx, 0), axis=1)
    firsts = segment_start[:, ::block] // block  # key block where each query block's first query's segment starts
    own = np.tile(np.arange(n), rows)
    row_base = np.repeat(np.arange(rows) * n, n)
    first_key = np.where(segment_ids[:, ::block] == 0, np.arange(n), firsts).ravel()
    counts = own - first_key + 1
    total = int(counts.sum())
    offset_in_run = np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
    q = np.repeat(row_base + own, counts)
    k = np.repeat(row_base + first_key, counts) + offset_in_run
    padded = rows * n * (n + 1) // 2
    q = np.concatenate([q, np.full(padded - total, rows * n)]).astype(np.int32)
    k = np.concatenate([k, np.zeros(padded - total, np.int64)]).astype(np.int32)
    return q, k
