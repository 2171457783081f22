"""`harvest train eval RUN --data PUZZLES [--split test]`: a TRM run's newest checkpoint on a puzzle dataset,
with the EMA weights when the run keeps them (as the reference evaluates), halt_max_steps supervision steps.

Sudoku and maze: exact accuracy, the fraction of examples whose whole grid is right (labels equal to the
dataset's ignore id are not counted). ARC, as the reference's evaluator (evaluators/arc.py): each example's
prediction cropped to its grid (the largest top-left rectangle of colour tokens), its augmentation undone
(identifiers.safetensors: the dihedral transform and colour map of its identifier), then per test pair of
each task the distinct answers ranked by (votes, mean halting confidence sigmoid(q_halt)); pass@K is
whether the true output is among the first K, averaged over a task's test pairs, then over the tasks.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from harvest.errors import UserError
from harvest.puzzles.arc import SIDE
from harvest.puzzles.common import inverse_dihedral
from harvest.puzzles.format import PuzzleDataset, open_puzzles
from harvest.runtime.mesh import make_mesh
from harvest.storage import Storage
from harvest.training.checkpoint import CHECKPOINTS, Checkpoints, abstract
from harvest.training.record import read_run
from harvest.trm.hparams import TrmConfig, TrmOptim
from harvest.trm.step import batch_shardings, predict_fn, replicated

EVAL_ROWS = 256  # examples per predict call (rounded up to the devices)
PASS_KS = (1, 2, 5, 10)


def load_run(run_url: str) -> tuple[dict, TrmConfig, TrmOptim, int, dict]:
    """(run.json, model, optimizer, step, state) of a TRM run's newest checkpoint, on this process's devices."""
    from harvest.trm.trainer import TrmTrainer, state_shapes

    out = Storage(run_url)
    record = read_run(out, TrmTrainer.kind, TrmTrainer.what)
    if record is None:
        raise UserError(f"{out.url}: not a TRM training run (no run.json)")
    info = record.to_json()
    model, optim = TrmConfig(**info["trm"]["model"]), TrmOptim(**info["trm"]["optim"])
    shapes = state_shapes(model, optim, 0)
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    checkpoints = Checkpoints(out.url_of(CHECKPOINTS), every=1, keep=1, read_only=True)
    restored = checkpoints.restore_latest(abstract(shapes, jax.tree.map(lambda _: device, shapes)))
    checkpoints.close()
    if restored is None:
        raise UserError(f"{out.url}: no checkpoint yet")
    step, state, _ = restored
    return info, model, optim, step, state


def predict(model: TrmConfig, weights: dict, puzzle_emb: jax.Array, states: dict, split: dict[str, np.ndarray]):
    """(preds [examples, seq_len], q_halt [examples]) of every example of a split, batched over the devices."""
    mesh = make_mesh(f"data={jax.device_count()}")
    rows = -(-EVAL_ROWS // jax.device_count()) * jax.device_count()
    fixed = jax.device_put((weights, puzzle_emb, states), replicated((weights, puzzle_emb, states), mesh))
    run = jax.jit(predict_fn(model))
    ids = np.repeat(split["puzzle_identifiers"], np.diff(split["puzzle_indices"]))
    count = len(split["inputs"])
    preds, q = [], []
    for begin in range(0, count, rows):
        pick = np.arange(begin, begin + rows) % count  # the last batch padded with the first examples
        batch = {"inputs": split["inputs"][pick], "labels": split["labels"][pick], "puzzle_identifiers": ids[pick]}
        batch = jax.device_put(batch, batch_shardings(batch, mesh))
        out = jax.device_get(run(*fixed, batch))
        take = min(rows, count - begin)
        preds.append(out["preds"][:take])
        q.append(out["q_halt"][:take])
    return np.concatenate(preds), np.concatenate(q)


def exact_accuracy(preds: np.ndarray, labels: np.ndarray, ignore_label_id: int | None) -> float:
    counted = labels != ignore_label_id if ignore_label_id is not None else np.ones(labels.shape, bool)
    return float(np.mean(np.all((preds == labels) | ~counted, axis=1)))


def crop(tokens: np.ndarray) -> np.ndarray:
    """The grid a 30x30 token row holds: the largest top-left rectangle of colour tokens (2..11), as colours."""
    grid = tokens.reshape(SIDE, SIDE)
    best, size, cols = 0, (0, 0), SIDE
    for rows in range(1, SIDE + 1):
        bad = np.flatnonzero((grid[rows - 1, :cols] < 2) | (grid[rows - 1, :cols] > 11))
        if len(bad):
            cols = int(bad[0])
        if rows * cols > best:
            best, size = rows * cols, (rows, cols)
    return (grid[:size[0], :size[1]] - 2).astype(np.uint8)


def arc_pass_at(dataset: PuzzleDataset, split: dict[str, np.ndarray], preds: np.ndarray, q_halt: np.ndarray,
                ks: tuple[int, ...] = PASS_KS) -> dict[str, float]:
    """pass@K over the dataset's test tasks (tasks.json) from every example's prediction and Q-halt logit."""
    import json

    ids = dataset.arrays("identifiers")
    tasks = json.loads(dataset.read_file("tasks.json"))
    names = tasks["names"]
    votes: dict[tuple[str, int], dict[bytes, list]] = {}
    confidence = 1 / (1 + np.exp(-q_halt.astype(np.float64)))
    starts = split["puzzle_indices"]
    for puzzle, identifier in enumerate(split["puzzle_identifiers"]):
        task = int(ids["task"][identifier])
        if task < 0:
            continue
        unmap = np.argsort(ids["colours"][identifier])  # colour c of this version was colour unmap[c]
        for pair, example in enumerate(range(starts[puzzle], starts[puzzle + 1])):
            grid = unmap[inverse_dihedral(crop(preds[example]), int(ids["dihedral"][identifier]))]
            key = np.asarray(grid.shape, np.int32).tobytes() + grid.astype(np.uint8).tobytes()
            entry = votes.setdefault((names[task], pair), {}).setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += confidence[example]
    scores = dict.fromkeys(ks, 0.0)
    for name, task in tasks["test_puzzles"].items():
        for pair, test in enumerate(task["test"]):
            answer = np.asarray(test["output"], np.uint8)
            want = np.asarray(answer.shape, np.int32).tobytes() + answer.tobytes()
            ranked = sorted(votes.get((name, pair), {}).items(), key=lambda kv: (kv[1][0], kv[1][1] / kv[1][0]),
                            reverse=True)
            for k in ks:
                scores[k] += any(key == want for key, _ in ranked[:k]) / len(task["test"])
    return {f"pass@{k}": scores[k] / max(len(tasks["test_puzzles"]), 1) for k in ks}


def evaluate(run_url: str, data_url: str, split_name: str = "test") -> dict[str, Any]:
    _, model, _, step, state = load_run(run_url)
    dataset = open_puzzles(data_url)
    sized = model.for_dataset(dataset.info)
    if sized != model:
        differ = [f"{f.name} {getattr(model, f.name)} vs {getattr(sized, f.name)}" for f in dataclasses.fields(model)
                  if getattr(model, f.name) != getattr(sized, f.name)]
        raise UserError(f"{dataset.url} does not fit the run's model ({', '.join(differ)}): evaluate on the "
                        "dataset it was trained on (or one built with the same settings)")
    split = dataset.split(split_name)
    weights = "ema" if "ema" in state else "params"
    preds, q = predict(model, state[weights], state["puzzle_emb"], state["states"], split)
    result = {"run": run_url, "data": dataset.url, "split": split_name, "step": step, "weights": weights,
              "examples": len(preds),
              "exact_accuracy": exact_accuracy(preds, split["labels"], dataset.info.ignore_label_id)}
    if dataset.info.kind == "arc":
        result.update(arc_pass_at(dataset, split, preds, q))
    return result
