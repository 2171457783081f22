"""`Committer`: closed shards encoded and committed on background threads, in order within a stream, through
bounded queues (when storage falls behind the producer waits; nothing is dropped). A shard's data object is
written as soon as it closes (its own name: writing commits nothing); its sidecar is created in order, by the
protocol of harvest.store.commit."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import queue
import threading
import time
from typing import Any, Callable

import numpy as np

from harvest.errors import RetryLater, UserError
from harvest.storage import Storage
from harvest.store import encoding, format as fmt
from harvest.store.commit import CommitLost, commit, sweep, write_data
from harvest.store.records import Sidecar
from harvest.store.stats import RunningStats


ABORT_WAIT_S = 30.0  # how long a failing run waits for its commit in flight and its discards (Committer.abort)


def abandoned_at_stop() -> RetryLater:
    """A stop (SIGTERM) whose commits in flight did not end by its deadline."""
    return RetryLater("stopped on SIGTERM: a commit still in flight at the deadline was abandoned (the stream's next "
                      "holder commits that shard again), the leases released; rerun the same command to resume")


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


class Committer:
    """Background threads that encode and commit shards; stream s always goes to thread s % threads.

    `attempt`: this writer's id, which names its data objects. `guard(stream)` runs before each write of a
    stream and raises when this worker may no longer write it (its lease lost: harvest.store.lease).
    `on_commit(manifest)` runs after each commit (on the committing thread); `on_lost(stream, error)` when
    another writer committed a shard of the stream first. `checksum`: the sidecars' algorithm (default
    encoding.default_checksum()). `generation(stream)`: the generation a stream's shards go to
    (`Leases.generation`). `write_threads`: data objects written at once (default: the storage's
    `writes_in_flight`).
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
