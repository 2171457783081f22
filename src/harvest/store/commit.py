"""The commit protocol: a shard's data object is written under a name no other writer uses (it carries the
attempt's id), then the shard is committed by creating its sidecar only if absent (`Storage.create_exclusive`).
A writer whose create fails has lost the stream to whoever committed that shard first: it stops writing it.
So each stream's sidecars form one contiguous chain, every sample is committed once, and a sidecar always
names a data object that exists, whatever the timing of the writers, their clocks and their flags.
Data objects no sidecar names are leftovers: `sweep` deletes those that can never be committed.

`--overwrite` empties a stream under its lease (`wipe`), by one rule: a wipe deletes a stream's sidecars but
no data object that a writer could still commit: on object storage none (a create whose request lands late
may commit any of them again), on local disk none but those the sidecars named (their writers are done with
them). A stalled or fenced writer (stopped between its last lease check and its create) thus never creates a
sidecar naming a deleted object, and what it commits late is a shard computed with the same settings (a
partial overwrite keeps run.json); `sweep` deletes the other objects once their shard is committed to another
object or lies past the stream's final shard. A stream the new run.json no longer names (a full overwrite with
fewer streams) is deleted whole: no reader of the run looks there.

`Committer` encodes and commits closed shards on background threads, in order within a stream, through
bounded queues (when storage falls behind the producer waits; nothing is dropped); a shard's data object
is written as soon as it closes, beside the stream's earlier ones (each has its own name: writing commits
nothing), and its sidecar is created in order. `ResumePoint` says where each stream stands after its chain
of committed shards (harvest.store.listing.read_chain, strict: the one reader of committed state).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import queue
import signal
import threading
import time
from typing import Any, Callable

import numpy as np

from harvest.errors import FencedOut, UserError
from harvest.store import format as fmt
from harvest.storage import Storage
from harvest.store.format import sidecar_name
from harvest.store.listing import read_chain
from harvest.store.records import Sidecar


class CommitLost(FencedOut):
    """Another writer committed this shard first (exit 3): this one stops writing the stream."""


@dataclasses.dataclass
class ResumePoint:
    """Where a stream stands after its committed shards (all zeros for a fresh stream)."""

    shard: int = 0  # next shard number
    next: fmt.Position = (0, 0)
    row_start: fmt.Position = (0, 0)
    samples: int = 0
    tokens: int = 0
    done: bool = False

    @classmethod
    def after(cls, chain: list[Sidecar]) -> ResumePoint:
        if not chain:
            return cls()
        last = chain[-1]
        return cls(shard=len(chain), next=last.next, row_start=last.row_start,
                   samples=sum(sc.samples for sc in chain), tokens=sum(sc.tokens for sc in chain), done=last.final)


@dataclasses.dataclass
class ClosedShard:
    stream: int
    shard: int
    tensors: dict[str, list[np.ndarray]]  # each tensor's blocks of rows in order (at least one, maybe empty)
    tokens: np.ndarray
    lengths: np.ndarray
    sample_ids: np.ndarray
    variants: np.ndarray
    start: fmt.Position
    next: fmt.Position
    row_start: fmt.Position
    skipped: list[dict[str, Any]]
    long: dict[str, int]
    final: bool
    records: int
    # Per tensor, each block's (means, M2s) from the device (harvest.model.moments; None: the host computes it).
    # Tensors without moments (a quantized tensor's scales) have no stats.
    moments: dict[str, tuple[list, list]]
    first_stats: dict[str, fmt.RunningStats] | None = None  # of each sample's first token, per tensor
    quantization: dict | None = None  # harvest.store.quant.record, where the tensors are 8-bit codes


@dataclasses.dataclass
class _Encoded:
    """A closed shard on its way to storage: its file's parts, and its checksums and stats being computed."""

    shard: ClosedShard
    parts: list
    tensor_digests: dict[str, concurrent.futures.Future]
    stats: dict[str, concurrent.futures.Future]
    written: concurrent.futures.Future


def resume_point(storage: Storage, stream: int) -> ResumePoint:
    """The stream's state after its contiguous run of committed shards from shard 0."""
    return ResumePoint.after(read_chain(storage, stream))


def leftovers(names: list[str], chain: list[Sidecar]) -> list[str]:
    """The data objects among `names` (a stream directory's listing) that no sidecar names and none ever
    can: their shard is committed to another object, or lies past the stream's final shard. An object of
    a shard not committed yet may still be committed by a writer in flight: it is not one of them."""
    done = bool(chain) and chain[-1].final
    out = []
    for name in names:
        shard = fmt.data_file_shard(name)
        if shard is not None and ((shard < len(chain) and name != chain[shard].file) or (done and shard >= len(chain))):
            out.append(name)
    return out


def sweep(storage: Storage, stream: int) -> list[Sidecar]:
    """Delete the stream's leftovers (see `leftovers`); returns its chain. The directory is listed before the
    chain is read, so a data object listed is judged by sidecars at least as new as itself: a wipe and new
    commits meanwhile (another writer's --overwrite) never make a newly committed object look like a leftover."""
    directory = fmt.stream_dir(stream)
    names = storage.listdir(directory)
    chain = read_chain(storage, stream)
    storage.delete_many(f"{directory}/{name}" for name in leftovers(names, chain))
    return chain


def wipe(storage: Storage, stream: int, guard: Callable[[int], None], *, keep: set[str], whole: bool = False) -> None:
    """Empty `stream` for --overwrite, by the rule of the module docstring: its sidecars first (no committed
    shard is ever left without its data), then its other records (progress) and, on local disk, the data
    objects the sidecars named, keeping the names in `keep` (its lease, held by the caller). `guard(stream)`
    runs before each delete and confirms the lease (`Leases.confirm`): a wiper that lost the stream deletes
    nothing more, and a delete sent has the lease's whole TTL to land before anyone else may take the stream.
    `whole`: the stream leaves the run, so its whole directory goes."""
    directory = fmt.stream_dir(stream)
    names = storage.listdir(directory)
    sidecars = [name for name in names if fmt.sidecar_shard(name) is not None]
    named = set()
    for name in sidecars if storage.is_local else []:
        try:
            named.add(Sidecar.from_bytes(storage.read_bytes(f"{directory}/{name}")).file)
        except ValueError:
            pass  # not a sidecar: it commits nothing
    guard(stream)
    storage.delete_many(f"{directory}/{name}" for name in sidecars)
    guard(stream)
    if whole:
        storage.delete_tree(directory)
        return
    storage.delete_many(f"{directory}/{name}" for name in names if name not in keep and name not in sidecars
                        and (fmt.data_file_shard(name) is None or name in named))


def commit(storage: Storage, sidecar: Sidecar, data: bytes | list | None, guard: Callable[[int], None]) -> None:
    """Write `data` as the object `sidecar` names (None: written already, by `write_data`), then commit it by
    creating the sidecar only if absent. Raises CommitLost when another writer committed the shard first (this
    one's object is deleted)."""
    directory = fmt.stream_dir(sidecar.stream)
    if data is not None:
        write_data(storage, sidecar.stream, sidecar.file, data, guard)
    guard(sidecar.stream)
    _test_stop_before_commit(sidecar.stream, sidecar.shard)
    if storage.create_exclusive(f"{directory}/{sidecar_name(sidecar.shard)}", sidecar.to_bytes()):
        return
    try:
        storage.delete(f"{directory}/{sidecar.file}")
    except UserError:
        pass  # a leftover: the stream's next holder deletes it
    raise CommitLost(f"stream {sidecar.stream}: shard {sidecar.shard} was committed by another writer first (one "
                     "that took the stream over, or one that lost it and had not stopped yet); this worker stopped "
                     "writing the stream and its copy was not committed")


def write_data(storage: Storage, stream: int, file: str, data: bytes | list, guard: Callable[[int], None]) -> None:
    """Write a shard's data object (`file`, a name only this attempt writes), once `guard` confirms the lease."""
    guard(stream)
    storage.write_bytes(f"{fmt.stream_dir(stream)}/{file}", data)


def _test_stop_before_commit(stream: int, shard: int) -> None:
    """Fault injection for tests, after the last lease check and before the commit of one shard:
    HARVEST_TEST_STOP_BEFORE_COMMIT=STREAM:SHARD stops this process (SIGSTOP), as a stalled VM would;
    STREAM:SHARD:SECONDS holds just this commit that long (a slow write; the heartbeats go on)."""
    spec = os.environ.get("HARVEST_TEST_STOP_BEFORE_COMMIT", "").split(":")
    if spec[:2] != [str(stream), str(shard)]:
        return
    if len(spec) == 3:
        time.sleep(float(spec[2]))
    else:
        os.kill(os.getpid(), signal.SIGSTOP)


class Committer:
    """Background threads that encode and commit shards; stream s always goes to thread s % threads.

    `attempt` names this writer's data objects. `guard(stream)` runs before each write of a stream and raises
    when this worker may no longer write it (its lease lost: see harvest.store.lease). `on_commit(manifest)`
    runs after each commit (on the committing thread): progress bookkeeping. `on_lost(stream, error)` runs
    when another writer committed a shard of the stream first. `checksum`: the sidecars' algorithm
    (format.CHECKSUMS; default format.default_checksum()).
    """

    def __init__(self, storage: Storage, on_commit: Callable[[Sidecar], None] | None = None, *, attempt: str,
                 guard: Callable[[int], None] | None = None,
                 on_lost: Callable[[int, UserError], None] | None = None, threads: int = 4, depth: int = 2,
                 checksum: str | None = None):
        self.storage = storage
        self.attempt = attempt
        self.checksum = checksum or fmt.default_checksum()
        # A shard's stats and checksums (per tensor: one pass over its bytes, the file's digest derived from
        # them) run here, beside its data write: one stream's shards use every core this process may run on
        # (its affinity, as a container or taskset limits it), not one (numpy, hashlib and xxhash let go of
        # the GIL).
        self._work = concurrent.futures.ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0)),
                                                           thread_name_prefix="commit-work")
        # Data objects are written as soon as their shard closes, several at a time (each has its own name),
        # and committed in order by the stream's thread: one stream's writes and fsyncs overlap.
        self._writes = concurrent.futures.ThreadPoolExecutor(max_workers=max(2, len(os.sched_getaffinity(0))),
                                                             thread_name_prefix="commit-write")
        self.on_commit = on_commit or (lambda manifest: None)
        self.guard = guard or (lambda stream: None)
        self.on_lost = on_lost or (lambda stream, error: None)
        self.failure: BaseException | None = None
        self._queues = [queue.Queue(maxsize=depth) for _ in range(threads)]
        self._threads = [threading.Thread(target=self._run, args=(q,), daemon=True, name=f"commit-{i}")
                         for i, q in enumerate(self._queues)]
        for thread in self._threads:
            thread.start()
    def submit(self, shard: ClosedShard) -> None:
        """Starts the shard's checksums, stats and data write at once, so that a stream's next shards are hashed
        and written while this one commits (sidecars are created one after another; the rest need not be).
        Blocks while that thread's queue is full (storage behind): compute waits, nothing is dropped."""
        q = self._queues[shard.stream % len(self._queues)]
        encoded = self._encode(shard)
        while True:
            self.check()
            try:
                q.put(encoded, timeout=0.5)
                return
            except queue.Full:
                continue

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self) -> None:
        """Wait for every submitted shard to be committed; re-raise a writer's failure."""
        for q in self._queues:
            q.put(None)
        for thread in self._threads:
            thread.join()
        self._work.shutdown()
        self._writes.shutdown()
        self.check()

    def _run(self, q: queue.Queue) -> None:
        while (encoded := q.get()) is not None:
            if self.failure is not None:
                continue  # drain: the run is failing, the main thread will raise
            try:
                self._commit(encoded)
            except BaseException as e:  # surfaced to the main thread by check()
                self.failure = self._cause(encoded.shard.stream, e)

    def _cause(self, stream: int, error: BaseException) -> BaseException:
        """A write that failed because this worker lost the stream (the new holder cleared its temp files,
        say) fails for that reason: the guard's error names the holder. A lost commit is its own reason."""
        if isinstance(error, CommitLost):
            return error
        try:
            self.guard(stream)
        except Exception as lost:
            return lost
        return error

    def _encode(self, shard: ClosedShard) -> _Encoded:
        parts = fmt.shard_parts(
            shard.tensors, shard.tokens, shard.lengths, shard.sample_ids, shard.variants,
            metadata={"stream": str(shard.stream), "shard": str(shard.shard)},
        )
        return _Encoded(shard, parts,
                        {name: self._work.submit(fmt.digest, blocks, self.checksum)
                         for name, blocks in fmt.tensor_parts(parts).items()},
                        {name: self._work.submit(fmt.RunningStats.of_pieces, blocks, *shard.moments[name])
                         for name, blocks in shard.tensors.items() if name in shard.moments},
                        self._writes.submit(write_data, self.storage, shard.stream,
                                            fmt.shard_file(shard.shard, self.attempt), parts, self.guard))

    def _commit(self, encoded: _Encoded) -> None:
        shard, parts = encoded.shard, encoded.parts
        tensors = {name: future.result() for name, future in encoded.tensor_digests.items()}
        manifest = Sidecar.of_shard(
            parts, checksum=self.checksum, digests=(fmt.file_digest(parts, tensors, self.checksum), tensors),
            stream=shard.stream, shard=shard.shard, attempt=self.attempt,
            start=shard.start, next=shard.next, row_start=shard.row_start, samples=len(shard.lengths),
            tokens=int(shard.lengths.sum()), stats={name: future.result() for name, future in encoded.stats.items()},
            skipped=shard.skipped, long=shard.long, final=shard.final, records=shard.records,
            quantization=shard.quantization,
            first_stats=None if shard.first_stats is None else {n: s.to_json() for n, s in shard.first_stats.items()},
        )
        encoded.written.result()
        try:
            commit(self.storage, manifest, None, self.guard)
        except CommitLost as e:
            self.on_lost(shard.stream, e)
            raise
        self.guard(shard.stream)
        self.on_commit(manifest)
        if shard.final:  # what writers that lost the stream left behind, now that none of it can be committed
            sweep(self.storage, shard.stream)
