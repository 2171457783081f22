"""A shard's per-dimension stats of each tensor, in float64 and exactly mergeable: the sidecar holds them, and
a run's stats are the merge of its shards' in any order."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_dtypes
import numpy as np


@dataclasses.dataclass
class RunningStats:
    """Per-dimension count, mean and M2 in float64 (Welford/Chan): shards merge exactly, in any order."""

    count: int
    mean: np.ndarray
    m2: np.ndarray

    CHUNK_BYTES = 2 << 20  # float64 rows converted at a time: cache-sized, measured fastest for widths 256-4096

    @classmethod
    def of(cls, values: np.ndarray) -> RunningStats:
        """Exact float64 stats of [n, d] values (the mean, then M2 around it), a chunk of rows at a time.

        Equal, bit for bit, to converting the whole tensor to float64 at once: numpy reduces over the rows of
        a C-contiguous array one row after another, and each chunk's sum starts from the running total (the
        chunk's first row of its buffer). bf16 widens to float32 by a shift of its bits (exact and cheap).
        """
        n, d = values.shape
        if n == 0:
            return cls(0, np.zeros(d), np.zeros(d))
        rows = max(1, cls.CHUNK_BYTES // (8 * d))
        total = _row_sum(values, rows, lambda chunk: None)
        mean = total / n
        return cls(n, mean, _row_sum(values, rows, lambda chunk: np.square(
            np.subtract(chunk, mean, out=chunk), out=chunk)))

    @classmethod
    def of_pieces(cls, pieces: list[np.ndarray], means: list, m2s: list) -> RunningStats:
        """Stats of the rows of `pieces` (each [n_i, d]) from each piece's own mean and M2 (float32, from the
        device: harvest.model.moments), merged in float64 in one step (Chan's formula over all pieces); a piece
        whose mean is None gets its own here, exact, from its rows. `pieces` has at least one (maybe empty) block."""
        counts = np.asarray([len(piece) for piece in pieces], np.float64)[:, None]
        n, d = int(counts.sum()), pieces[0].shape[1]
        if n == 0:
            return cls(0, np.zeros(d), np.zeros(d))
        own = [cls.of(piece) if mean is None else None for piece, mean in zip(pieces, means)]
        piece_means = np.stack([s.mean if s else mean for s, mean in zip(own, means)]).astype(np.float64)
        piece_m2s = np.stack([s.m2 if s else m2 for s, m2 in zip(own, m2s)]).astype(np.float64)
        mean = (counts * piece_means).sum(axis=0) / n
        return cls(n, mean, piece_m2s.sum(axis=0) + (counts * np.square(piece_means - mean)).sum(axis=0))

    def merge(self, other: RunningStats) -> RunningStats:
        n = self.count + other.count
        if n == 0:
            return self
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2 + delta**2 * (self.count * other.count / n)
        return RunningStats(n, mean, m2)

    @property
    def var(self) -> np.ndarray:
        return self.m2 / max(self.count - 1, 1)

    def share_of(self, whole: RunningStats) -> float:
        """The share of `whole`'s variance (summed over dimensions) that these rows, a subset of its rows,
        hold: their squared distance from its mean over its total."""
        total = float(np.sum(whole.m2))
        return float(np.sum(self.m2 + self.count * np.square(self.mean - whole.mean))) / total if total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean.tolist(), "m2": self.m2.tolist()}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RunningStats:
        return cls(int(obj["count"]), np.asarray(obj["mean"], np.float64), np.asarray(obj["m2"], np.float64))


def _row_sum(values: np.ndarray, rows: int, transform) -> np.ndarray:
    """The float64 sum over the rows of transform(values as float64), `rows` at a time, in the order one
    reduction over the whole tensor adds them; `transform` changes a chunk in place."""
    values = np.ascontiguousarray(values)
    n, d = values.shape
    bits = values.view(np.uint16) if values.dtype == ml_dtypes.bfloat16 else None
    widened = np.empty((min(rows, n), d), np.float32) if bits is not None else None
    buffer = np.empty((min(rows, n) + 1, d), np.float64)  # row 0: the running total
    total = None
    for start in range(0, n, rows):
        chunk = buffer[1 : 1 + min(rows, n - start)]
        if bits is not None:
            part = widened[: len(chunk)]
            np.left_shift(bits[start : start + len(chunk)], 16, out=part.view(np.uint32), dtype=np.uint32)
            chunk[...] = part
        else:
            chunk[...] = values[start : start + len(chunk)]
        transform(chunk)
        if total is None:
            total = chunk.sum(axis=0)
        else:
            buffer[0] = total
            total = buffer[: 1 + len(chunk)].sum(axis=0)
    return total
