"""Token batches as global JAX arrays over a mesh, for any mesh.

The batch dimension is cut into one block per position along the mesh's data axes; each device holds one
block, and several devices (on one process or on several) may hold the same block when the mesh has other
axes. Every process reads the blocks its own devices hold, as a consumer of the run's order that only the
processes holding the same blocks share: processes whose devices lie on one data index (data=1 with the
model across hosts, or a data index spanning hosts) read the same rows, and distinct blocks are disjoint
parts of the run. Processes read their blocks themselves: no host sends another its rows.

Processes agree on the shards: without `snapshot=`, process 0's listing is broadcast to the others first.
Every process must make the same number of steps: consumers' shares of an epoch differ by up to a piece,
so train for a number of steps over `epochs=None` (as SAE trainers count tokens).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from harvest.read.batches import TokenBatches
from harvest.storage import Storage
from harvest.store.listing import covered_streams
from harvest.store.snapshot import Snapshot


def global_batches(storage: Storage, view: Snapshot, batch_size: int, names: list[str], mesh: Any,
                   data_axes: tuple[str, ...], settings: dict[str, Any]) -> GlobalBatches:
    """[batch_size, d] arrays sharded by rows over `data_axes` (every batch full: shapes stay fixed)."""
    unknown = [a for a in data_axes if a not in mesh.shape]
    if unknown:
        raise ValueError(f"data_axes {list(data_axes)}: the mesh has axes {list(mesh.shape)}")
    taken = sorted({"rank", "world", "worker", "workers", "drop_last"} & set(settings))
    if taken:
        raise ValueError(f"jax_batches deals rows by the mesh: drop {', '.join(taken)}")
    blocks = math.prod(mesh.shape[a] for a in data_axes)
    if batch_size % blocks:
        raise ValueError(f"batch_size {batch_size} must divide over the {blocks} blocks of data axes {list(data_axes)}")
    sharding = NamedSharding(mesh, PartitionSpec(data_axes))
    block_rows = batch_size // blocks
    mine, rank, world = _my_blocks(sharding, batch_size, block_rows, mesh, data_axes)
    if jax.process_count() > 1 and settings.get("snapshot") is None:
        settings = {**settings, "snapshot": _agreed_counts(view)}
    reader = TokenBatches(storage, view, block_rows * len(mine), names, rank=rank, world=world, drop_last=True,
                          **settings)
    return GlobalBatches(reader, sharding, batch_size, block_rows, mine)


class GlobalBatches:
    """The iterator global_batches returns; `state_dict()` after any batch and `load_state_dict()` before the
    first are this process's reader's (harvest.read.batches.TokenBatches): a trainer's checkpoint holds them."""

    def __init__(self, reader: TokenBatches, sharding: NamedSharding, batch_size: int, block_rows: int,
                 mine: list[int]):
        self.reader, self._sharding, self._batch_size, self._block_rows = reader, sharding, batch_size, block_rows
        self._where = {block: k for k, block in enumerate(mine)}
        self._batches: Iterator[dict[str, np.ndarray]] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self.reader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reader.load_state_dict(state)

    def __iter__(self) -> GlobalBatches:
        return self

    def __next__(self) -> dict[str, jax.Array]:
        if self._batches is None:
            self._batches = iter(self.reader)
        batch = next(self._batches)
        return {k: jax.make_array_from_callback((self._batch_size, *v.shape[1:]), self._sharding,
                                                lambda index, v=v: self._rows_for(v, index))
                for k, v in batch.items()}

    def _rows_for(self, local: np.ndarray, index: tuple) -> np.ndarray:
        at = self._where[(index[0].start or 0) // self._block_rows] * self._block_rows
        return local[(slice(at, at + self._block_rows), *index[1:])]


def _my_blocks(sharding: NamedSharding, batch_size: int, block_rows: int, mesh: Any,
               data_axes: tuple[str, ...]) -> tuple[list[int], int, int]:
    """(the blocks this process's devices hold, in order; its rank and the world among the distinct sets
    of blocks that processes hold). Refuses a mesh whose processes hold overlapping but unequal sets."""
    held: dict[int, set[int]] = {}
    for device, index in sharding.devices_indices_map((batch_size,)).items():
        held.setdefault(device.process_index, set()).add((index[0].start or 0) // block_rows)
    sets = sorted({frozenset(b) for b in held.values()}, key=min)
    seen: set[int] = set()
    for s in sets:
        if s & seen or len(s) != len(sets[0]):
            raise ValueError(f"mesh {dict(mesh.shape)}: its processes hold overlapping or unequal parts of the batch "
                             f"along {list(data_axes)} ({sorted(map(sorted, sets))}); jax_batches serves meshes whose "
                             "processes hold the same blocks or disjoint ones of one size")
        seen |= s
    if jax.process_index() not in held:
        raise ValueError(f"mesh {dict(mesh.shape)}: process {jax.process_index()} holds none of its devices")
    mine = frozenset(held[jax.process_index()])
    return sorted(mine), sets.index(mine), len(sets)


def _agreed_counts(view: Snapshot) -> dict[int, list]:
    """Process 0's {stream: [committed shards, generation]} (Snapshot.shared), on every process (a collective:
    every process calls it). A generation (16 hex digits, or "") goes as four int32 of 4 digits (-1: "")."""
    from jax.experimental.multihost_utils import broadcast_one_to_all

    streams, shared = covered_streams(view.info), view.shared()
    rows = [[shared.get(s, [0])[0], *_digits(shared.get(s, [0, ""])[1])] for s in streams]
    agreed = np.asarray(broadcast_one_to_all(np.asarray(rows, np.int32).reshape(len(streams), 5)))
    return {s: [int(row[0]), "".join(f"{int(d):04x}" for d in row[1:] if d >= 0)]
            for s, row in zip(streams, agreed) if row[0]}


def _digits(generation: str) -> list[int]:
    return [int(generation[i:i + 4], 16) for i in range(0, 16, 4)] if generation else [-1] * 4
