"""The read side of a run: open it (a snapshot of run.json and the sidecars), samples by id, merged stats,
and shuffled token batches as numpy, torch (a DataLoader's workers sharing one snapshot) or global JAX
arrays over any mesh.

Inside the package dependencies point one way: run -> torch_data/jax_data -> batches -> pieces ->
layout/gather/shuffle/errors; all of them only read harvest.store and harvest.storage.
"""

from harvest.read.batches import TokenBatches
from harvest.read.errors import CorruptShardError, StartedOverError, StateError, UnknownTensorError
from harvest.read.run import Run, open_run
from harvest.store.snapshot import Sample, Snapshot

__all__ = ["CorruptShardError", "Run", "Sample", "Snapshot", "StartedOverError", "StateError", "TokenBatches",
           "UnknownTensorError", "open_run"]
