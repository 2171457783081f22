"""Rows as a reader holds them between reading and serving: a piece's columns (`Part`), and the parts of a
group mixed together (`Group`), from which each batch is gathered with one copy."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass
class Part:
    """A piece as read: its columns (all its rows), the rows to serve (None: all) and how many rows the norm
    rule (max_norm) left out."""

    cols: dict[str, np.ndarray]
    keep: np.ndarray | None
    massive: int = 0

    @property
    def rows(self) -> int:
        return len(self.cols["tokens"]) if self.keep is None else len(self.keep)


class Group:
    """The parts mixed together: served rows numbered 0..rows-1 across them, gathered part by part."""

    def __init__(self, parts: list[Part]):
        self.parts = parts
        self.starts = np.cumsum([0, *(p.rows for p in parts)])
        self.rows = int(self.starts[-1])

    def gather(self, rows: np.ndarray, out: dict[str, np.ndarray], at: int) -> None:
        """Copy served rows `rows` into out[k][at:at+len(rows)]: one copy, straight from the mapped or
        fetched bytes. A batch holds its rows grouped by part (the set is the shuffled sample)."""
        part_of = np.searchsorted(self.starts, rows, side="right") - 1
        local = rows - self.starts[part_of]
        ordered = np.lexsort((local, part_of))
        part_of, local = part_of[ordered], local[ordered]
        bounds = np.searchsorted(part_of, np.arange(len(self.parts) + 1))
        for j in np.flatnonzero(np.diff(bounds)):
            lo, hi = bounds[j], bounds[j + 1]
            part = self.parts[j]
            idx = local[lo:hi] if part.keep is None else part.keep[local[lo:hi]]
            for k, v in part.cols.items():  # mode="clip": indices are valid, and "raise" would copy twice
                np.take(v, idx, axis=0, out=out[k][at + lo:at + hi], mode="clip")
