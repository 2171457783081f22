"""A stream's packed rows in, closed shards out: `ShardWriter` accumulates one stream's pieces (host
numpy, storage dtype) and closes a shard before the piece that would overflow `shard_bytes`, so
boundaries depend only on the stream, the tensors, the dtype and the shard size, never on batch size,
mesh or host count. Closed shards go to harvest.store.committer.Committer, each with its stream's content
pin through it (harvest.data.pin), which `pin_sources` checks against the source before a resume reads on.

No activation is copied on the host: a shard holds its pieces as views into the batches they were
captured in (which stay alive until the shard is committed), and the Committer writes and hashes them
from there, one after another, as the safetensors file's bytes. That holds for 8-bit codes too: the device
makes them (harvest.model.quantize), and their scales wait beside them the same way.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from harvest.data.batching import SampleTokens, Row, Skip
from harvest.data.pin import SourcePin, read_pin
from harvest.errors import UserError
from harvest.store import format as fmt, quant
from harvest.store.commit import ResumePoint
from harvest.store.committer import ClosedShard
from harvest.store.records import Sidecar
from harvest.store.stats import RunningStats


class ShardWriter:
    """Accumulates one stream's pieces (host numpy, storage dtype) and closes shards by size.

    With `quantize` (an 8-bit code of harvest.store.quant, `dtype` its codes) each tensor's pieces come as the
    device made them, codes with their scales beside them (under quant.scale_name), and go into the shard as
    they are. Its stats stay those of the values before quantization: the device's moments and first tokens
    (harvest.model.quantize) of the row's first pieces; a row's samples beyond those the device reduced (rare: its
    33rd and on) get theirs here from the dequantized codes."""

    def __init__(self, stream: int, widths: dict[str, int], dtype: np.dtype, shard_bytes: int, resume: ResumePoint,
                 quantize: str | None = None):
        self.stream = stream
        self.widths = widths
        self.quantize = quantize
        self.dtype = dtype
        # What a shard stores, empty: each tensor, and each one's scales after it where quantized.
        self.empty = {name: np.zeros((0, width), dtype) for name, width in widths.items()}
        if quantize:
            self.empty.update({quant.scale_name(name): np.zeros(0, np.float32) for name in widths})
        self.shard_bytes = shard_bytes
        self.pin: SourcePin | None = None  # the stream's content pin (pin_sources), None for a run made before pins
        # Bytes a piece adds: its activations (and scales) and tokens, plus offsets, sample_ids and variants entries.
        self.token_bytes = (sum(widths.values()) + 4 * len(widths) if quantize
                            else sum(widths.values()) * dtype.itemsize) + 4
        self.sample_bytes = 8 + 8 + 4
        self.shard = resume.shard
        self.committed = resume.next
        self.start = resume.next
        # Pieces of the current block, by position: views into their batches until the block's last row, with
        # their device moments ({name: (mean, M2)}, or None).
        self.waiting: dict[fmt.Position, tuple[dict[str, np.ndarray], dict | None]] = {}
        self._reset()

    def _reset(self) -> None:
        self.pieces: dict[str, list[np.ndarray]] = {name: [] for name in self.empty}  # [tokens, (width)] views
        self.token_blocks: list[np.ndarray] = []
        self.lengths: list[int] = []
        self.sample_ids: list[int] = []
        self.variants: list[int] = []
        self.moments: dict[str, tuple[list, list]] = {name: ([], []) for name in self.widths}  # per piece, or None
        self.firsts: dict[str, list[np.ndarray]] = {name: [] for name in self.widths}  # each piece's first token
        self.skipped: list[dict[str, Any]] = []
        self.long = {"truncated": 0, "chunked": 0, "skipped": 0}
        self.bytes = 0

    def add_row(self, row: Row, values: dict[str, np.ndarray], moments: dict | None = None) -> list[ClosedShard]:
        """Take a row; `values[name]` is [row.used, width] (quantized: codes, and `values[quant.scale_name(name)]`
        their scales [row.used]); `moments[name]`, if given, is the row's (mean, M2) [samples, width] of its first
        pieces (harvest.model.moments), quantized (mean, M2, first token) (harvest.model.quantize). Its pieces
        wait (as views: a block's batches stay alive until its last row) until their block's last row, the one
        carrying `row.block`, arrives; then they go in in stream order. Returns shards closed on the way."""
        for k, (piece, offset) in enumerate(row.events):
            if piece.pos >= self.committed:  # else already in a committed shard (a resume re-packs its block)
                reduced = moments and k < _device_samples(moments)
                own = {name: tuple(a[k] for a in m) for name, m in moments.items()} if reduced else None
                self.waiting[piece.pos] = ({name: v[offset : offset + len(piece.tokens)] for name, v in values.items()},
                                           own)
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
            self._add_piece(event, *self.waiting.pop(event.pos))
            self.bytes += size
        if row.end is not None:
            closed.append(self._close(next=(row.end.records, 0), row_start=(row.end.records, 0), final=True,
                                      records=row.end.records))
        return closed

    def _add_piece(self, piece: SampleTokens, values: dict[str, np.ndarray], moments: dict | None) -> None:
        for name, block in values.items():
            if block.dtype != self.empty[name].dtype:
                if self.quantize:
                    raise TypeError(f"{name}: {block.dtype} where the device's {self.empty[name].dtype} was expected")
                block = block.astype(self.dtype)
            self.pieces[name].append(block)
        for name in self.widths:
            mean, m2, *device_first = moments[name] if moments else (None, None)
            first = device_first[0][None] if device_first else self.pieces[name][-1][:1]
            if self.quantize and not device_first:  # beyond the device's samples: from the dequantized codes
                codes, scales = values[name], values[quant.scale_name(name)]
                if mean is None:
                    own = RunningStats.of(quant.dequantize(codes, scales))
                    mean, m2 = own.mean, own.m2
                first = quant.dequantize(codes[:1], scales[:1])
            self.firsts[name].append(first)
            means, m2s = self.moments[name]
            means.append(mean)
            m2s.append(m2)
        self.token_blocks.append(piece.tokens)
        self.lengths.append(len(piece.tokens))
        self.sample_ids.append(piece.sample_id)
        self.variants.append(piece.pos[1])
        if piece.long:
            self.long[piece.long] += 1

    def _close(self, *, next: fmt.Position, row_start: fmt.Position, final: bool, records: int) -> ClosedShard:
        tensors = {name: pieces or [self.empty[name]] for name, pieces in self.pieces.items()}
        through = pinned_records(next)
        digest = None if self.pin is None else self.pin.digest(through)
        if self.pin is not None:
            self.pin.forget(through)
        shard = ClosedShard(
            stream=self.stream,
            shard=self.shard,
            tensors=tensors,
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
            moments=self.moments,
            first_stats={name: RunningStats.of(np.concatenate(rows) if rows else np.zeros((0, self.widths[name])))
                         for name, rows in self.firsts.items()},
            quantization=quant.record(self.quantize) if self.quantize else None,
            source_digest=digest,
        )
        self.shard += 1
        self.start = next
        self._reset()
        return shard


def _device_samples(moments: dict) -> int:
    return len(next(iter(moments.values()))[0])


def pinned_records(next: fmt.Position) -> int:
    """The records a stream's shards through one ending at `next` hold a piece or a skip of: those before next's
    record, and that record too where the shard holds some of its pieces (a long text's first chunks)."""
    return next[0] + (next[1] > 0)


def pin_sources(data, chains: dict[int, list[Sidecar]], writers: dict[int, ShardWriter]) -> None:
    """Each written stream's content pin, checked against what its committed shards were made from: the stream's
    records through the last one are re-read (their bytes, unparsed) and hashed, and a resume over an edited source
    is refused in one line before anything is committed. A stream resumed from sidecars written before pins goes
    on unpinned, as it did. The pin then goes with the stream's next read (`data`: harvest.data.streams) and its
    writer, which puts it in every sidecar."""
    for stream, writer in writers.items():
        chain = chains[stream]
        if chain and chain[-1].source_digest is None:
            continue
        start, through = (chain[-1].row_start[0], pinned_records(chain[-1].next)) if chain else (0, 0)
        pin, digest = read_pin(data.raw_records(stream), start, through)
        if chain and digest != chain[-1].source_digest:
            raise UserError(f"{data.where(stream)}: stream {stream} changed since the run began (its first {through} "
                            "records, which the committed shards were made from, read differently now); restore the "
                            "input the run was started with, or rerun with --overwrite to start the stream over")
        data.pin_reads(stream, pin)
        writer.pin = pin
