"""Shuffled token batches for training SAEs, probes and transcoders: streamed, split, resumable; the order
is harvest.read.shuffle's, the reads harvest.read.pieces', a followed run's rounds harvest.read.rounds'.
Which shards an epoch reads, and why a reader stops at a started-over stream: docs/reading.md."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from harvest.errors import UserError
from harvest.read.convert import NORMALIZE, normalization, torch_converter, torch_worker
from harvest.read.errors import StateError
from harvest.read.gather import Group
from harvest.read.pieces import ON_CORRUPT, VERIFY, PieceReader, squared_norms
from harvest.read.position import STATE_VERSION, Cursor, Order, run_fingerprint
from harvest.read.rounds import Follower
from harvest.read.shuffle import Piece, cut, epoch_order, groups, row_order, share, shards_to_verify
from harvest.storage import Storage
from harvest.store import format as fmt, quant
from harvest.store.records import RunInfo, Sidecar
from harvest.store.snapshot import Snapshot, pinned
from harvest.store.stats import RunningStats

log = logging.getLogger(__name__)


class TokenBatches:
    """Token rows for SAE training: {"tokens": [b], name: [b, d], ...}, numpy (or torch with as_torch), over
    epochs; each committed token once per epoch across all consumers, and `state_dict()` continues exactly.
    Built by `Run.token_batches(batch_size, tensors, **settings)`; the settings: docs/reading.md."""

    def __init__(self, storage: Storage, view: Snapshot, batch_size: int, names: list[str], *, seed: int = 0,
                 epoch: int = 0, epochs: int | None = 1, rank: int = 0, world: int = 1, worker: int | None = None,
                 workers: int | None = None, shuffle: bool = True, shard_buffer: int = 16,
                 piece_bytes: int = 32 * 2**20, prefetch: int = 8, io_threads: int = 8, drop_last: bool = False,
                 exclude: Sequence[int] | None = None, dtype: str | None = None, normalize: str | None = None,
                 verify: str = "auto", on_corrupt: str = "stop", as_torch: bool = False,
                 streams: Sequence[int] | None = None, snapshot: Mapping[int, Any] | None = None,
                 stats: Mapping[str, RunningStats] | None = None, skip_first: int = 0,
                 max_norm: float | None = None, median_norm: Mapping[str, float] | float | None = None,
                 follow: float | None = None, rounds: Storage | None = None,
                 on_wait: Callable[[], None] | None = None):
        for value, what in ((batch_size, "batch_size"), (shard_buffer, "shard_buffer"), (piece_bytes, "piece_bytes"),
                            (world, "world"), (io_threads, "io_threads")):
            if int(value) <= 0:
                raise ValueError(f"{what} must be positive, got {value}")
        if int(skip_first) < 0:
            raise ValueError(f"skip_first must be 0 or more, got {skip_first}")
        if max_norm is not None and not float(max_norm) >= 0:
            raise ValueError(f"max_norm must be 0 (off) or more, got {max_norm}")
        if not 0 <= int(rank) < int(world):
            raise ValueError(f"rank must be in [0, world={world}), got {rank}")
        if (worker is None) != (workers is None) or (workers is not None and not 0 <= worker < workers):
            raise ValueError(f"worker/workers: give both, 0 <= worker < workers (got {worker}/{workers})")
        for value, allowed, what in ((verify, VERIFY, "verify"), (normalize, NORMALIZE, "normalize"),
                                     (on_corrupt, ON_CORRUPT, "on_corrupt")):
            if value not in allowed:
                raise ValueError(f"{what}={value!r}: use one of {', '.join(map(repr, allowed))}")
        if dtype is not None and dtype not in fmt.DTYPES:
            raise ValueError(f"dtype={dtype!r}: use one of {', '.join(fmt.DTYPES)}")
        if follow is not None and (float(follow) <= 0 or snapshot is not None):
            raise ValueError(f"follow={follow}: give the seconds between listings (> 0), and no snapshot=")
        if follow is not None and int(world) * int(workers or 1) > 1:
            raise UserError(f"{view.url}: following a run being written takes one consumer; {world} ranks x "
                            f"{workers or 1} workers were given (read it with one process, or once it is complete)")
        if snapshot is None and int(world) > 1 and not view.complete(streams):
            raise UserError(f"{view.url}: the run is still being written, and {world} ranks would each list it at "
                            "another moment: give every rank the same snapshot= (run.snapshot(), taken once)")
        self.storage, self.view, self.batch_size, self.names = storage, view, int(batch_size), names
        self.epochs, self.drop_last = epochs, drop_last
        self.convert = torch_converter() if as_torch else (lambda a: a)
        self.prefetch, self.io_threads = max(int(prefetch), 0), int(io_threads)
        stored = np.dtype(fmt.STORED_DTYPES.get(view.dtype, np.float32))
        self._coded = quant.is_quantized(view.dtype)  # 8-bit codes: served as float32 values unless dtype says
        self.out_dtype = np.dtype(fmt.DTYPES[dtype]) if dtype else (
            np.dtype(np.float32) if normalize or self._coded else stored)
        self._stored = stored
        self.pieces = PieceReader(storage, view, names, stored, verify=verify, on_corrupt=on_corrupt)
        row_bytes = 4 + sum(view.tensors[n] * stored.itemsize + 4 * self._coded for n in names)
        self.median_norms = {} if not max_norm else (
            median_norms(storage, view, names, streams=streams, exclude=exclude, snapshot=snapshot)
            if median_norm is None
            else {n: float(median_norm if isinstance(median_norm, (int, float)) else median_norm[n]) for n in names})
        self.norm_limits = {n: float(max_norm) * m for n, m in self.median_norms.items()}
        self.massive_left_out = self.tokens_considered = 0
        self._settings = dict(seed=int(seed), shuffle=bool(shuffle), buffer=int(shard_buffer),
                              piece_tokens=max(int(piece_bytes) // row_bytes, 1),
                              rank=int(rank), world=int(world),
                              exclude=tuple(sorted(set(self._excluded(exclude)))), skip_first=int(skip_first),
                              follow=follow is not None, max_norm=tuple(self.norm_limits.items()),
                              streams=None if streams is None else tuple(sorted(int(s) for s in streams)))
        self._fixed_worker = None if worker is None else (int(worker), int(workers))
        self._affine = {n: normalization(stats[n] if stats is not None else view.stats(n), normalize, n, view.url)
                        for n in names} if normalize else {}
        self._cursor = Cursor(int(epoch), 0, 0)
        self._first_epoch = int(epoch)
        self._epoch_counts: dict[int, int] | None = None  # the shards of the current epoch, per stream
        self._generations: dict[int, str] | None = None  # the generation of each stream whose shards are counted
        self._pinned, self._pinned_generations = (None, {}) if snapshot is None else pinned(snapshot)
        self._loaded_order: Order | None = None
        self._poll, self._book, self._on_wait = follow, rounds, on_wait
        self._round, self._round_start = 0, None  # following: the round read now, and the shards before it
        self._served = 0  # rows served in the current epoch
        self._batches = 0  # batches handed out by this object
        self._handed: tuple[RunInfo, dict[str, Any]] | None = None  # the run and position after the last batch
        self._planned: set[tuple] = set()  # shards (with generation and object) in any plan so far: verified by then
        self.shards_seen = 0

    @property
    def skipped_shards(self) -> set[str]:
        return self.pieces.skipped_shards

    @property
    def verified_shards(self) -> set[str]:
        """The shards whose bytes this consumer checked against their checksums (see harvest.read.pieces)."""
        return self.pieces.verified_shards

    # settings --------------------------------------------------------------------------------------------
    def _excluded(self, exclude: Sequence[int] | None) -> list[int]:
        if exclude is not None:
            return [int(t) for t in exclude]
        special = self.view.info.special_token_ids
        if special is None:
            log.info("%s: run.json records no special token ids (an older run): no token is left out; "
                     "pass exclude=[ids] to leave some out", self.view.url)
            return []
        return [int(t) for t in special]

    def order(self) -> Order:
        worker, workers = self._fixed_worker or torch_worker()
        return Order(worker=worker, workers=workers, **self._settings)

    # state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this reader stands after the last batch it handed out (even while it reads or waits for the
        next one): JSON-serializable, for a trainer's checkpoint."""
        info, position = self._handed or (self.view.info, self._position())
        return {"version": STATE_VERSION, "run": run_fingerprint(info),
                "order": (self._loaded_order or self.order()).to_json(), **position}

    def _position(self) -> dict[str, Any]:
        """Where the reader stands now in its order: kept at each batch handed out, with the run it read (whose
        fingerprint, a hash of run.json, is taken only when a state is asked for, not per batch)."""
        counts = self._epoch_counts
        return {"epoch": self._cursor.epoch, "group": self._cursor.group, "row": self._cursor.row,
                "first_epoch": self._first_epoch,
                "shards": None if counts is None else {str(s): n for s, n in counts.items()},
                "generations": None if self._generations is None else {str(s): g for s, g in self._generations.items()},
                "round": self._round,
                "round_start": None if self._round_start is None else {str(s): n for s, n in self._round_start.items()},
                "served": self._served, "skipped_shards": sorted(self.skipped_shards)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` (from `state_dict`) stood. Refused with one line if it is another run's,
        or was saved under other order settings (seed, split, buffer, filters)."""
        url, mine_run = self.view.url, run_fingerprint(self.view.info)
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise StateError(f"{url}: not a reader state (want the dict state_dict() returned)")
        if state["run"] != mine_run:
            raise StateError(f"{url}: the reader state was saved for another run "
                             f"(run.json fingerprint {state['run']}, this run's {mine_run})")
        saved, mine = Order.from_json(state["order"]), self.order()
        if saved != mine:
            diff = ", ".join(f"{k}={getattr(saved, k)!r} (now {getattr(mine, k)!r})"
                             for k in Order.__dataclass_fields__ if getattr(saved, k) != getattr(mine, k))
            raise StateError(f"{url}: the reader state was saved with other settings: {diff}")
        counts, generations = state["shards"], state.get("generations")
        self._epoch_counts = None if counts is None else {int(s): int(n) for s, n in counts.items()}
        self._generations = None if generations is None else {int(s): str(g) for s, g in generations.items()}
        self._cursor = Cursor(int(state["epoch"]), int(state["group"]), int(state["row"]))
        self._first_epoch = int(state["first_epoch"])
        start = state.get("round_start")
        self._round, self._served = int(state.get("round", 0)), int(state.get("served", 0))
        self._round_start = None if start is None else {int(s): int(n) for s, n in start.items()}
        self.skipped_shards.update(state["skipped_shards"])
        self._loaded_order, self._handed = saved, None

    # the plan --------------------------------------------------------------------------------------------
    def _epoch_shards(self, order: Order) -> list[Sidecar]:
        """The epoch's shards: as the saved state or the snapshot fixed them (in the generations they were
        counted in), else the reader's listing (re-listed at a new epoch of a run still being written when this
        is the only consumer)."""
        counts = self._epoch_counts if self._epoch_counts is not None else self._pinned
        read = (self._generations if self._epoch_counts is not None else self._pinned_generations) or {}
        sole = order.world * order.workers == 1
        if counts is None and sole and self._cursor.epoch > self._first_epoch and not self.view.complete(order.streams):
            self.view = Snapshot.take(self.storage)
        if counts is not None and (any(len(self.view.of_stream(s)) < n for s, n in counts.items())
                                   or not self.view.holds(read)):
            self.view = Snapshot.take(self.storage)  # listed before the state or snapshot was taken
        self.view.check_generations(read)
        wanted = None if order.streams is None else set(order.streams)
        if counts is None:
            counts = {s: n for s, n in self.view.counts().items() if wanted is None or s in wanted}
        try:
            view = self.view.limited({s: n for s, n in counts.items() if wanted is None or s in wanted})
        except ValueError as e:
            raise StateError(f"{self.view.url}: the reader state or snapshot is not this run's ({e})") from None
        self._epoch_counts, self._generations = counts, view.generations()
        writing = sum(1 for s in counts if not view.done(s))
        self.shards_seen = len(view.shards)
        # said once, and again while the run grows: a small run read for many epochs would repeat it each time
        say = log.info if self._cursor.epoch == 0 or writing else log.debug
        say("%s: epoch %d reads %d committed shards (%d tokens, %d streams%s)", view.url, self._cursor.epoch,
            len(view.shards), view.num_tokens, len(counts), f", {writing} still being written" if writing else "")
        return list(view.shards)

    def _plan(self, order: Order, shards: list[Sidecar], round_: int = 0) -> list[list[Piece]]:
        """This consumer's groups of pieces for the epoch (or a round of it); marks the shards whose bytes it
        verifies."""
        pieces = cut([(sc.stream, sc.shard, sc.tokens) for sc in shards], order.piece_tokens)
        everyone = epoch_order(pieces, order.seed, self._cursor.epoch, order.shuffle, round_)
        mine = share(everyone, order.rank, order.world, order.worker, order.workers)
        owned = shards_to_verify(everyone, order.rank, order.world, order.worker, order.workers)
        keys = {(sc.stream, sc.shard): (sc.stream, sc.shard, sc.generation, sc.file) for sc in shards}
        self.pieces.to_verify = {shard for shard in owned if keys[shard] not in self._planned}
        self._planned |= set(keys.values())
        return groups(mine, order.buffer)

    # iteration -------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = self._loaded_order or self.order()
        self._loaded_order = order
        if order.follow and order.world * order.workers > 1:
            raise UserError(f"{self.view.url}: following a run being written takes one consumer, not {order.workers} "
                            "data-loader workers (use num_workers=0, or read it once it is complete)")
        carry = None  # a batch begun and not yet full: (rows, filled)
        while self.epochs is None or self._cursor.epoch < self._first_epoch + self.epochs:
            if order.follow and self._cursor.epoch == self._first_epoch:
                carry = yield from self._follow(order, carry)
            else:
                whole, handed = self._cursor == Cursor(self._cursor.epoch, 0, 0), self._batches
                sidecars = {(sc.stream, sc.shard): sc for sc in self._epoch_shards(order)}
                carry = yield from self._serve(order, self._plan(order, list(sidecars.values())), sidecars, carry)
                if not order.follow:  # the epoch's last batch is short (or dropped)
                    if carry is not None and not self.drop_last:
                        yield self._hand({k: v[:carry[1]] for k, v in carry[0].items()})
                    if self.epochs is None and whole and self._batches == handed:
                        self._endless_and_empty(order, carry)
                    carry = None
            self._cursor, self._epoch_counts, self._served = Cursor(self._cursor.epoch + 1, 0, 0), None, 0
            self._generations = None
            self._round, self._round_start = 0, None
        if carry is not None and not self.drop_last:
            yield self._hand({k: v[:carry[1]] for k, v in carry[0].items()})

    def _follow(self, order: Order, carry: tuple | None) -> Iterator[dict[str, Any]]:
        """The first epoch of a run being written, round after round; returns the batch begun last."""
        epoch = self._cursor.epoch
        follower = Follower(self.storage, order.streams, self._poll, self._book, self._on_wait)
        while True:
            if self._epoch_counts is None:
                self.view, decided = follower.next(self.view, epoch, self._round, self._round_start or {},
                                                   self._generations or {})
                if decided is None:
                    follower.ended(epoch, self._round, self._served)
                    return carry
                self._round_start, self._epoch_counts = decided.start, decided.end
                self._generations = decided.generations or {s: self.view.of_stream(s)[0].generation
                                                            for s in decided.end}
                self._cursor = Cursor(epoch, 0, 0)
            else:
                self.view = follower.covering(self.view, self._epoch_counts, self._generations or {})
            start = self._round_start or {}
            shards = [sc for sc in self.view.limited(self._epoch_counts).shards if sc.shard >= start.get(sc.stream, 0)]
            self.shards_seen = sum(self._epoch_counts.values())
            sidecars = {(sc.stream, sc.shard): sc for sc in shards}
            carry = yield from self._serve(order, self._plan(order, shards, self._round), sidecars, carry, self._round)
            self._round, self._round_start, self._epoch_counts = self._round + 1, self._epoch_counts, None

    def _serve(self, order: Order, plan: list[list[Piece]], sidecars: dict, carry: tuple | None,
               round_: int = 0) -> Iterator[dict[str, Any]]:
        """The plan's full batches from the cursor on, the first one completing `carry`; returns the batch
        begun last (None when the rows ran out on a batch boundary). Pieces are read `prefetch` ahead of the
        group served."""
        epoch, start = self._cursor.epoch, self._cursor
        todo = [p for g in range(start.group, len(plan)) for p in plan[g]]
        pending: collections.deque[Future] = collections.deque()
        submitted = boundary = 0
        pool = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="harvest-read")
        out, filled = carry if carry is not None else (None, 0)
        try:
            for g in range(start.group, len(plan)):
                boundary += len(plan[g])
                while submitted < min(boundary + self.prefetch, len(todo)):
                    piece = todo[submitted]
                    pending.append(pool.submit(self.pieces.read, piece, sidecars[(piece.stream, piece.shard)],
                                               order.exclude, order.skip_first, order.max_norm))
                    submitted += 1
                group = Group([pending.popleft().result() for _ in plan[g]])
                massive = sum(part.massive for part in group.parts)
                self.massive_left_out += massive
                self.tokens_considered += massive + group.rows
                perm = row_order(group.rows, order.seed, epoch, order.rank, order.worker, g, order.shuffle,
                                         round_)
                row = start.row if g == start.group else 0
                while row < group.rows:
                    if out is None:
                        out = {k: np.empty((self.batch_size, *shape), dtype)
                               for k, (shape, dtype) in self.pieces.raw.items()}
                        filled = 0
                    take = min(self.batch_size - filled, group.rows - row)
                    group.gather(perm[row:row + take], out, filled)
                    filled += take
                    row += take
                    self._served += take
                    if filled == self.batch_size:
                        self._cursor = Cursor(epoch, g, row) if row < group.rows else Cursor(epoch, g + 1, 0)
                        yield self._hand(out)
                        out = None
                del group
            self._cursor = Cursor(epoch, len(plan), 0)
            return (out, filled) if out is not None and filled else None
        finally:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=False, cancel_futures=True)

    def _endless_and_empty(self, order: Order, carry: tuple | None) -> None:
        """An endless read (epochs=None) whose whole epoch gave no batch would loop for ever without one."""
        rows = 0 if carry is None else carry[1]
        whose = f"this reader's share ({order.rank} of {order.world}) of " if order.world * order.workers > 1 else ""
        raise UserError(f"{self.view.url}: an epoch of {whose}the streams read gives {rows:,} tokens, fewer than one "
                        f"batch of {self.batch_size:,}" + (" (drop_last)" if self.drop_last else "")
                        + ": reading for ever would never yield a batch; read more streams or tokens, or take "
                          "smaller batches")

    def _hand(self, raw: dict[str, np.ndarray]) -> dict[str, Any]:
        """The batch to hand out, and the position after it."""
        self._batches += 1
        batch = self._emit(raw)
        self._handed = (self.view.info, self._position())
        return batch

    def _emit(self, raw: dict[str, np.ndarray]) -> dict[str, Any]:
        """A gathered batch in the stored dtypes' bits -> dequantized, normalized, cast, converted."""
        cols = {"tokens": raw["tokens"]}
        for n in self.names:
            x = raw[n].view(self._stored)
            if self._coded:
                x = quant.dequantize(x, raw[quant.scale_name(n)].view(np.float32))
            if n in self._affine:
                shift, scale = self._affine[n]
                x = ((x.astype(np.float32) - shift) * scale).astype(self.out_dtype, copy=False)
            elif x.dtype != self.out_dtype:
                x = x.astype(self.out_dtype)
            cols[n] = x
        return {k: self.convert(v) for k, v in cols.items()}


MEDIAN_SAMPLE = 2**16  # tokens the median norm is taken over (or the whole run, when smaller)


def median_norms(storage: Storage, view: Snapshot, names: list[str], *, streams: Sequence[int] | None = None,
                 exclude: Sequence[int] | None = None, snapshot: Mapping[int, Any] | None = None,
                 sample: int = MEDIAN_SAMPLE) -> dict[str, float]:
    """{tensor: the median L2 norm of its tokens}, over the first `sample` tokens of the streams read in a
    reader's order with seed 0 (every token when the run holds fewer): the same number on every rank and in
    every rerun of the same committed shards, whatever the trainer's seed. Each sample's first tokens count
    (they are few; the median hardly moves); `exclude` and `snapshot` as the reader's (default: the special
    tokens; the shards listed now)."""
    reader = TokenBatches(storage, view, sample, list(names), seed=0, epochs=1, exclude=exclude, dtype="float32",
                          streams=streams, snapshot=snapshot, prefetch=2)
    batch = next(iter(reader), None)
    if batch is None or not len(batch["tokens"]):
        raise UserError(f"{view.url}: max_norm needs the run's median token norm, and the streams read hold no token")
    return {n: float(np.median(np.sqrt(squared_norms(batch[n])))) for n in names}
