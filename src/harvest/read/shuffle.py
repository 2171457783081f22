"""The order a reader visits a run's tokens in: a pure function of the committed shards and the settings.

Level one cuts every shard into pieces (row ranges of at most `piece_tokens`) and permutes the pieces
with (seed, epoch); consumers (rank r of `world` hosts, then worker w of a rank's `workers` data-loader
workers) take every (world*workers)-th piece of that order, so no two consumers share a token. Level two
reads a consumer's pieces `buffer` at a time (a group) and permutes the group's rows with
(seed, epoch, rank, worker, group). Because a group's order depends on nothing before it, a cursor
(epoch, group, row) is all a reader needs to resume: nothing earlier is re-read. Each shard's bytes are
checked by one consumer only: the one dealt its first piece (`shards_to_verify`).
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of one shard."""

    stream: int
    shard: int
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def cut(shards: list[tuple[int, int, int]], piece_tokens: int | None) -> list[Piece]:
    """(stream, shard, tokens) -> pieces of at most `piece_tokens` rows (whole shards with None), in order."""
    out = []
    for stream, shard, tokens in shards:
        step = tokens if piece_tokens is None else piece_tokens
        out += [Piece(stream, shard, lo, min(lo + step, tokens)) for lo in range(0, tokens, max(step, 1))]
    return out


def epoch_order(pieces: list[Piece], seed: int, epoch: int, shuffle: bool, round_: int = 0) -> list[Piece]:
    """Level one; `round_` > 0 numbers the later rounds of an epoch read while the run grows (harvest.read.rounds)."""
    if not shuffle:
        return list(pieces)
    perm = np.random.default_rng([seed, epoch, *([round_] if round_ else [])]).permutation(len(pieces))
    return [pieces[i] for i in perm]


def share(order: list[Piece], rank: int, world: int, worker: int, workers: int) -> list[Piece]:
    """This consumer's pieces: rank r takes order[r::world], its worker w every workers-th of those."""
    return order[rank::world][worker::workers]


def shards_to_verify(order: list[Piece], rank: int, world: int, worker: int, workers: int) -> set[tuple[int, int]]:
    """(stream, shard) of the shards whose first piece (rows from 0) `share` deals to this consumer: each
    shard has exactly one such consumer among all ranks and workers."""
    return {(p.stream, p.shard) for i, p in enumerate(order)
            if p.lo == 0 and i % world == rank and (i // world) % workers == worker}


def groups(pieces: list[Piece], buffer: int) -> list[list[Piece]]:
    return [pieces[i:i + buffer] for i in range(0, len(pieces), buffer)]


def row_order(rows: int, seed: int, epoch: int, rank: int, worker: int, group: int, shuffle: bool,
              round_: int = 0) -> np.ndarray:
    """The order of a group's rows (level two)."""
    if not shuffle:
        return np.arange(rows)
    return np.random.default_rng([seed, epoch, rank, worker, group, *([round_] if round_ else [])]).permutation(rows)
