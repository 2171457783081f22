"""Read a run back: run.json, committed shards, per-sample access, merged stats, shuffled token batches.

```python
run = harvest.open("gs://bucket/run")            # reads run.json and every sidecar, nothing else
run.tensors                                       # {"resid_post.20": 3584, ...}
s = run.sample(1234, variant=0)                   # Sample(sample_id, variant, tokens, activations)
run.stats("resid_post.20").mean                   # exact merge of the shards' fp64 running stats
for batch in run.token_batches(4096, ["resid_post.20"], seed=0, epochs=None):   # SAE training rows
    ...
```
Only committed shards exist: a shard is read when its sidecar (`shard_NNNNNN.json`) is there, whatever
else lies in the stream directory. All I/O goes through `Storage`; shards are decoded with safetensors
from bytes (no pickle, nothing eval'd), or for token batches read as the byte ranges of the tensors asked
for (store/batches.py: order, split, resume; store/layout.py: where each tensor lies).
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import re
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ml_dtypes
import numpy as np

from harvest.errors import UserError
from harvest.store import format as fmt
from harvest.store.batches import TokenBatches, UnknownTensorError
from harvest.storage import Storage
from harvest.store.records import RunInfo, Sidecar

STREAM_DIR = re.compile(r"^stream_(\d{5})$")
SIDECAR = re.compile(r"^shard_(\d{6})\.json$")
SHARD_FILE = re.compile(r"^shard_(\d{6})\.safetensors$")
SHARD_ARRAYS = ("tokens", "offsets", "sample_ids", "variants")  # the non-activation tensors of a shard
_IO_THREADS = 16

def dtype_name(arr: np.ndarray) -> str:
    """The run.json name of an array's dtype ("bfloat16", "float16", "float32"), else numpy's name."""
    for name, dtype in fmt.DTYPES.items():
        if arr.dtype == np.dtype(dtype):
            return name
    return arr.dtype.name


def position(p: Sequence[int]) -> tuple[int, int]:
    return int(p[0]), int(p[1])


def covered_streams(info: RunInfo) -> list[int]:
    """The streams a run covers, from run.json's data section (`streams` if listed, else all num_streams)."""
    data = info.data
    if data.get("streams") is not None:
        return sorted(int(s) for s in data["streams"])
    return list(range(int(data.get("num_streams") or 1)))


def stream_count(info: RunInfo, stream: int) -> int | None:
    """Records in a stream per run.json (None when the source's length is unknown)."""
    counts = info.data.get("counts")
    if counts is None:
        return None
    if isinstance(counts, dict):
        value = counts.get(str(stream), counts.get(stream))
        return None if value is None else int(value)
    return int(counts[stream]) if stream < len(counts) else None


def list_sidecars(storage: Storage, stream: int) -> list[str]:
    """Sidecar file names of a stream, in shard order."""
    return [n for n in storage.listdir(fmt.stream_dir(stream)) if SIDECAR.match(n)]


def list_stream_dirs(storage: Storage) -> list[int]:
    return sorted(int(m.group(1)) for m in map(STREAM_DIR.match, storage.listdir("")) if m)


def read_run_info(storage: Storage) -> RunInfo:
    if not storage.exists("run.json"):
        raise UserError(f"{storage.url}: no run.json here, so not a harvest run; check the URL "
                        f"(a run writes run.json before its first shard)")
    try:
        info = RunInfo.from_bytes(storage.read_bytes("run.json"))
    except UserError as e:  # StorageError names the file already
        raise UserError(f"{e}; the run's metadata is damaged") from None
    except ValueError as e:
        raise UserError(f"{storage.url}/run.json: not a harvest run.json ({e})") from None
    if info.format_version > fmt.FORMAT_VERSION:
        raise UserError(f"{storage.url}/run.json: format_version {info.format_version} is newer than this "
                        f"harvest reads ({fmt.FORMAT_VERSION}); upgrade harvest")
    return info


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sample (a record, or one variant of it): its tokens and every captured tensor, [n_tokens, d]."""

    sample_id: int
    variant: int
    tokens: np.ndarray
    activations: dict[str, np.ndarray]
    stream: int = -1
    shard: int = -1

    def __len__(self) -> int:
        return len(self.tokens)


class Run:
    """A run as its committed shards describe it. Built by `open_run`; `refresh()` re-reads the sidecars."""

    def __init__(self, storage: Storage, info: dict[str, Any], sidecars: list[dict[str, Any]]):
        self.storage = storage
        self.info = info
        self._set_shards(sidecars)
        self._cache: collections.OrderedDict[tuple[int, int], dict[str, np.ndarray]] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._full_index: dict[tuple[int, int], tuple[int, int]] | None = None

    def _set_shards(self, sidecars: list[dict[str, Any]]) -> None:
        self._shards = sorted(sidecars, key=lambda sc: (sc.stream, sc.shard))
        self._by_stream: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
        for sc in self._shards:
            self._by_stream[sc.stream].append(sc)
        self._starts = {s: [position(sc.start) for sc in scs] for s, scs in self._by_stream.items()}
        self._full_index = None

    def refresh(self) -> Run:
        """Pick up shards committed since open (a run still being written)."""
        self._set_shards(_read_sidecars(self.storage, self.info))
        return self

    # what the run holds ---------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.storage.url

    @property
    def tensors(self) -> dict[str, int]:
        return {name: int(width) for name, width in self.info.tensors.items()}

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def num_streams(self) -> int:
        return int(self.info.data.get("num_streams") or 1)

    @property
    def streams(self) -> list[int]:
        """Streams with at least one committed shard."""
        return sorted(self._by_stream)

    @property
    def shards(self) -> list[dict[str, Any]]:
        """Sidecars of the committed shards, by (stream, shard)."""
        return list(self._shards)

    @property
    def num_samples(self) -> int:
        return sum(sc.samples for sc in self._shards)

    @property
    def num_tokens(self) -> int:
        return sum(sc.tokens for sc in self._shards)

    @property
    def num_bytes(self) -> int:
        return sum(sc.bytes for sc in self._shards)

    def done(self, stream: int) -> bool:
        scs = self._by_stream.get(stream)
        return bool(scs) and scs[-1].final

    def __repr__(self) -> str:
        return (f"Run({self.url!r}: {len(self.tensors)} tensors, {len(self.streams)} streams, "
                f"{len(self._shards)} shards, {self.num_samples} samples, {self.num_tokens} tokens)")

    # shards -----------------------------------------------------------------------------------------
    def shard_path(self, sidecar: dict[str, Any]) -> str:
        name = sidecar.file
        return f"{fmt.stream_dir(sidecar.stream)}/{name}"

    def read_shard(self, sidecar: dict[str, Any]) -> dict[str, np.ndarray]:
        """All tensors of one committed shard (read and decoded, not cached)."""
        rel = self.shard_path(sidecar)
        data = self.storage.read_bytes(rel)
        try:
            return fmt.decode_shard(data)
        except ValueError as e:
            raise UserError(f"{self.url}/{rel}: {e}; run `harvest verify {self.url}`") from None

    def _cached_shard(self, sidecar: dict[str, Any]) -> dict[str, np.ndarray]:
        key = (sidecar.stream, sidecar.shard)
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

    # samples ----------------------------------------------------------------------------------------
    def _locate(self, sample_id: int, variant: int) -> dict[str, Any] | None:
        """The sidecar whose [start, next) holds the piece, by the round-robin mapping (no shard read)."""
        n = self.num_streams
        stream, index = sample_id % n, sample_id // n
        starts = self._starts.get(stream)
        if not starts:
            return None
        k = bisect.bisect_right(starts, (index, variant)) - 1
        if k < 0:
            return None
        sc = self._by_stream[stream][k]
        return sc if (index, variant) < position(sc.next) else None

    def _scan_index(self) -> dict[tuple[int, int], tuple[int, int]]:
        """(sample_id, variant) -> (position in self._shards, row), reading every shard: for unknown mappings."""
        if self._full_index is None:
            index = {}
            for k, sc in enumerate(self._shards):
                t = self.read_shard(sc)
                for row, key in enumerate(zip(t["sample_ids"].tolist(), t["variants"].tolist())):
                    index[key] = (k, row)
            self._full_index = index
        return self._full_index

    def sample(self, sample_id: int, variant: int = 0) -> Sample:
        """One sample by its global id (its row in the source) and variant. KeyError if the run lacks it."""
        sample_id, variant = int(sample_id), int(variant)
        if self.info.data.get("mapping", "round_robin") == "round_robin":
            sc = self._locate(sample_id, variant)
            if sc is not None:
                t = self._cached_shard(sc)
                hits = np.flatnonzero((t["sample_ids"] == sample_id) & (t["variants"] == variant))
                if len(hits):
                    return self._sample_at(sc, t, int(hits[0]))
        else:
            found = self._scan_index().get((sample_id, variant))
            if found is not None:
                sc = self._shards[found[0]]
                return self._sample_at(sc, self._cached_shard(sc), found[1])
            sc = None
        skipped = sc.skipped if sc is not None else self._skipped_entries(sample_id)
        for entry in skipped:
            if int(entry.get("sample_id", -1)) == sample_id and int(entry.get("variant", variant)) == variant:
                raise KeyError(f"sample {sample_id} (variant {variant}) was skipped by the run: "
                               f"{entry.get('reason', 'no reason given')}"
                               + (f" ({entry['location']})" if entry.get("location") else ""))
        stream = sample_id % self.num_streams
        done = self._by_stream.get(stream)
        where = (f"stream {stream} is committed through position {list(done[-1].next)}" if done
                 else f"stream {stream} has no committed shard")
        raise KeyError(f"sample {sample_id} variant {variant} is not in run {self.url} ({where})")

    def _skipped_entries(self, sample_id: int) -> list[dict[str, Any]]:
        return [e for sc in self._shards for e in sc.skipped if int(e.get("sample_id", -1)) == sample_id]

    def _sample_at(self, sc: dict[str, Any], t: dict[str, np.ndarray], row: int) -> Sample:
        lo, hi = int(t["offsets"][row]), int(t["offsets"][row + 1])
        return Sample(
            sample_id=int(t["sample_ids"][row]), variant=int(t["variants"][row]), tokens=t["tokens"][lo:hi],
            activations={name: t[name][lo:hi] for name in self.tensors}, stream=sc.stream,
            shard=sc.shard)

    def iter_samples(self, streams: Sequence[int] | None = None) -> Iterator[Sample]:
        """Every committed sample, in (stream, position) order; arrays are views into the shard."""
        wanted = None if streams is None else {int(s) for s in streams}
        for sc in self._shards:
            if sc.samples == 0 or (wanted is not None and sc.stream not in wanted):
                continue
            yield from self.shard_samples(sc)

    def shard_samples(self, sidecar: dict[str, Any]) -> Iterator[Sample]:
        """The samples of one committed shard, in order (one read of the shard)."""
        t = self.read_shard(sidecar)
        for row in range(len(t["sample_ids"])):
            yield self._sample_at(sidecar, t, row)

    # stats ------------------------------------------------------------------------------------------
    def stats(self, name: str) -> fmt.RunningStats:
        """Per-dimension count/mean/M2 over every committed token, merged from the sidecars (pairwise tree)."""
        self._check_names([name])
        width = self.tensors[name]
        parts = []
        for sc in self._shards:
            entry = sc.stats.get(name)
            if entry is None:
                if sc.tokens == 0:
                    continue
                raise UserError(f"{self.url}/{fmt.stream_dir(sc.stream)}/{fmt.shard_stem(sc.shard)}"
                                f".json: no stats for {name}; run `harvest verify {self.url}`")
            parts.append(fmt.RunningStats.from_json(entry))
        if not parts:
            return fmt.RunningStats(0, np.zeros(width), np.zeros(width))
        while len(parts) > 1:  # pairwise: rounding grows with log(shards), not shards
            parts = [parts[i].merge(parts[i + 1]) if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
        return parts[0]

    def _check_names(self, names: Sequence[str]) -> list[str]:
        unknown = [n for n in names if n not in self.info.tensors]
        if unknown:
            raise UnknownTensorError(f"{', '.join(map(repr, unknown))} not in run {self.url}; it holds "
                           f"{', '.join(self.info.tensors)}")
        return list(names)

    # SAE training batches -----------------------------------------------------------------------------
    def shards_of(self, stream: int) -> list[dict[str, Any]]:
        """Sidecars of one stream's committed shards, in order."""
        return list(self._by_stream.get(stream, []))

    def snapshot(self) -> dict[int, int]:
        """{stream: committed shards} now: give every rank the same one (token_batches(snapshot=...)) when
        training on a run still being written, so that all ranks split the same shards."""
        return {s: len(scs) for s, scs in self._by_stream.items()}

    def token_batches(
        self,
        batch_size: int,
        tensors: Sequence[str] | str | None = None,
        *,
        seed: int = 0,
        epoch: int = 0,
        epochs: int | None = 1,
        rank: int = 0,
        world: int = 1,
        worker: int | None = None,
        workers: int | None = None,
        shuffle: bool = True,
        shard_buffer: int = 16,
        piece_bytes: int = 32 * 2**20,
        prefetch: int = 8,
        io_threads: int = 8,
        drop_last: bool = False,
        exclude: Sequence[int] | None = None,
        dtype: str | None = None,
        normalize: str | None = None,
        verify: str = "auto",
        on_corrupt: str = "stop",
        as_torch: bool = False,
        streams: Sequence[int] | None = None,
        snapshot: dict[int, int] | None = None,
    ) -> TokenBatches:
        """Token rows for SAE training: {name: [batch, d], "tokens": [batch]}, numpy (or torch with as_torch).

        Order (store/shuffle.py): shards are cut into pieces of about `piece_bytes` of the tensors asked for;
        the pieces are permuted per (seed, epoch), dealt to rank `rank` of `world` hosts and then to data-loader
        workers (found by themselves inside a torch DataLoader, or given as worker/workers), and each
        consumer mixes the rows of `shard_buffer` pieces at a time. Memory: about (shard_buffer + prefetch)
        pieces. Over an epoch every committed token (less `exclude`, by default the run's special tokens)
        is served once across all consumers; the last batch is short unless drop_last. `epochs=None`
        repeats for ever, each epoch in a new order, picking up shards committed meanwhile; `snapshot`
        (from `Run.snapshot()`, the same on every rank) pins the shards instead: ranks that list a run still
        being written at different moments would otherwise split different sets.
        `dtype` casts on the way out; `normalize` ("standardize": per dimension, "norm": E||x||^2 = d)
        uses the run's own stats. `verify`, `on_corrupt`: see store/batches.py.
        The result is an iterable with state_dict()/load_state_dict() for resuming mid-epoch.
        """
        names = self._check_names([tensors] if isinstance(tensors, str) else list(tensors or self.tensors))
        return TokenBatches(
            self, batch_size, names, seed=seed, shuffle=shuffle, buffer=shard_buffer, piece_bytes=piece_bytes,
            rank=rank, world=world, worker=worker, workers=workers, exclude=exclude, streams=streams,
            snapshot=snapshot, epoch=epoch, epochs=epochs, drop_last=drop_last, dtype=dtype, normalize=normalize,
            verify=verify, on_corrupt=on_corrupt, prefetch=prefetch, io_threads=io_threads,
            convert=_torch_converter() if as_torch else (lambda a: a))

    def torch_dataset(self, batch_size: int, tensors: Sequence[str] | str | None = None, **kwargs: Any):
        """A torch IterableDataset of batches (use DataLoader(ds, batch_size=None, num_workers=k)): each
        worker reopens the run and reads its own share."""
        from harvest.store.torch_data import TokenDataset

        self._check_names([tensors] if isinstance(tensors, str) else list(tensors or self.tensors))
        return TokenDataset(self.url, batch_size, tensors, kwargs)

    def jax_batches(self, batch_size: int, tensors: Sequence[str] | str | None = None, *, mesh: Any,
                    data_axes: Sequence[str] = ("data",), **kwargs: Any) -> Iterator[dict[str, Any]]:
        """Global JAX arrays of `batch_size` rows sharded over the mesh's `data_axes`: this host reads its
        own share (rank = process index) for its own devices."""
        from harvest.store.jax_data import global_batches

        return global_batches(self, batch_size, tensors, mesh, tuple(data_axes), kwargs)


def _torch_converter():
    try:
        import torch
    except ImportError:
        raise UserError("token_batches(as_torch=True) needs torch: pip install torch") from None

    def convert(arr: np.ndarray):
        arr = np.ascontiguousarray(arr)
        if arr.dtype == np.dtype(ml_dtypes.bfloat16):
            return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(arr)

    return convert


def _read_sidecars(storage: Storage, info: RunInfo) -> list[Sidecar]:
    paths = [f"{fmt.stream_dir(s)}/{name}" for s in list_stream_dirs(storage) for name in list_sidecars(storage, s)]

    def read(rel: str) -> Sidecar:
        try:
            return Sidecar.from_bytes(storage.read_bytes(rel))
        except UserError as e:  # StorageError names the file already
            raise UserError(f"{e}; run `harvest verify {storage.url}`") from None
        except ValueError as e:
            raise UserError(f"{storage.url}/{rel}: not a shard sidecar ({e}); run `harvest verify {storage.url}`") from None

    if len(paths) <= 1:
        return [read(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(_IO_THREADS, len(paths))) as pool:
        return list(pool.map(read, paths))


def open_run(url: str | Storage) -> Run:
    """Open a run for reading: run.json and every committed shard's sidecar (shard data is read on demand)."""
    storage = url if isinstance(url, Storage) else Storage(str(url))
    info = read_run_info(storage)
    return Run(storage, info, _read_sidecars(storage, info))
