"""Token batches as global JAX arrays over a mesh's data axes: each host reads its own share of the run
(rank = process index, world = process count) and places it on its own devices; no host reads another's.

Every host must make the same number of steps: hosts' shares of an epoch differ by up to a piece, so train
for a number of steps over `epochs=None` (as SAE trainers count tokens), and give every host the same
`snapshot=` when the run is still being written."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

if TYPE_CHECKING:
    from harvest.store.reader import Run


def global_batches(run: Run, batch_size: int, tensors: Sequence[str] | str | None, mesh: Any,
                   data_axes: tuple[str, ...], settings: dict[str, Any]) -> Iterator[dict[str, jax.Array]]:
    """[batch_size, d] arrays sharded by rows over `data_axes` (every batch full: shapes stay fixed)."""
    unknown = [a for a in data_axes if a not in mesh.shape]
    if unknown:
        raise ValueError(f"data_axes {list(data_axes)}: the mesh has axes {list(mesh.shape)}")
    world, rank = jax.process_count(), jax.process_index()
    shards = 1
    for axis in data_axes:
        shards *= mesh.shape[axis]
    if batch_size % shards or batch_size % world:
        raise ValueError(f"batch_size {batch_size} must divide over the {shards} data shards and {world} hosts")
    sharding = NamedSharding(mesh, PartitionSpec(data_axes))
    local = run.token_batches(batch_size // world, tensors, rank=rank, world=world, drop_last=True, **settings)
    for batch in local:
        yield {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
