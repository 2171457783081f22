"""Stream writers: captured rows in, committed shards out, off the critical path.

`ShardWriter` (one per stream) cuts the stream's pieces into shards: a shard closes before the piece
that would overflow `shard_bytes`, so boundaries depend only on the stream, the tensors, the dtype and
the shard size. `Committer` encodes and writes closed shards on background threads, data first and
its sidecar after (the commit), in order within a stream, through bounded queues: when storage falls
behind, the producer waits; nothing is dropped.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any, Callable

import numpy as np

from harvest.data.batching import Piece, Row, Skip
from harvest.store import format as fmt
from harvest.store.fs import Storage
from harvest.store.records import Sidecar


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
    tensors: dict[str, np.ndarray]
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


class ShardWriter:
    """Accumulates one stream's pieces (host numpy, storage dtype) and closes shards by size."""

    def __init__(self, stream: int, widths: dict[str, int], dtype: np.dtype, shard_bytes: int, resume: ResumePoint):
        self.stream = stream
        self.widths = widths
        self.dtype = dtype
        self.shard_bytes = shard_bytes
        # Bytes a piece adds: its activations and tokens, plus offsets, sample_ids and variants entries.
        self.token_bytes = sum(widths.values()) * dtype.itemsize + 4
        self.sample_bytes = 8 + 8 + 4
        self.shard = resume.shard
        self.committed = resume.next
        self.start = resume.next
        self.waiting: dict[fmt.Position, dict[str, np.ndarray]] = {}  # pieces of the current block, by position
        self._reset()

    def _reset(self) -> None:
        self.blocks: dict[str, list[np.ndarray]] = {name: [] for name in self.widths}
        self.token_blocks: list[np.ndarray] = []
        self.lengths: list[int] = []
        self.sample_ids: list[int] = []
        self.variants: list[int] = []
        self.skipped: list[dict[str, Any]] = []
        self.long = {"truncated": 0, "chunked": 0, "skipped": 0}
        self.bytes = 0

    def add_row(self, row: Row, values: dict[str, np.ndarray]) -> list[ClosedShard]:
        """Take a row; `values[name]` is [row.used, width]. Its pieces wait until their block's last row
        (the one carrying `row.block`) arrives, then go in in stream order. Returns shards closed on the way."""
        for piece, offset in row.events:
            if piece.pos >= self.committed:  # else already in a committed shard (a resume re-packs its block)
                self.waiting[piece.pos] = {name: v[offset : offset + len(piece.tokens)] for name, v in values.items()}
        closed = []
        for event in row.block or ():
            if event.pos < self.committed:
                continue
            if isinstance(event, Skip):
                self.skipped.append({"sample_id": event.sample_id, "variant": event.pos[1],
                                     "location": event.location, "reason": event.reason})
                self.long["skipped"] += event.long
                continue
            size = len(event.tokens) * self.token_bytes + self.sample_bytes
            if self.lengths and self.bytes + size > self.shard_bytes:
                closed.append(self._close(next=event.pos, row_start=row.start, final=False, records=event.pos[0]))
            self._add_piece(event, self.waiting.pop(event.pos))
            self.bytes += size
        if row.end is not None:
            closed.append(self._close(next=(row.end.records, 0), row_start=(row.end.records, 0), final=True,
                                      records=row.end.records))
        return closed

    def _add_piece(self, piece: Piece, values: dict[str, np.ndarray]) -> None:
        for name, block in values.items():
            self.blocks[name].append(block)
        self.token_blocks.append(piece.tokens)
        self.lengths.append(len(piece.tokens))
        self.sample_ids.append(piece.sample_id)
        self.variants.append(piece.pos[1])
        if piece.long:
            self.long[piece.long] += 1

    def _close(self, *, next: fmt.Position, row_start: fmt.Position, final: bool, records: int) -> ClosedShard:
        shard = ClosedShard(
            stream=self.stream,
            shard=self.shard,
            tensors={name: _concat(blocks, (0, self.widths[name]), self.dtype) for name, blocks in self.blocks.items()},
            tokens=_concat(self.token_blocks, (0,), np.int32),
            lengths=np.asarray(self.lengths, np.int64),
            sample_ids=np.asarray(self.sample_ids, np.int64),
            variants=np.asarray(self.variants, np.int32),
            start=self.start,
            next=next,
            row_start=row_start,
            skipped=self.skipped,
            long=self.long,
            final=final,
            records=records,
        )
        self.shard += 1
        self.start = next
        self._reset()
        return shard


def _concat(blocks: list[np.ndarray], empty_shape: tuple[int, ...], dtype) -> np.ndarray:
    """Blocks joined; an empty shard (a stream whose tail was all skipped) still has the run's dtype."""
    return np.concatenate(blocks) if blocks else np.zeros(empty_shape, dtype)


class Committer:
    """Background threads that encode and commit shards; stream s always goes to thread s % threads.

    `guard(stream)` runs before each write of a stream and raises when this worker may no longer write it
    (its lease lost: see harvest.store.lease), so nothing lands after that moment. `on_commit(manifest)`
    runs after each commit (on the committing thread): progress bookkeeping.
    """

    def __init__(self, storage: Storage, on_commit: Callable[[Sidecar], None] | None = None, *,
                 guard: Callable[[int], None] | None = None, threads: int = 4, depth: int = 2):
        self.storage = storage
        self.on_commit = on_commit or (lambda manifest: None)
        self.guard = guard or (lambda stream: None)
        self.failure: BaseException | None = None
        self._queues = [queue.Queue(maxsize=depth) for _ in range(threads)]
        self._threads = [threading.Thread(target=self._run, args=(q,), daemon=True, name=f"commit-{i}")
                         for i, q in enumerate(self._queues)]
        for thread in self._threads:
            thread.start()

    def submit(self, shard: ClosedShard) -> None:
        """Blocks while that thread's queue is full (storage behind): compute waits, nothing is dropped."""
        q = self._queues[shard.stream % len(self._queues)]
        while True:
            self.check()
            try:
                q.put(shard, timeout=0.5)
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
        self.check()

    def _run(self, q: queue.Queue) -> None:
        while (shard := q.get()) is not None:
            if self.failure is not None:
                continue  # drain: the run is failing, the main thread will raise
            try:
                self._commit(shard)
            except BaseException as e:  # surfaced to the main thread by check()
                self.failure = e

    def _commit(self, shard: ClosedShard) -> None:
        data = fmt.encode_shard(
            shard.tensors, shard.tokens, shard.lengths, shard.sample_ids, shard.variants,
            metadata={"stream": str(shard.stream), "shard": str(shard.shard)},
        )
        manifest = Sidecar.of_shard(
            data, stream=shard.stream, shard=shard.shard, start=shard.start, next=shard.next,
            row_start=shard.row_start, samples=len(shard.lengths), tokens=int(shard.lengths.sum()),
            stats={name: fmt.RunningStats.of(values) for name, values in shard.tensors.items()},
            skipped=shard.skipped, long=shard.long, final=shard.final, records=shard.records,
        )
        base = f"{fmt.stream_dir(shard.stream)}/{fmt.shard_stem(shard.shard)}"
        self.guard(shard.stream)
        self.storage.write_bytes(base + ".safetensors", data)
        self.guard(shard.stream)
        self.storage.write_bytes(base + ".json", manifest.to_bytes())  # the commit
        self.on_commit(manifest)
