"""Packing token sequences into fixed [batch, seq] rows with segment ids (0 = padding).

Rows are filled greedily in sample order, so the packing is a pure function of the sample sequence:
a rerun packs every sample into the same row at the same offset (and rounds the same way).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one sample sits in the packed batch."""

    row: int
    start: int
    length: int


def pack_rows(samples: list[np.ndarray], seq_len: int) -> tuple[np.ndarray, np.ndarray, list[Placement]]:
    """Greedy in-order packing; each sample must fit in one row. Returns tokens, segment_ids, placements."""
    placements = []
    row, used = -1, seq_len  # forces a first row
    for sample in samples:
        if len(sample) > seq_len:
            raise ValueError(f"sample of {len(sample)} tokens does not fit a row of {seq_len}")
        if used + len(sample) > seq_len:
            row, used = row + 1, 0
        placements.append(Placement(row, used, len(sample)))
        used += len(sample)
    tokens = np.zeros((row + 1, seq_len), np.int32)
    segments = np.zeros((row + 1, seq_len), np.int32)
    segment, last_row = 0, -1
    for p, sample in zip(placements, samples):
        segment = segment + 1 if p.row == last_row else 1
        last_row = p.row
        tokens[p.row, p.start : p.start + p.length] = sample
        segments[p.row, p.start : p.start + p.length] = segment
    return tokens, segments, placements
