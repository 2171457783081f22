"""Sudoku datasets: from CSVs in Sudoku-Extreme's format or generated, augmented as the reference does.

Tokens: 0 pad, 1 blank, digit d -> d + 1 (9x9: vocab 11, as the reference). One example per puzzle, every
identifier the blank one (0); a group is a puzzle and its augmentations. Augmentation k of train puzzle i
draws from (seed, i, k): a permutation of the digits, a transpose (square boxes only: a 6x6's 2x3 boxes
would become 3x2), the bands and the rows within each band, the stacks and the columns within each.
"""

from __future__ import annotations

import numpy as np

from harvest.errors import UserError
from harvest.puzzles.common import Skips, csv_rows, csv_splits, distinct, progress, rng
from harvest.puzzles.config import PuzzlesConfig
from harvest.puzzles.format import Built, SplitBuilder
from harvest.puzzles.sudoku_gen import BOXES, DEFAULT_GIVENS, MIN_GIVENS, generate


def tokens(n: int) -> dict:
    return {"pad": 0, "blank": 1, **{f"digit {d}": d + 1 for d in range(1, n + 1)}}


def is_solution(grids: np.ndarray) -> np.ndarray:
    """Per grid of [B, n, n]: every row, column and box holds 1..n once."""
    b, n, _ = grids.shape
    br, bc = BOXES[n]
    boxes = grids.reshape(b, n // br, br, n // bc, bc).transpose(0, 1, 3, 2, 4).reshape(b, n, n)
    want = np.arange(1, n + 1)
    return np.all([np.all(np.sort(g, axis=2) == want, axis=(1, 2)) for g in (grids, grids.transpose(0, 2, 1), boxes)],
                  axis=0)


def augment(puzzle: np.ndarray, solution: np.ndarray, gen: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The same validity-preserving shuffle applied to a puzzle and its solution."""
    n = puzzle.shape[0]
    br, bc = BOXES[n]
    digits = np.concatenate([[0], 1 + gen.permutation(n)])
    transpose = br == bc and gen.random() < 0.5
    rows = np.concatenate([band * br + gen.permutation(br) for band in gen.permutation(n // br)])
    cols = np.concatenate([stack * bc + gen.permutation(bc) for stack in gen.permutation(n // bc)])

    def apply(grid: np.ndarray) -> np.ndarray:
        grid = grid.T if transpose else grid
        return digits[grid[rows][:, cols]]

    return apply(puzzle), apply(solution)


def read_csv(url: str, n: int, skips: Skips) -> tuple[np.ndarray, np.ndarray]:
    """(puzzles, solutions) [B, n, n] of the valid rows; the others skipped and counted."""
    rows, puzzles, solutions = [], [], []
    digits = set("123456789"[:n])
    for number, q, a in csv_rows(url, skips):
        if len(q) != n * n or len(a) != n * n:
            skips.add(url, number, f"wrong length (puzzle {len(q)}, solution {len(a)}; a {n}x{n} sudoku has {n * n})")
        elif not set(q) <= digits | {".", "0"} or not set(a) <= digits:
            skips.add(url, number, f"characters other than '.' and 1..{n}")
        else:
            rows.append(number)
            puzzles.append(np.frombuffer(q.replace(".", "0").encode(), np.uint8) - ord("0"))
            solutions.append(np.frombuffer(a.encode(), np.uint8) - ord("0"))
    if not rows:
        return np.zeros((0, n, n), np.int64), np.zeros((0, n, n), np.int64)
    puzzles = np.stack(puzzles).reshape(-1, n, n).astype(np.int64)
    solutions = np.stack(solutions).reshape(-1, n, n).astype(np.int64)
    solved = is_solution(solutions)
    agrees = np.all((puzzles == 0) | (puzzles == solutions), axis=(1, 2))
    for i in np.flatnonzero(~solved | ~agrees):
        reason = "solution breaks a row, column or box" if not solved[i] else "givens contradict the solution"
        skips.add(url, rows[i], reason)
    keep = solved & agrees
    return puzzles[keep], solutions[keep]


def generated(n: int, givens: int, count: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` distinct puzzles with one solution each; puzzle i from (seed, i), duplicates of earlier ones
    dropped (a 4x4 has only 288 full grids)."""
    def make(i: int) -> tuple[np.ndarray, np.ndarray]:
        made = generate(n, givens, rng(seed, "sudoku", i))
        if made is None:
            raise UserError(f"--givens {givens}: no {n}x{n} sudoku with a unique solution and only {givens} "
                            f"givens was found from puzzle {i}'s seed; use more givens")
        return made

    made = distinct(make, count, f"generate {n}x{n}")
    if made is None:
        raise UserError(f"--generate: fewer than {count} distinct {n}x{n} sudokus with {givens} givens turned up; "
                        "ask for fewer or use more givens")
    return made


def _split(puzzles: np.ndarray, solutions: np.ndarray, n: int, augments: int, seed: int) -> SplitBuilder:
    split = SplitBuilder(n * n)
    with progress("augment", len(puzzles) if augments else 0) as advance:
        for i, (puzzle, solution) in enumerate(zip(puzzles, solutions)):
            split.add_puzzle(puzzle.reshape(1, -1) + 1, solution.reshape(1, -1) + 1, 0)
            for k in range(1, augments + 1):
                q, a = augment(puzzle, solution, rng(seed, "augment", i, k))
                split.add_puzzle(q.reshape(1, -1) + 1, a.reshape(1, -1) + 1, 0)
            split.end_group()
            advance()
    return split


def check(config: PuzzlesConfig) -> None:
    """Sudoku's own flag rules, before anything is read or written."""
    n = config.size or 9
    if n not in BOXES:
        raise UserError(f"--size {n}: sudoku sizes are 4, 6 and 9")
    if config.givens is not None and not MIN_GIVENS[n] <= config.givens < n * n:
        raise UserError(f"--givens {config.givens}: a {n}x{n} sudoku with one solution has {MIN_GIVENS[n]} to "
                        f"{n * n - 1} givens")


def build(config: PuzzlesConfig, skips: Skips) -> Built:
    n = config.size or 9
    if config.generate:
        givens = config.givens or DEFAULT_GIVENS[n]
        test_size = config.test_size if config.test_size is not None else config.generate // 10
        puzzles, solutions = generated(n, givens, config.generate + test_size, config.seed)
        train = (puzzles[:config.generate], solutions[:config.generate])
        test = (puzzles[config.generate:], solutions[config.generate:])
        source = f"generated: {config.generate} + {test_size} {n}x{n} sudokus with {givens} givens, seed {config.seed}"
    else:
        train, test, source = csv_splits(config, lambda url: read_csv(url, n, skips))
    splits = {"train": _split(*train, n, config.augment or 0, config.seed), "test": _split(*test, n, 0, config.seed)}
    return Built(kind="sudoku", grid=(n, n), vocab_size=n + 2, tokens=tokens(n), splits=splits, source=source)
