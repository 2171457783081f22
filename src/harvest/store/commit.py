"""The commit protocol: a shard's data is written, then its sidecar (the commit); a shard without its
sidecar does not exist. `Committer` encodes and commits closed shards on background threads, in order
within a stream, through bounded queues (when storage falls behind the producer waits; nothing is
dropped); `resume_point` reads back where each stream stands.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import queue
import re
import threading
from typing import Any, Callable

import numpy as np

from harvest.errors import UserError
from harvest.store import format as fmt
from harvest.storage import Storage
from harvest.store.records import Sidecar

_SIDECAR = re.compile(r"^shard_(\d{6})\.json$")


@dataclasses.dataclass
class ResumePoint:
    """Where a stream stands after its committed shards (all zeros for a fresh stream)."""

    shard: int = 0  # next shard number
    next: fmt.Position = (0, 0)
    row_start: fmt.Position = (0, 0)
    samples: int = 0
    tokens: int = 0
    done: bool = False


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
    moments: dict[str, tuple[list, list]]


@dataclasses.dataclass
class _Encoded:
    """A closed shard on its way to storage: its file's parts, and its checksum and stats being computed."""

    shard: ClosedShard
    parts: list
    digest: concurrent.futures.Future
    stats: dict[str, concurrent.futures.Future]


def resume_point(storage: Storage, stream: int) -> ResumePoint:
    """The stream's state after its contiguous run of committed shards from shard 0.

    A shard without its sidecar does not exist: it is rewritten, under the same name, with the same bytes.
    """
    directory = fmt.stream_dir(stream)
    numbers = sorted(int(m.group(1)) for name in storage.listdir(directory) if (m := _SIDECAR.match(name)))
    point = ResumePoint()
    for expected, number in enumerate(numbers):
        if number != expected:
            break
        rel = f"{directory}/{fmt.shard_stem(number)}.json"
        try:
            manifest = Sidecar.from_bytes(storage.read_bytes(rel))
        except ValueError as e:
            raise UserError(f"{storage.url_of(rel)}: not a harvest sidecar ({e}); `harvest verify` shows what "
                            "else is wrong, and deleting it makes the shard be rewritten") from None
        point = ResumePoint(shard=number + 1, next=manifest.next, row_start=manifest.row_start,
                            samples=point.samples + manifest.samples, tokens=point.tokens + manifest.tokens,
                            done=manifest.final)
    return point


class Committer:
    """Background threads that encode and commit shards; stream s always goes to thread s % threads.

    `guard(stream)` runs before each write of a stream and raises when this worker may no longer write it
    (its lease lost: see harvest.store.lease), so nothing lands after that moment. `on_commit(manifest)`
    runs after each commit (on the committing thread): progress bookkeeping.
    """

    def __init__(self, storage: Storage, on_commit: Callable[[Sidecar], None] | None = None, *,
                 guard: Callable[[int], None] | None = None, threads: int = 4, depth: int = 2):
        self.storage = storage
        # A shard's stats (per tensor) and checksum run here, beside its data write: one stream's shards
        # use every core, not one (numpy and hashlib let go of the GIL).
        self._work = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1,
                                                           thread_name_prefix="commit-work")
        self.on_commit = on_commit or (lambda manifest: None)
        self.guard = guard or (lambda stream: None)
        self.failure: BaseException | None = None
        self._queues = [queue.Queue(maxsize=depth) for _ in range(threads)]
        self._threads = [threading.Thread(target=self._run, args=(q,), daemon=True, name=f"commit-{i}")
                         for i, q in enumerate(self._queues)]
        for thread in self._threads:
            thread.start()

    def submit(self, shard: ClosedShard) -> None:
        """Starts the shard's checksum and stats on the pool at once, so that a stream's next shards are hashed
        while this one is written (shards commit one after another; their hashing need not). Blocks while that
        thread's queue is full (storage behind): compute waits, nothing is dropped."""
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
        say) fails for that reason: the guard's error names the holder."""
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
        return _Encoded(shard, parts, self._work.submit(fmt.sha256, parts),
                        {name: self._work.submit(fmt.RunningStats.of_pieces, blocks, *shard.moments[name])
                         for name, blocks in shard.tensors.items()})

    def _commit(self, encoded: _Encoded) -> None:
        shard, parts = encoded.shard, encoded.parts
        base = f"{fmt.stream_dir(shard.stream)}/{fmt.shard_stem(shard.shard)}"
        self.guard(shard.stream)
        self.storage.write_bytes(base + ".safetensors", parts)
        manifest = Sidecar.of_shard(
            parts, digest=encoded.digest.result(), stream=shard.stream, shard=shard.shard, start=shard.start,
            next=shard.next, row_start=shard.row_start, samples=len(shard.lengths), tokens=int(shard.lengths.sum()),
            stats={name: future.result() for name, future in encoded.stats.items()},
            skipped=shard.skipped, long=shard.long, final=shard.final, records=shard.records,
        )
        self.guard(shard.stream)
        self.storage.write_bytes(base + ".json", manifest.to_bytes())  # the commit
        self.guard(shard.stream)
        self.on_commit(manifest)
