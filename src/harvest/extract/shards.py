"""A stream's packed rows in, closed shards out: `ShardWriter` accumulates one stream's pieces (host
numpy, storage dtype) and closes a shard before the piece that would overflow `shard_bytes`, so
boundaries depend only on the stream, the tensors, the dtype and the shard size, never on batch size,
mesh or host count. Closed shards go to harvest.store.commit.Committer.

Each piece's activations are copied once, from the batch into the shard's own buffers (sized for a
full shard up front): no per-piece copies, no concatenation at close.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from harvest.data.batching import Piece, Row, Skip
from harvest.store import format as fmt
from harvest.store.commit import ClosedShard, ResumePoint


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
        # Pieces of the current block, by position: views into their batches until the block's last row.
        self.waiting: dict[fmt.Position, dict[str, np.ndarray]] = {}
        self._reset()

    def _reset(self) -> None:
        self.filled = 0  # tokens in the shard buffers
        self.buffers = self._allocate(max(1, self.shard_bytes // self.token_bytes))
        self.token_blocks: list[np.ndarray] = []
        self.lengths: list[int] = []
        self.sample_ids: list[int] = []
        self.variants: list[int] = []
        self.skipped: list[dict[str, Any]] = []
        self.long = {"truncated": 0, "chunked": 0, "skipped": 0}
        self.bytes = 0

    def add_row(self, row: Row, values: dict[str, np.ndarray]) -> list[ClosedShard]:
        """Take a row; `values[name]` is [row.used, width]. Its pieces wait (as views: a block's batches stay
        alive until its last row) until their block's last row, the one carrying `row.block`, arrives; then
        they go in in stream order. Returns shards closed on the way."""
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

    def _allocate(self, tokens: int) -> dict[str, np.ndarray]:
        return {name: np.empty((tokens, width), self.dtype) for name, width in self.widths.items()}

    def _add_piece(self, piece: Piece, values: dict[str, np.ndarray]) -> None:
        end = self.filled + len(piece.tokens)
        if end > len(next(iter(self.buffers.values()))):  # a piece larger than a shard: it goes alone
            grown = self._allocate(end)
            for name, buffer in self.buffers.items():
                grown[name][: self.filled] = buffer[: self.filled]
            self.buffers = grown
        for name, block in values.items():
            self.buffers[name][self.filled : end] = block
        self.filled = end
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
            tensors={name: buffer[: self.filled] for name, buffer in self.buffers.items()},
            tokens=np.concatenate(self.token_blocks) if self.token_blocks else np.zeros(0, np.int32),
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

