"""A run read while `harvest extract` still writes it (following it): its first epoch as rounds. Round 0 takes
every shard committed when the epoch starts, round n those committed since; a round is decided once (in the
reader's state and in `book`), so a rerun takes the same shards. A stream started over by --overwrite stops the
follower (StartedOverError): the rows served cannot be taken back. Why, at length: docs/reading.md."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from harvest.read.errors import StateError
from harvest.runtime import sigterm
from harvest.storage import Storage
from harvest.store import format as fmt
from harvest.store.listing import covered_streams, read_run_info
from harvest.store.snapshot import ShardCounts, Snapshot

log = logging.getLogger(__name__)

REPEAT_S = 600.0  # while waiting, the progress line again every this many seconds


@dataclasses.dataclass(frozen=True)
class Round:
    """Shards [start[s], end[s]) of each stream s, in its generation `generations[s]`, read as round `number` of
    epoch `epoch` (rounds recorded before generations have none: the streams' current ones)."""

    epoch: int
    number: int
    start: dict[int, int]
    end: dict[int, int]
    tokens: int
    generations: dict[int, str] = dataclasses.field(default_factory=dict)

    def shards(self) -> int:
        return sum(n - self.start.get(s, 0) for s, n in self.end.items())

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "round": self.number, "start": {str(s): n for s, n in self.start.items()},
                "end": {str(s): n for s, n in self.end.items()}, "shards": self.shards(), "tokens": self.tokens,
                "generations": {str(s): g for s, g in self.generations.items()}}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Round:
        return cls(int(obj["epoch"]), int(obj["round"]), counts(obj["start"]), counts(obj["end"]), int(obj["tokens"]),
                   {int(s): str(g) for s, g in obj.get("generations", {}).items()})


def counts(obj: dict) -> dict[int, int]:
    return {int(s): int(n) for s, n in obj.items()}


def round_path(epoch: int, number: int) -> str:
    return f"epoch_{epoch:05d}/round_{number:06d}.json"


def wait_for_run(storage: Storage, poll: float) -> Snapshot:
    """The run's snapshot, once its run.json exists (an extraction not started yet writes it first)."""
    since = None
    while not storage.exists(fmt.RUN_JSON):
        since = _waiting(since, f"{storage.url}: no run.json yet; waiting for `harvest extract` to start writing "
                                f"the run (listing every {poll:g}s)")
        sigterm.sleep(poll)
    read_run_info(storage)  # a damaged or too new run.json: one line
    return Snapshot.take(storage)


class Follower:
    """Decides the rounds of an epoch of `storage`'s run, over `streams` (None: all), waiting as needed;
    `on_wait()` runs as each wait begins (a trainer saves the step it reached: nothing is lost if it is
    preempted while it waits)."""

    def __init__(self, storage: Storage, streams: tuple[int, ...] | None, poll: float, book: Storage | None,
                 on_wait: Callable[[], None] | None = None):
        self.storage, self.streams, self.poll, self.book = storage, streams, float(poll), book
        self.on_wait = on_wait

    def _wanted(self, view: Snapshot) -> dict[int, int]:
        return {s: n for s, n in view.counts().items() if self.streams is None or s in self.streams}

    def covering(self, view: Snapshot, end: ShardCounts, generations: Mapping[int, str]) -> Snapshot:
        """`view`, grown until it holds the shards `end` names in `generations` (a round decided by an earlier
        reader); StartedOverError when one of those generations has ended."""
        view.check_generations(generations)
        if all(len(view.of_stream(s)) >= n for s, n in end.items()):
            return view
        view = view.grown(self.storage)
        if any(len(view.of_stream(s)) < n for s, n in end.items()):
            raise StateError(f"{self.storage.url}: a recorded round names shards {dict(end)} the run does not hold "
                             f"({view.counts()}): the reader state or its rounds are another run's")
        return view

    def next(self, view: Snapshot, epoch: int, number: int, start: ShardCounts, read: Mapping[int, str]
             ) -> tuple[Snapshot, Round | None]:
        """(the view, grown, and round `number`, starting after `start`, shards of generations `read`): the
        recorded one if the book holds it, else the shards committed past `start`, waited for; None when the
        streams are complete and read. StartedOverError when a stream read has started over."""
        path = round_path(epoch, number)
        view.check_generations(read)
        if self.book is not None and self.book.exists(path):
            decided = Round.from_json(self.book.read_json(path))
            return self.covering(view, decided.end, decided.generations), decided
        since = None
        while True:
            now = self._wanted(view)
            if any(n > start.get(s, 0) for s, n in now.items()):
                break
            if view.complete(self.streams):
                return view, None
            if since is None and self.on_wait is not None:
                self.on_wait()
            since = _waiting(since, self._waiting_for(view, start, epoch))
            sigterm.sleep(self.poll)
            view = view.grown(self.storage)
        tokens = sum(sc.tokens for s, n in now.items() for sc in view.of_stream(s)[start.get(s, 0):n])
        generations = view.generations()
        decided = Round(epoch, number, counts(start), now, tokens, {s: generations[s] for s in now})
        if self.book is not None and not self.book.create_exclusive(path, json.dumps(decided.to_json()).encode()):
            decided = Round.from_json(self.book.read_json(path))  # another reader decided it first
            view = self.covering(view, decided.end, decided.generations)
        log.info("%s: epoch %d round %d reads %d newly committed shards (%d tokens)", view.url, epoch, number,
                 decided.shards(), decided.tokens)
        return view, decided

    def ended(self, epoch: int, rounds: int, rows: int) -> None:
        """Say (and record in the book, `epoch_EEEEE/end.json`) that the epoch was read: its rounds, and the
        rows served over them (every committed token of the streams read, less those left out)."""
        log.info("%s: epoch %d read the complete run in %d rounds: %d rows served", self.storage.url, epoch,
                 rounds, rows)
        if self.book is not None:
            record = {"epoch": epoch, "rounds": rounds, "rows": rows}
            self.book.create_exclusive(f"epoch_{epoch:05d}/end.json", json.dumps(record).encode())

    def _waiting_for(self, view: Snapshot, start: ShardCounts, epoch: int) -> str:
        wanted = self.streams if self.streams is not None else covered_streams(view.info)
        streams = [s for s in wanted if not view.done(s)]
        shown = ", ".join(f"{s} (shard {start.get(s, 0)})" for s in streams[:8]) + (" ..." if len(streams) > 8 else "")
        return (f"{view.url}: epoch {epoch} has read every committed shard ({sum(start.values())}); waiting for "
                f"`harvest extract` to commit more of stream{'s' if len(streams) > 1 else ''} {shown} "
                f"({len(streams)} not complete; listing every {self.poll:g}s)")


def _waiting(since: float | None, line: str) -> float:
    """Log `line` when the wait starts and every REPEAT_S after; returns when it was last logged."""
    now = time.monotonic()
    if since is None or now - since >= REPEAT_S:
        log.info("%s", line)
        return now
    return since
