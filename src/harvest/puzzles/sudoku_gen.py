"""Sudokus with exactly one solution, made from a seed: a random full grid (randomised backtracking), then
givens removed in random order while the puzzle keeps a unique solution, down to the chosen count.

Sizes: 4x4 (2x2 boxes), 6x6 (2 rows x 3 columns boxes), 9x9 (3x3). Grids are int arrays, 0 = blank.
"""

from __future__ import annotations

import numpy as np

BOXES = {4: (2, 2), 6: (2, 3), 9: (3, 3)}  # size -> (box rows, box columns)
MIN_GIVENS = {4: 4, 6: 8, 9: 17}  # the fewest givens a uniquely solvable puzzle of that size can have
DEFAULT_GIVENS = {4: 6, 6: 14, 9: 30}
TRIES = 50  # fresh full grids tried before a --givens target counts as out of reach


class _Board:
    """Candidate bitmasks per row, column and box (bit d set = digit d used), for a fast search."""

    def __init__(self, grid: np.ndarray):
        self.n = n = grid.shape[0]
        self.br, self.bc = BOXES[n]
        self.cells = [int(v) for v in grid.reshape(-1)]
        self.rows, self.cols, self.boxes = [0] * n, [0] * n, [0] * n
        self.full = ((1 << n) - 1) << 1
        self.ok = True
        for i, v in enumerate(self.cells):
            if v:
                r, c, b = self.where(i)
                bit = 1 << v
                if (self.rows[r] | self.cols[c] | self.boxes[b]) & bit:
                    self.ok = False
                self.rows[r] |= bit
                self.cols[c] |= bit
                self.boxes[b] |= bit

    def where(self, i: int) -> tuple[int, int, int]:
        r, c = divmod(i, self.n)
        return r, c, (r // self.br) * (self.n // self.bc) + c // self.bc

    def place(self, i: int, v: int, on: bool) -> None:
        r, c, b = self.where(i)
        bit = 1 << v
        self.rows[r] ^= bit
        self.cols[c] ^= bit
        self.boxes[b] ^= bit
        self.cells[i] = v if on else 0

    def best_empty(self) -> tuple[int, int] | None:
        """The empty cell with the fewest candidates and its candidate mask; None when the grid is full."""
        best, best_mask, best_count = None, 0, 99
        for i, v in enumerate(self.cells):
            if v:
                continue
            r, c, b = self.where(i)
            mask = self.full & ~(self.rows[r] | self.cols[c] | self.boxes[b])
            count = mask.bit_count()
            if count < best_count:
                best, best_mask, best_count = i, mask, count
                if count <= 1:
                    break
        return None if best is None else (best, best_mask)

    def count(self, limit: int) -> int:
        """Solutions of the current grid, counting stops at `limit`."""
        found = self.best_empty()
        if found is None:
            return 1
        i, mask = found
        total = 0
        while mask and total < limit:
            bit = mask & -mask
            mask ^= bit
            self.place(i, bit.bit_length() - 1, True)
            total += self.count(limit - total)
            self.place(i, bit.bit_length() - 1, False)
        return total

    def fill(self, rng: np.random.Generator) -> bool:
        """Complete the grid with digits tried in random order; False if it cannot be completed."""
        found = self.best_empty()
        if found is None:
            return True
        i, mask = found
        digits = [d for d in range(1, self.n + 1) if mask >> d & 1]
        for d in rng.permutation(digits):
            self.place(i, int(d), True)
            if self.fill(rng):
                return True
            self.place(i, int(d), False)
        return False


def count_solutions(grid: np.ndarray, limit: int = 2) -> int:
    """How many solutions `grid` (0 = blank) has, up to `limit`; 0 when its givens already clash."""
    board = _Board(grid)
    return board.count(limit) if board.ok else 0


def full_grid(n: int, rng: np.random.Generator) -> np.ndarray:
    board = _Board(np.zeros((n, n), np.int64))
    board.fill(rng)
    return np.array(board.cells, np.int64).reshape(n, n)


def generate(n: int, givens: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray] | None:
    """(puzzle, solution) with exactly `givens` givens and one solution; None when TRIES full grids all got
    stuck above `givens` (every further removal would admit a second solution)."""
    for _ in range(TRIES):
        solution = full_grid(n, rng)
        board = _Board(solution)
        left = n * n
        for i in rng.permutation(n * n):
            if left == givens:
                break
            v = board.cells[int(i)]
            board.place(int(i), v, False)
            if board.count(2) == 1:
                left -= 1
            else:
                board.place(int(i), v, True)
        if left == givens:
            return np.array(board.cells, np.int64).reshape(n, n), solution
    return None
