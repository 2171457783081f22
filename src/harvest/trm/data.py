"""Training batches from a puzzle dataset's split, as the reference samples them, as a pure function of
(seed, batch index) so that a resumed run sees the batches an uninterrupted one would.

Epoch e (its own generator from (seed, e)): the groups in a random order, one random puzzle of each group,
that puzzle's examples in a random order; the epoch's examples cut into global batches, the remainder dropped.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np


def epoch_examples(split: dict, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(example rows, their puzzle identifiers) of one epoch, in order."""
    gen = np.random.default_rng([seed, epoch])
    groups, puzzles = split["group_indices"], split["puzzle_indices"]
    rows, ids = [], []
    for g in gen.permutation(len(groups) - 1):
        p = gen.integers(groups[g], groups[g + 1])
        examples = gen.permutation(np.arange(puzzles[p], puzzles[p + 1]))
        rows.append(examples)
        ids.append(np.full(len(examples), split["puzzle_identifiers"][p], np.int32))
    return np.concatenate(rows), np.concatenate(ids)


def batches(split: dict, batch_size: int, seed: int, start: int = 0) -> Iterator[dict]:
    """Batches start, start + 1, ... forever: {inputs, labels [B, seq_len] uint8, puzzle_identifiers [B]}."""
    index, epoch = 0, 0
    while True:
        rows, ids = epoch_examples(split, seed, epoch)
        count = len(rows) // batch_size
        if count == 0:
            raise ValueError(f"an epoch has {len(rows)} examples, fewer than the batch size {batch_size}")
        for i in range(max(0, start - index), count):
            pick = slice(i * batch_size, (i + 1) * batch_size)
            yield {"inputs": split["inputs"][rows[pick]], "labels": split["labels"][rows[pick]],
                   "puzzle_identifiers": ids[pick]}
        index += count
        epoch += 1
