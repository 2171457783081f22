"""Training rows: the data tokenized and packed exactly as extraction packs it, dealt to the rows of
each step's global batch so that every process reads only the streams its own rows come from.

The global batch has `batch_size` rows. They fall into *groups* of consecutive rows, one group per
stream or set of streams: with at least as many streams as rows, row r reads streams r, r+B, r+2B, ...
in turn; with fewer streams S (B a multiple of S), the B/S rows of group s take stream s's packed rows
in turn. A group's position (epoch, stream cursor, and the (record, variant) where its next packed row
starts) is all a resume needs: packing is a pure function of the stream, so re-packing from that row's
start rebuilds the very rows the first run would have read. Epochs repeat the same order.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import numpy as np

from harvest.data.batching import Row, pack_stream, stream_pieces
from harvest.errors import UserError


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a group's next row starts: the packing block it belongs to (packing re-packs whole blocks, see
    harvest.data.batching) and how many of that block's rows come before it."""

    epoch: int = 0
    cursor: int = 0  # index into the group's streams
    record: int = 0
    variant: int = 0
    row: int = 0  # rows of the block at (record, variant) before this one

    def to_json(self) -> list[int]:
        return [self.epoch, self.cursor, self.record, self.variant, self.row]

    @classmethod
    def from_json(cls, value: list[int]) -> Position:
        return cls(*(int(v) for v in value))


@dataclasses.dataclass(frozen=True)
class Groups:
    """How streams feed the rows of the global batch."""

    num_streams: int
    batch_size: int

    def __post_init__(self):
        if self.num_streams < self.batch_size and self.batch_size % self.num_streams:
            raise UserError(f"--data has {self.num_streams} streams and --batch-size is {self.batch_size}: need at "
                            "least as many streams as rows, or a batch size that is a multiple of the streams "
                            "(split the data with `harvest streams create --num-streams N`)")

    @property
    def count(self) -> int:
        return min(self.num_streams, self.batch_size)

    @property
    def rows_per_group(self) -> int:
        return self.batch_size // self.count

    def streams(self, group: int) -> list[int]:
        return list(range(group, self.num_streams, self.count))

    def of_rows(self, rows: list[int]) -> list[int]:
        return sorted({r // self.rows_per_group for r in rows})


RowSource = Callable[[int, tuple[int, int]], Iterator[Row]]  # (stream, start) -> packed rows from there


class GroupReader:
    """One group's rows in order, endlessly (epoch after epoch), knowing where the next one starts."""

    def __init__(self, streams: list[int], rows_from: RowSource, position: Position):
        self._streams = streams
        self._rows_from = rows_from
        self._rows = self._walk(position)
        self._next = next(self._rows)

    @property
    def position(self) -> Position:
        return self._next[0]

    def take(self, n: int) -> list[Row]:
        taken = []
        for _ in range(n):
            taken.append(self._next[1])
            self._next = next(self._rows)
        return taken

    def _walk(self, position: Position) -> Iterator[tuple[Position, Row]]:
        epoch, cursor, start = position.epoch, position.cursor, (position.record, position.variant)
        found = position != Position()  # a resumed position lies past rows already found
        skip = position.row
        while True:
            block, k = None, 0
            for row in self._rows_from(self._streams[cursor], start):
                if row.start is None:
                    continue
                block, k = (row.start, k + 1) if row.start == block else (row.start, 0)
                if skip and row.start == start and k < skip:
                    continue  # taken before the resume
                found = True
                yield Position(epoch, cursor, *row.start, k), row
            start, skip = (0, 0), 0
            cursor += 1
            if cursor == len(self._streams):
                if not found:
                    raise UserError(f"streams {self._streams} hold no tokens to train on")
                cursor, epoch = 0, epoch + 1


def row_source(data, render, encode, *, seq_len: int, long: str) -> RowSource:
    """Packed rows of a stream from a row start, as extraction packs them (bad records are skipped)."""
    from harvest.data.prompts import SampleError

    def rows_from(stream: int, start: tuple[int, int]) -> Iterator[Row]:
        events = stream_pieces(data.records(stream, start=start[0]), render, encode, first_index=start[0],
                               max_seq_len=seq_len, long=long, strict=False, sample_error=SampleError)
        return pack_stream(events, seq_len, skip_before=start)

    return rows_from


class BatchFeeder:
    """This process's rows of each step's [batch_size, seq_len] batch (zeros elsewhere)."""

    def __init__(self, groups: Groups, local_rows: list[int], rows_from: RowSource, positions: list[Position],
                 seq_len: int):
        self.groups = groups
        self.local_rows = local_rows
        self.seq_len = seq_len
        self.readers = {g: GroupReader(groups.streams(g), rows_from, positions[g]) for g in groups.of_rows(local_rows)}

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        shape = (self.groups.batch_size, self.seq_len)
        tokens, segments = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        per = self.groups.rows_per_group
        for g, reader in self.readers.items():
            for k, row in enumerate(reader.take(per)):
                tokens[g * per + k], segments[g * per + k] = row.tokens, row.segments
        return tokens, segments

    def positions(self) -> dict[int, Position]:
        """Where each of this process's groups goes on (the other processes know theirs)."""
        return {g: reader.position for g, reader in self.readers.items()}
