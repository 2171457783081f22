"""What every puzzle builder shares: seeded generators, CSV rows from any URL, counted skips, a progress bar,
and the dihedral group (harvest.data.arc's transforms, with their inverses)."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import sys
from collections import Counter
from collections.abc import Callable, Iterator

import numpy as np

from harvest.data.arc import dihedral
from harvest.data.source_files import open_read

# dihedral(dihedral(g, t), DIHEDRAL_INVERSE[t]) == g: the rotations by 90 and 270 undo each other, the
# flips and transposes themselves.
DIHEDRAL_INVERSE = (0, 3, 2, 1, 4, 5, 6, 7)
SKIP_EXAMPLES = 10  # bad inputs named in dataset.json; the rest are only counted
GENERATE_TRIES = 20  # generated puzzles drawn per one kept: duplicates are dropped, so small sizes run out


def inverse_dihedral(grid: np.ndarray, t: int) -> np.ndarray:
    return dihedral(grid, DIHEDRAL_INVERSE[t])


def rng(seed: int, *path: int | str) -> np.random.Generator:
    """A generator that depends only on (seed, path): puzzle i's draws do not depend on how many came before,
    so a bigger build extends a smaller one. Strings in the path are hashed (stable across runs)."""
    words = [int.from_bytes(hashlib.sha256(p.encode()).digest()[:8], "little") if isinstance(p, str) else p
             for p in path]
    return np.random.default_rng([seed, *words])


class Skips:
    """Bad inputs, skipped and counted by reason; the first few remembered with where they were."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.examples: list[dict] = []

    def add(self, source: str, row: int, reason: str) -> None:
        self.counts[reason] += 1
        if len(self.examples) < SKIP_EXAMPLES:
            self.examples.append({"source": source, "row": row, "reason": reason})

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def csv_rows(url: str, skips: Skips) -> Iterator[tuple[int, str, str]]:
    """(row number, q, a) of a CSV in Sudoku-Extreme's / Maze-Hard's format (`source,q,a,rating`, a header
    line first), read from a local path, gs://, s3:// or any fsspec URL. Rows without 4 fields are skipped."""
    with open_read(url) as raw, io.TextIOWrapper(raw, encoding="utf-8", newline="") as text:
        for number, row in enumerate(csv.reader(text)):
            if number == 0 and len(row) >= 3 and row[1] == "q":
                continue
            if len(row) != 4:
                skips.add(url, number, f"{len(row)} fields, not 4 (source,q,a,rating)")
                continue
            yield number, row[1], row[2]


@contextlib.contextmanager
def progress(label: str, total: int):
    """A rich progress bar on a terminal (nothing in a log); yields `advance(n=1)`."""
    if not sys.stderr.isatty() or total <= 0:
        yield lambda n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n=1: bar.advance(task, n)


def distinct(make: Callable[[int], tuple[np.ndarray, np.ndarray]], count: int, label: str
             ) -> tuple[np.ndarray, np.ndarray] | None:
    """`count` (puzzle, label) pairs from make(0), make(1), ..., dropping puzzles equal to an earlier one;
    None when GENERATE_TRIES * count draws did not give that many."""
    puzzles, labels, seen = [], [], set()
    with progress(label, count) as advance:
        for i in range(count * GENERATE_TRIES):
            if len(puzzles) == count:
                break
            puzzle, answer = make(i)
            if puzzle.tobytes() not in seen:
                seen.add(puzzle.tobytes())
                puzzles.append(puzzle)
                labels.append(answer)
                advance()
    return (np.stack(puzzles), np.stack(labels)) if len(puzzles) == count else None


def csv_splits(config, read: Callable[[str], tuple[np.ndarray, np.ndarray]]
               ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], str]:
    """(train, test, source) from --train/--test CSVs, each (puzzles, labels), read by `read(url)`;
    --subsample keeps that many training puzzles, drawn by --seed, in file order."""
    train = read(config.train)
    if config.subsample is not None and config.subsample < len(train[0]):
        keep = np.sort(rng(config.seed, "subsample").choice(len(train[0]), config.subsample, replace=False))
        train = (train[0][keep], train[1][keep])
    test = read(config.test) if config.test else (train[0][:0], train[1][:0])
    return train, test, f"csv: train {config.train}" + (f", test {config.test}" if config.test else "")
