"""A run opened for reading: what it holds, samples by id, merged stats, and token batches (numpy, torch, JAX).

```python
run = harvest.open("gs://bucket/run")            # reads run.json and every sidecar, nothing else
run.tensors                                       # {"resid_post.20": 3584, ...}
s = run.sample(1234, variant=0)                   # Sample(sample_id, variant, tokens, activations)
run.stats("resid_post.20").mean                   # exact merge of the shards' fp64 running stats
for batch in run.token_batches(4096, ["resid_post.20"], seed=0, epochs=None):   # SAE training rows
    ...
```
A `Run` is a snapshot of the committed shards (harvest.store.snapshot; `refresh()` takes a new one) and
the storage they are on. All I/O goes through `Storage`; shards are decoded with safetensors from bytes
(no pickle, nothing eval'd), or for token batches read as the byte ranges of the tensors asked for.
"""

from __future__ import annotations

import bisect
import collections
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from harvest.read.batches import TokenBatches, median_norms
from harvest.read.errors import UnknownTensorError
from harvest.storage import Storage
from harvest.store.records import RunInfo, Sidecar
from harvest.store.snapshot import Sample, Snapshot, read_shard, sample_at, shard_path, shard_samples
from harvest.store.stats import RunningStats


class Run:
    """A run as its committed shards describe it. Built by `open_run`; `refresh()` re-reads the sidecars."""

    def __init__(self, storage: Storage, view: Snapshot):
        self.storage = storage
        self._set_view(view)
        # decoded shards by (stream, shard, generation, data object): a shard number names other bytes after an
        # --overwrite (a new generation) or a rerun's commit (another writer's object)
        self._cache: collections.OrderedDict[tuple, dict[str, np.ndarray]] = collections.OrderedDict()
        self._cache_lock = threading.Lock()

    def _set_view(self, view: Snapshot) -> None:
        self.view = view
        self._starts = {s: [sc.start for sc in view.of_stream(s)] for s in view.streams}
        self._full_index: dict[tuple[int, int], tuple[int, int]] | None = None

    def refresh(self) -> Run:
        """Pick up shards committed since open (a run still being written), or the run as an --overwrite left
        it (samples are read from the new shards)."""
        self._set_view(Snapshot.take(self.storage))
        return self

    # what the run holds ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def info(self) -> RunInfo:
        return self.view.info

    @property
    def tensors(self) -> dict[str, int]:
        return self.view.tensors

    @property
    def dtype(self) -> str:
        return self.view.dtype

    @property
    def num_streams(self) -> int:
        return int(self.info.data.get("num_streams") or 1)

    @property
    def streams(self) -> list[int]:
        """Streams with at least one committed shard."""
        return self.view.streams

    @property
    def shards(self) -> list[Sidecar]:
        """Sidecars of the committed shards, by (stream, shard)."""
        return list(self.view.shards)

    @property
    def num_samples(self) -> int:
        return self.view.num_samples

    @property
    def num_tokens(self) -> int:
        return self.view.num_tokens

    @property
    def num_bytes(self) -> int:
        return self.view.num_bytes

    def done(self, stream: int) -> bool:
        return self.view.done(stream)

    def shards_of(self, stream: int) -> list[Sidecar]:
        """Sidecars of one stream's committed shards, in order."""
        return self.view.of_stream(stream)

    def snapshot(self) -> dict[int, list]:
        """{stream: [committed shards, their generation]} now: give every rank the same one (JSON is fine;
        token_batches(snapshot=...)) when training on a run still being written, so that all ranks split the same
        shards (a rank whose stream was started over since is refused in one line)."""
        return self.view.shared()

    def __repr__(self) -> str:
        return (f"Run({self.url!r}: {len(self.tensors)} tensors, {len(self.streams)} streams, "
                f"{len(self.view.shards)} shards, {self.num_samples} samples, {self.num_tokens} tokens)")

    # shards and samples -----------------------------------------------------------------------------
    def shard_path(self, sidecar: Sidecar) -> str:
        return shard_path(sidecar)

    def read_shard(self, sidecar: Sidecar) -> dict[str, np.ndarray]:
        """All tensors of one committed shard (read and decoded, not cached)."""
        return read_shard(self.storage, sidecar)

    def _cached_shard(self, sidecar: Sidecar) -> dict[str, np.ndarray]:
        key = (sidecar.stream, sidecar.shard, sidecar.generation, sidecar.file)
        with self._cache_lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        tensors = self.read_shard(sidecar)
        with self._cache_lock:
            self._cache[key] = tensors
            while len(self._cache) > 2:
                self._cache.popitem(last=False)
        return tensors

    def _locate(self, sample_id: int, variant: int) -> Sidecar | None:
        """The sidecar whose [start, next) holds the piece, by the round-robin mapping (no shard read)."""
        stream, index = sample_id % self.num_streams, sample_id // self.num_streams
        starts = self._starts.get(stream)
        if not starts:
            return None
        k = bisect.bisect_right(starts, (index, variant)) - 1
        if k < 0:
            return None
        sc = self.view.of_stream(stream)[k]
        return sc if (index, variant) < tuple(sc.next) else None

    def _scan_index(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(sample_id, variant) -> (index in shards, row), reading every shard: for unknown mappings."""
        if self._full_index is None:
            index = {}
            for k, sc in enumerate(self.view.shards):
                t = self.read_shard(sc)
                for row, key in enumerate(zip(t["sample_ids"].tolist(), t["variants"].tolist())):
                    index[key] = (k, row)
            self._full_index = index
        return self._full_index

    def sample(self, sample_id: int, variant: int = 0) -> Sample:
        """One sample by its global id (its row in the source) and variant. KeyError if the run lacks it."""
        sample_id, variant = int(sample_id), int(variant)
        names = list(self.tensors)
        if self.info.data.get("mapping", "round_robin") == "round_robin":
            sc = self._locate(sample_id, variant)
            if sc is not None:
                t = self._cached_shard(sc)
                hits = np.flatnonzero((t["sample_ids"] == sample_id) & (t["variants"] == variant))
                if len(hits):
                    return sample_at(sc, t, names, int(hits[0]))
        else:
            found = self._scan_index().get((sample_id, variant))
            if found is not None:
                sc = self.view.shards[found[0]]
                return sample_at(sc, self._cached_shard(sc), names, found[1])
            sc = None
        skipped = sc.skipped if sc is not None else self._skipped_entries(sample_id)
        for entry in skipped:
            if int(entry.get("sample_id", -1)) == sample_id and int(entry.get("variant", variant)) == variant:
                raise KeyError(f"sample {sample_id} (variant {variant}) was skipped by the run: "
                               f"{entry.get('reason', 'no reason given')}"
                               + (f" ({entry['location']})" if entry.get("location") else ""))
        stream = sample_id % self.num_streams
        done = self.view.of_stream(stream)
        where = (f"stream {stream} is committed up to [index, variant] {list(done[-1].next)}" if done
                 else f"stream {stream} has no committed shard")
        raise KeyError(f"sample {sample_id} variant {variant} is not in run {self.url} ({where})")

    def _skipped_entries(self, sample_id: int) -> list[dict[str, Any]]:
        return [e for sc in self.view.shards for e in sc.skipped if int(e.get("sample_id", -1)) == sample_id]

    def iter_samples(self, streams: Sequence[int] | None = None) -> Iterator[Sample]:
        """Every committed sample, in (stream, index, variant) order; arrays are views into the shard."""
        wanted = None if streams is None else {int(s) for s in streams}
        for sc in self.view.shards:
            if sc.samples == 0 or (wanted is not None and sc.stream not in wanted):
                continue
            yield from self.shard_samples(sc)

    def shard_samples(self, sidecar: Sidecar) -> Iterator[Sample]:
        """The samples of one committed shard, in order (one read of the shard)."""
        return shard_samples(self.storage, sidecar, list(self.tensors))

    def stats(self, name: str) -> RunningStats:
        """Per-dimension count/mean/M2 over every committed token, merged from the sidecars (pairwise tree)."""
        self._check_names([name])
        return self.view.stats(name)

    def _check_names(self, names: Sequence[str]) -> list[str]:
        unknown = [n for n in names if n not in self.info.tensors]
        if unknown:
            raise UnknownTensorError(f"{', '.join(map(repr, unknown))} not in run {self.url}; it holds "
                                     f"{', '.join(self.info.tensors)}")
        return list(names)

    def _names(self, tensors: Sequence[str] | str | None) -> list[str]:
        return self._check_names([tensors] if isinstance(tensors, str) else list(tensors or self.tensors))

    # token batches ----------------------------------------------------------------------------------
    def token_batches(self, batch_size: int, tensors: Sequence[str] | str | None = None,
                      **settings: Any) -> TokenBatches:
        """Shuffled token rows of `tensors` (default: all) for SAE training, `batch_size` at a time, split over
        ranks and data-loader workers, resumable: the settings and their defaults are TokenBatches'
        (seed, epoch, epochs, rank, world, worker, workers, shuffle, shard_buffer, piece_bytes, prefetch,
        io_threads, drop_last, exclude, skip_first, max_norm, median_norm, dtype, normalize, verify, on_corrupt,
        as_torch, streams, snapshot)."""
        return TokenBatches(self.storage, self.view, batch_size, self._names(tensors), **settings)

    def median_norms(self, tensors: Sequence[str] | str | None = None, *, streams: Sequence[int] | None = None,
                     exclude: Sequence[int] | None = None) -> dict[str, float]:
        """{tensor: median token L2 norm} as token_batches(max_norm=R) takes it (harvest.read.batches.median_norms:
        a seeded sample of the streams read, the same numbers on every rank and rerun)."""
        return median_norms(self.storage, self.view, self._names(tensors), streams=streams, exclude=exclude)

    def torch_dataset(self, batch_size: int, tensors: Sequence[str] | str | None = None, **kwargs: Any):
        """A torch IterableDataset of batches (use DataLoader(ds, batch_size=None, num_workers=k)). It holds
        this Run's snapshot (or the one given as snapshot=), so all its workers split the same shards, in
        every epoch; make a new dataset to read shards committed since."""
        from harvest.read.torch_data import TokenDataset

        return TokenDataset(self.url, self.view, batch_size, self._names(tensors), kwargs)

    def jax_batches(self, batch_size: int, tensors: Sequence[str] | str | None = None, *, mesh: Any,
                    data_axes: Sequence[str] = ("data",), **kwargs: Any) -> Iterator[dict[str, Any]]:
        """Global JAX arrays of `batch_size` rows sharded over the mesh's `data_axes`, for any mesh: the
        processes that hold the same rows read the same ones (harvest.read.jax_data)."""
        from harvest.read.jax_data import global_batches

        return global_batches(self.storage, self.view, batch_size, self._names(tensors), mesh, tuple(data_axes),
                              kwargs)


def open_run(url: str | Storage) -> Run:
    """Open a run for reading: run.json and every committed shard's sidecar (shard data is read on demand)."""
    storage = url if isinstance(url, Storage) else Storage(str(url))
    return Run(storage, Snapshot.take(storage))
