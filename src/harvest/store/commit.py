"""The commit protocol: a shard's data object is written under a name no other writer uses (it carries the
attempt's id), then the shard is committed by creating its sidecar only if absent (`Storage.create_exclusive`).
A writer whose create fails reads the sidecar that won: where it no longer holds the lease it stops (exit 3);
where it still holds it (the winner was a writer that stalled past its last lease check and woke after the
takeover), it goes on from that shard if it commits the same range (shards are deterministic), else stops
retryably (exit 75). So each stream's sidecars form one contiguous chain, every sample is committed once, a
sidecar always names a data object that exists, and no wake order stops the stream's holder for good, whatever
the timing of the writers, their clocks and their flags.
Data objects no sidecar names are leftovers: `sweep` deletes those that can never be committed.

`--overwrite` empties a stream by one rule: a wipe starts a new generation of the stream, and no writer,
reader or sweep ever uses another generation's objects than the one it started in. The generation a writer
writes is named in the stream's lease, changed by a compare-and-swap from the version the wiper holds (so it
lands only while the wiper holds the stream); every writer commits into the generation its lease named when it
took the stream, in that generation's own directory (harvest.store.format.shard_dir). Readers read the one the
stream's generation pointer names (generation.json, which no lease operation can lose: harvest.store.generation):
a wipe reads the pointer, swaps the lease, swaps the pointer from the version it read, and only then deletes the
ended generations; a taker reconciles the pointer with the lease it took before it writes.
So a writer stalled across any sweeps and wipes can only create sidecars in a generation no reader reads, no
deleted name is ever created again in the current generation, and a delete landing however late deletes
objects of an ended generation only: a wipe deletes the generations the lease records as ended, sweep only
data objects of its own generation whose shard is committed to another object or lies past the stream's final
shard. A stream the new run.json no longer names (a full overwrite with fewer streams) is deleted whole after
its generation is ended and its heartbeat stopped: no reader of the run looks there (its lease goes too, the
one delete not confined to ended generations: it would matter only to a later overwrite adding the stream back
while it is in flight); a later extract of the whole run finishes a drop that was interrupted.

`Committer` encodes and commits closed shards on background threads, in order within a stream, through
bounded queues (when storage falls behind the producer waits; nothing is dropped); a shard's data object
is written as soon as it closes, beside the stream's earlier ones (each has its own name: writing commits
nothing), and its sidecar is created in order. `ResumePoint` says where each stream stands after its chain
of committed shards (harvest.store.listing.read_chain, strict: the one reader of committed state).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import queue
import signal
import threading
import time
import uuid
from typing import Any, Callable

import numpy as np

from harvest.errors import FencedOut, RetryLater, UserError
from harvest.store import encoding, format as fmt, generation as pointer
from harvest.storage import Storage
from harvest.store.listing import read_chain, read_sidecar
from harvest.store.lease import Leases
from harvest.store.records import GenerationRecord, Sidecar
from harvest.store.stats import RunningStats


ABORT_WAIT_S = 30.0  # how long a failing run waits for its commit in flight and its discards (Committer.abort)


def abandoned_at_stop() -> RetryLater:
    """A stop (SIGTERM) whose commits in flight did not end by its deadline."""
    return RetryLater("stopped on SIGTERM: a commit still in flight at the deadline was abandoned (the stream's next "
                      "holder commits that shard again), the leases released; rerun the same command to resume")


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
    first_stats: dict[str, RunningStats] | None = None  # of each sample's first token, per tensor
    quantization: dict | None = None  # harvest.store.quant.record, where the tensors are 8-bit codes
    source_digest: str | None = None  # the stream's content pin through the shard (harvest.data.pin)


@dataclasses.dataclass
class _Encoded:
    """A closed shard on its way to storage: its file's parts, its checksums and stats being computed, and its
    data object being written in `generation` (the stream's when the shard closed: its sidecar's too)."""

    shard: ClosedShard
    parts: list
    generation: str
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


def sweep(storage: Storage, stream: int, generation: str, guard: Callable[[int], None] | None = None
          ) -> list[Sidecar]:
    """Delete the leftovers of the stream's `generation` (see `leftovers`); returns its chain. The directory is
    listed before the chain is read, so a data object listed is judged by sidecars at least as new as itself;
    within a generation no sidecar is ever deleted, so no object deleted here is ever named by one. A chain that
    cannot be read fails for the reason `guard(stream)` gives first: a wipe that ended the generation meanwhile
    deletes it under a lease this worker lost."""
    directory = fmt.shard_dir(stream, generation)
    try:
        names = storage.listdir(directory)
        chain = read_chain(storage, stream, generation)
    except UserError:
        (guard or (lambda s: None))(stream)
        raise
    storage.delete_many(f"{directory}/{name}" for name in leftovers(names, chain))
    return chain


def wipe(storage: Storage, stream: int, leases: Leases, *, whole: bool = False, generation: str | None = None) -> None:
    """Empty `stream` for --overwrite under this worker's lease, by the rule of the module docstring: start a
    new generation (`generation`, a fresh random one by default) in the lease, then in the stream's generation
    pointer, then delete the objects of every ended one and the stream's progress. `whole`: the stream leaves the
    run, so its whole directory goes, once this worker stopped heartbeating its lease (no write of it lands in
    the directory being deleted)."""
    new = generation or uuid.uuid4().hex[:16]
    if whole:
        leases.start_generation(stream, new)
        leases.forget(stream)
        storage.delete_tree(fmt.stream_dir(stream))
        return
    seen = pointer.first(storage, stream, leases.generation(stream))  # before the lease's swap (see generation.py)
    ended = leases.start_generation(stream, new)
    pointer.advance(storage, stream, GenerationRecord(new, ended), seen, leases.check)
    directory = fmt.stream_dir(stream)
    storage.delete_many(f"{directory}/{name}" for name in storage.listdir(directory) if name == fmt.PROGRESS or (
        "" in ended and (fmt.sidecar_shard(name) is not None or fmt.data_file_shard(name) is not None)))
    for old in ended:
        if old:
            storage.delete_tree(fmt.shard_dir(stream, old))


def commit(storage: Storage, sidecar: Sidecar, data: bytes | list | None, guard: Callable[[int], None]) -> Sidecar:
    """Write `data` as the object `sidecar` names (None: written already, by `write_data`), then commit it by
    creating the sidecar only if absent, both in the sidecar's generation. Returns the shard's committed sidecar:
    this one, or the same shard committed first by another writer (`_committed_by_other`)."""
    if data is not None:
        write_data(storage, sidecar.stream, sidecar.file, data, guard, sidecar.generation)
    try:
        guard(sidecar.stream)
    except BaseException:
        _delete_uncommitted(storage, sidecar)  # never to be committed: the lease is lost
        raise
    _test_stop_before_commit(sidecar.stream, sidecar.shard)
    if storage.create_exclusive(fmt.sidecar_path(sidecar.stream, sidecar.shard, sidecar.generation),
                                sidecar.to_bytes()):
        return sidecar
    _delete_uncommitted(storage, sidecar)
    return _committed_by_other(storage, sidecar, guard)


RANGE_FIELDS = ("start", "next", "row_start", "samples", "tokens", "records", "final")


def _committed_by_other(storage: Storage, mine: Sidecar, guard: Callable[[int], None]) -> Sidecar:
    """Another writer committed `mine`'s shard first: a writer that lost the stream and woke after this one
    took it over (its last lease check passed before it stalled), or the holder, where this one lost it. A
    writer that no longer holds the stream stops (CommitLost, exit 3). The holder goes on from the shard that
    won where it commits the same range (shards are deterministic: the same samples, packed the same); else
    it stops retryably (RetryLater, exit 75): a rerun resumes after the committed chain."""
    try:
        guard(mine.stream)
    except FencedOut:
        raise CommitLost(f"stream {mine.stream}: shard {mine.shard} was committed by another writer first (one "
                         "that took the stream over); this worker stopped writing the stream and its copy was not "
                         "committed") from None
    try:
        won = read_sidecar(storage, mine.stream, mine.shard, mine.generation)
        differs = [f for f in RANGE_FIELDS if getattr(won, f) != getattr(mine, f)]
    except ValueError as e:
        differs = [f"its sidecar is damaged ({e})"]
    if not differs:
        return won
    raise RetryLater(f"stream {mine.stream}: shard {mine.shard} was committed by another writer first, with "
                     f"other contents ({', '.join(differs)} differ); this worker stopped writing the stream: "
                     "rerun the same command to resume after the committed shards")


def _delete_uncommitted(storage: Storage, sidecar: Sidecar) -> None:
    """Delete the data object of a commit known not to have happened (this attempt's name: no one else's)."""
    try:
        storage.delete(fmt.data_path(sidecar.stream, sidecar.file, sidecar.generation))
    except UserError:
        pass  # a leftover: the stream's next holder deletes it


def write_data(storage: Storage, stream: int, file: str, data: bytes | list, guard: Callable[[int], None],
               generation: str) -> None:
    """Write a shard's data object (`file`, a name only this attempt writes) in the stream's `generation`, once
    `guard` confirms the lease."""
    guard(stream)
    storage.write_bytes(fmt.data_path(stream, file, generation), data)


def _test_stop_before_commit(stream: int, shard: int) -> None:
    """Fault injection for tests, after the last lease check and before the commit of one shard:
    HARVEST_TEST_STOP_BEFORE_COMMIT=STREAM:SHARD stops this process (SIGSTOP), as a stalled VM would;
    STREAM:SHARD:SECONDS holds just this commit that long (a slow write; the heartbeats go on), or until the
    file HARVEST_TEST_RELEASE_COMMIT names exists, where that is set (a test releases it once it saw enough)."""
    spec = os.environ.get("HARVEST_TEST_STOP_BEFORE_COMMIT", "").split(":")
    if spec[:2] != [str(stream), str(shard)]:
        return
    if len(spec) == 3:
        release, until = os.environ.get("HARVEST_TEST_RELEASE_COMMIT"), time.monotonic() + float(spec[2])
        while time.monotonic() < until and not (release and os.path.exists(release)):
            time.sleep(min(0.1, max(0.0, until - time.monotonic())))
    else:
        os.kill(os.getpid(), signal.SIGSTOP)


class Committer:
    """Background threads that encode and commit shards; stream s always goes to thread s % threads.

    `attempt` names this writer's data objects. `guard(stream)` runs before each write of a stream and raises
    when this worker may no longer write it (its lease lost: see harvest.store.lease). `on_commit(manifest)`
    runs after each commit (on the committing thread): progress bookkeeping. `on_lost(stream, error)` runs
    when another writer committed a shard of the stream first. `checksum`: the sidecars' algorithm
    (encoding.CHECKSUMS; default encoding.default_checksum()). `generation(stream)` names the generation a
    stream's shards are committed in (`Leases.generation`; "" where none was started). `write_threads`: data
    objects written at once (default: the storage's `writes_in_flight`: a disk's cores, at least 2; more to a bucket).
    """

    def __init__(self, storage: Storage, on_commit: Callable[[Sidecar], None] | None = None, *, attempt: str,
                 guard: Callable[[int], None] | None = None, generation: Callable[[int], str] | None = None,
                 on_lost: Callable[[int, UserError], None] | None = None, threads: int = 4, depth: int = 2,
                 checksum: str | None = None, write_threads: int | None = None):
        self.storage = storage
        self.attempt = attempt
        self.checksum = checksum or encoding.default_checksum()
        # A shard's stats and checksums (per tensor: one pass over its bytes, the file's digest derived) run
        # here, beside its data write: one stream's shards use every core this process may run on (its
        # affinity, as a container or taskset limits it), not one (numpy, hashlib and xxhash let go of the GIL).
        self._work = concurrent.futures.ThreadPoolExecutor(max_workers=len(os.sched_getaffinity(0)),
                                                           thread_name_prefix="commit-work")
        # Data objects are written as soon as their shard closes, `write_threads` at a time (each has its own
        # name), and committed in order by the stream's thread: one stream's writes and fsyncs overlap.
        self._writes = concurrent.futures.ThreadPoolExecutor(
            max_workers=write_threads or storage.writes_in_flight, thread_name_prefix="commit-write")
        self.on_commit = on_commit or (lambda manifest: None)
        self.guard = guard or (lambda stream: None)
        self.generation = generation or (lambda stream: "")
        self.on_lost = on_lost or (lambda stream, error: None)
        self.failure: BaseException | None = None
        self._aborted = False  # abort(): nothing more is queued or committed
        self._queueing = threading.Condition()  # a shard is queued entirely before or after abort() begins
        self._submitting = 0  # submit() calls under way (abort waits for them to discard what they made)
        self._queues = [queue.Queue(maxsize=depth) for _ in range(threads)]
        self._threads = [threading.Thread(target=self._run, args=(q,), daemon=True, name=f"commit-{i}")
                         for i, q in enumerate(self._queues)]
        for thread in self._threads:
            thread.start()

    def submit(self, shard: ClosedShard) -> None:
        """Starts the shard's checksums, stats and data write at once, so that a stream's next shards are hashed
        and written while this one commits (sidecars are created one after another; the rest need not be).
        Blocks while that thread's queue is full (storage behind): compute waits, nothing is dropped. A shard
        that will not be committed (the run failing or aborted) has its data object deleted."""
        q = self._queues[shard.stream % len(self._queues)]
        with self._queueing:
            self._submitting += 1
        try:
            encoded = self._encode(shard)
            try:
                while True:
                    self.check()
                    with self._queueing:
                        if self._aborted:
                            break
                        try:
                            q.put(encoded, timeout=0.5)
                            return
                        except queue.Full:
                            continue
            except BaseException:
                self._discard(encoded)
                raise
            self._discard(encoded)
        finally:
            with self._queueing:
                self._submitting -= 1
                self._queueing.notify_all()

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def close(self, deadline: float | None = None) -> None:
        """Wait for every submitted shard to be committed; re-raise a writer's failure. Past `deadline`
        (time.monotonic; a stop's), RetryLater, the commits still in flight left to `abort`."""
        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            for q in self._queues:
                q.put(None, timeout=left())
        except queue.Full:
            pass
        for thread in self._threads:
            thread.join(left())
        self.check()
        if any(thread.is_alive() for thread in self._threads):
            raise abandoned_at_stop()
        self._work.shutdown()
        self._writes.shutdown()

    def abort(self, wait_s: float = ABORT_WAIT_S) -> None:
        """The run is failing: commit nothing more, and leave none of this writer's data objects behind. The
        commit in flight ends as commits do (its sidecar created, or its object deleted); the shards queued or
        being submitted are discarded, their objects deleted once written. A stream's next holder would sweep
        such objects, but a stream already complete has none. Waits at most `wait_s` for storage; what is
        still in flight then is left to the sweeps."""
        deadline = time.monotonic() + wait_s
        with self._queueing:
            self._aborted = True
            self._queueing.wait_for(lambda: self._submitting == 0, timeout=wait_s)
        for q in self._queues:
            with contextlib.suppress(queue.Full):
                q.put(None, timeout=max(0.0, deadline - time.monotonic()))
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _run(self, q: queue.Queue) -> None:
        while (encoded := q.get()) is not None:
            if self.failure is not None or self._aborted:  # drain: the run is failing, the main thread will raise
                self._discard(encoded)
                continue
            try:
                self._commit(encoded)
            except BaseException as e:  # surfaced to the main thread by check()
                self.failure = self._cause(encoded.shard.stream, e)

    def _discard(self, encoded: _Encoded) -> None:
        """A shard this writer will not commit: its data object, written as soon as the shard closed, is deleted
        once its write ends (the name carries this attempt's id, so no other writer's object is touched)."""
        try:
            encoded.written.result()
        except BaseException:
            return  # never written
        with contextlib.suppress(UserError):
            self.storage.delete(fmt.data_path(encoded.shard.stream, fmt.shard_file(encoded.shard.shard, self.attempt),
                                              encoded.generation))

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
        parts = encoding.shard_parts(
            shard.tensors, shard.tokens, shard.lengths, shard.sample_ids, shard.variants,
            metadata={"stream": str(shard.stream), "shard": str(shard.shard)},
        )
        generation = self.generation(shard.stream)
        return _Encoded(shard, parts, generation,
                        {name: self._work.submit(encoding.tensor_checksums, blocks, self.checksum, encoding.CHUNK_BYTES)
                         for name, blocks in encoding.tensor_parts(parts).items()},
                        {name: self._work.submit(RunningStats.of_pieces, blocks, *shard.moments[name])
                         for name, blocks in shard.tensors.items() if name in shard.moments},
                        self._writes.submit(write_data, self.storage, shard.stream,
                                            fmt.shard_file(shard.shard, self.attempt), parts, self.guard, generation))

    def _commit(self, encoded: _Encoded) -> None:
        shard, parts = encoded.shard, encoded.parts
        sums = {name: future.result() for name, future in encoded.tensor_digests.items()}  # (digest, chunks')
        tensors = {name: whole for name, (whole, _) in sums.items()}
        manifest = Sidecar.of_shard(
            parts, checksum=self.checksum, digests=(encoding.file_digest(parts, tensors, self.checksum), tensors),
            chunk_bytes=encoding.CHUNK_BYTES, chunk_digests={name: chunks for name, (_, chunks) in sums.items()},
            stream=shard.stream, shard=shard.shard, attempt=self.attempt,
            start=shard.start, next=shard.next, row_start=shard.row_start, samples=len(shard.lengths),
            tokens=int(shard.lengths.sum()), stats={name: future.result() for name, future in encoded.stats.items()},
            skipped=shard.skipped, long=shard.long, final=shard.final, records=shard.records,
            quantization=shard.quantization, generation=encoded.generation, source_digest=shard.source_digest,
            first_stats=None if shard.first_stats is None else {n: s.to_json() for n, s in shard.first_stats.items()},
        )
        encoded.written.result()
        try:
            manifest = commit(self.storage, manifest, None, self.guard)
        except CommitLost as e:
            self.on_lost(shard.stream, e)
            raise
        self.guard(shard.stream)
        self.on_commit(manifest)
        if shard.final:  # what writers that lost the stream left behind, now that none of it can be committed
            sweep(self.storage, shard.stream, manifest.generation)
