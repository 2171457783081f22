"""Maze datasets: from CSVs in Maze-Hard's format or generated, with dihedral augmentation.

Cells are the characters of Maze-Hard: '#' wall, ' ' open, 'S' start, 'G' goal, and in the label 'o' on
the open cells of the shortest path from S to G. Tokens: 0 pad, then '#' 1, ' ' 2, 'S' 3, 'G' 4, 'o' 5.
Generated mazes are perfect (a random spanning tree of the cells, carved by a randomised depth-first
search), so the path between two cells is unique; S is a random cell and G the cell farthest from it.
Augmentation k of train maze i applies the k-th of a random choice, from (seed, i), of the 7 non-identity
dihedral transforms to the maze and its label.
"""

from __future__ import annotations

from collections import deque
import numpy as np

from harvest.data.arc import dihedral
from harvest.errors import UserError
from harvest.puzzles.common import Skips, csv_rows, csv_splits, distinct, progress, rng
from harvest.puzzles.config import PuzzlesConfig
from harvest.puzzles.format import Built, SplitBuilder

CHARSET = "# SGo"
WALL, OPEN, START, GOAL, PATH = range(1, 6)
DEFAULT_SIZE = 30
_STEPS = ((-1, 0), (1, 0), (0, -1), (0, 1))
_CHAR_TO_TOKEN = np.zeros(256, np.uint8)
_CHAR_TO_TOKEN[[ord(c) for c in CHARSET]] = np.arange(1, len(CHARSET) + 1)


def tokens() -> dict:
    return {"pad": 0, **{repr(c): i + 1 for i, c in enumerate(CHARSET)}}


def distances(grid: np.ndarray, start: tuple[int, int], passable: np.ndarray) -> np.ndarray:
    """Steps from `start` to every cell through `passable` cells (-1: unreachable), breadth first."""
    n_rows, n_cols = grid.shape
    dist = np.full(grid.shape, -1, np.int64)
    dist[start] = 0
    queue = deque([start])
    while queue:
        r, c = queue.popleft()
        for dr, dc in _STEPS:
            rr, cc = r + dr, c + dc
            if 0 <= rr < n_rows and 0 <= cc < n_cols and passable[rr, cc] and dist[rr, cc] < 0:
                dist[rr, cc] = dist[r, c] + 1
                queue.append((rr, cc))
    return dist


def problem(maze: np.ndarray, label: np.ndarray) -> str | None:
    """Why (maze, label) is not a maze with its shortest path marked; None when it is."""
    if np.any(maze == PATH) or np.sum(maze == START) != 1 or np.sum(maze == GOAL) != 1:
        return "maze needs exactly one S and one G and no 'o'"
    on_path = (label == PATH)
    if np.any(on_path & (maze != OPEN)) or np.any(~on_path & (label != maze)):
        return "label differs from the maze other than 'o' on open cells"
    start = tuple(int(x) for x in np.argwhere(maze == START)[0])
    goal = tuple(int(x) for x in np.argwhere(maze == GOAL)[0])
    shortest = distances(maze, start, maze != WALL)[goal]
    if shortest < 0:
        return "no path from S to G"
    along = distances(maze, start, on_path | (maze == GOAL))[goal]
    if along != shortest or on_path.sum() != shortest - 1:
        return "label is not a shortest path from S to G"
    return None


def read_csv(url: str, n: int, skips: Skips) -> tuple[np.ndarray, np.ndarray]:
    """(mazes, labels) [B, n, n] tokens of the valid rows; the others skipped and counted."""
    mazes, labels = [], []
    for number, q, a in csv_rows(url, skips):
        if len(q) != n * n or len(a) != n * n:
            skips.add(url, number, f"wrong length (maze {len(q)}, label {len(a)}; a {n}x{n} maze has {n * n})")
            continue
        if not set(q) | set(a) <= set(CHARSET):
            skips.add(url, number, f"characters other than {CHARSET!r}")
            continue
        maze = _CHAR_TO_TOKEN[np.frombuffer(q.encode(), np.uint8)].reshape(n, n)
        label = _CHAR_TO_TOKEN[np.frombuffer(a.encode(), np.uint8)].reshape(n, n)
        reason = problem(maze, label)
        if reason:
            skips.add(url, number, reason)
        else:
            mazes.append(maze)
            labels.append(label)
    if not mazes:
        return np.zeros((0, n, n), np.uint8), np.zeros((0, n, n), np.uint8)
    return np.stack(mazes), np.stack(labels)


def generate(n: int, gen: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A perfect maze on an n x n grid (cells at odd coordinates, walls between) and its S -> G path."""
    maze = np.full((n, n), WALL, np.uint8)
    cells = (n - 1) // 2
    first = (2 * int(gen.integers(cells)) + 1, 2 * int(gen.integers(cells)) + 1)
    maze[first] = OPEN
    stack = [first]
    while stack:
        r, c = stack[-1]
        options = [(rr, cc, dr, dc) for dr, dc in _STEPS for rr, cc in [(r + 2 * dr, c + 2 * dc)]
                   if 0 < rr < 2 * cells and 0 < cc < 2 * cells and maze[rr, cc] == WALL]
        if not options:
            stack.pop()
            continue
        rr, cc, dr, dc = options[int(gen.integers(len(options)))]
        maze[r + dr, c + dc] = maze[rr, cc] = OPEN
        stack.append((rr, cc))
    start = (2 * int(gen.integers(cells)) + 1, 2 * int(gen.integers(cells)) + 1)
    dist = distances(maze, start, maze != WALL)
    goal = tuple(int(x) for x in np.unravel_index(int(np.argmax(dist)), dist.shape))
    label = maze.copy()
    at = goal
    while dist[at] > 1:  # walk back from G along decreasing distance: the unique path in a perfect maze
        at = next((at[0] + dr, at[1] + dc) for dr, dc in _STEPS
                  if 0 <= at[0] + dr < n and 0 <= at[1] + dc < n and dist[at[0] + dr, at[1] + dc] == dist[at] - 1)
        label[at] = PATH
    maze[start] = label[start] = START
    maze[goal] = label[goal] = GOAL
    return maze, label


def _split(mazes: np.ndarray, labels: np.ndarray, n: int, augments: int, seed: int) -> SplitBuilder:
    split = SplitBuilder(n * n)
    with progress("augment", len(mazes) if augments else 0) as advance:
        for i, (maze, label) in enumerate(zip(mazes, labels)):
            transforms = [0] + [int(t) for t in rng(seed, "dihedral", i).permutation(np.arange(1, 8))[:augments]]
            for t in transforms:
                split.add_puzzle(dihedral(maze, t).reshape(1, -1), dihedral(label, t).reshape(1, -1), 0)
            split.end_group()
            advance()
    return split


def check(config: PuzzlesConfig) -> None:
    n = config.size or DEFAULT_SIZE
    if n < 5:
        raise UserError(f"--size {n}: a maze needs a side of at least 5")
    if config.augment is not None and config.augment > 7:
        raise UserError(f"--augment {config.augment}: a maze has 7 dihedral transforms besides itself")


def build(config: PuzzlesConfig, skips: Skips) -> Built:
    n = config.size or DEFAULT_SIZE
    if config.generate:
        test_size = config.test_size if config.test_size is not None else config.generate // 10
        made = distinct(lambda i: generate(n, rng(config.seed, "maze", i)), config.generate + test_size,
                        f"generate {n}x{n}")
        if made is None:
            raise UserError(f"--generate: fewer than {config.generate + test_size} distinct {n}x{n} mazes exist "
                            "here; ask for fewer or a bigger --size")
        train = (made[0][:config.generate], made[1][:config.generate])
        test = (made[0][config.generate:], made[1][config.generate:])
        source = f"generated: {config.generate} + {test_size} {n}x{n} perfect mazes, seed {config.seed}"
    else:
        train, test, source = csv_splits(config, lambda url: read_csv(url, n, skips))
    splits = {"train": _split(*train, n, config.augment or 0, config.seed), "test": _split(*test, n, 0, config.seed)}
    return Built(kind="maze", grid=(n, n), vocab_size=len(CHARSET) + 1, tokens=tokens(), splits=splits, source=source)
