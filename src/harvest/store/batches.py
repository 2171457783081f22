"""Shuffled token batches for training SAEs, probes and transcoders: streamed, split, resumable.

`TokenBatches` walks the order of store/shuffle.py. Pieces are read ahead in threads (`prefetch` pieces
beyond the group being served): from object storage as one ranged read per tensor asked for
(store/layout.py), from local disk as views of the memory-mapped file whose pages the reading thread
faults in. Memory holds about (buffer + prefetch) pieces of `piece_bytes`, whatever the shard size. The
reading thread also finds the rows to leave out (special tokens). Each batch is gathered straight from
those bytes in the group's permuted order (one copy; a batch's rows come grouped by piece), then
normalized and cast. A batch may span two groups; every batch but the last has exactly `batch_size` rows.

What is checked, and when. A shard's sidecar holds the sha256 of the whole file, which no part of the
file can be checked against. Every shard's header is checked before its first piece is served: it parses,
names this shard, describes the sidecar's byte count and token count and the run's widths and dtype, the
file has the sidecar's length, and every range arrives whole. `verify="sha256"` also hashes the whole
file once per reader (streamed, in the reading threads; locally from the page cache), so bit flips are
caught too, at the cost of reading the tensors not asked for once. `verify="auto"` (default) hashes when
the tensors asked for are at least half of a shard's bytes (the extra read is then less than the data
served, in the first epoch only), and leaves bit flips inside a few tensors of many to `harvest verify`.
A shard that fails stops the reader with one line naming it, or with `on_corrupt="skip"` is left out and
counted in `skipped_shards`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from harvest.errors import UserError
from harvest.store import format as fmt
from harvest.store import shuffle
from harvest.store.layout import (
    ShardLayout,
    file_sha256,
    map_file,
    prefault,
    read_layout,
    read_rows,
    rows_of,
)
from harvest.store.records import RunInfo

if TYPE_CHECKING:
    from harvest.store.reader import Run

log = logging.getLogger(__name__)

VERIFY = ("auto", "sha256", "header")
NORMALIZE = (None, "standardize", "norm")
ON_CORRUPT = ("stop", "skip")
STATE_VERSION = 1


class UnknownTensorError(UserError, KeyError):
    """A tensor name the run does not hold (a KeyError too, for dict-like callers)."""

    def __str__(self) -> str:
        return str(self.args[0])


class CorruptShardError(UserError):
    """A committed shard whose bytes do not match its sidecar."""


class StateError(UserError):
    """A saved reader state that does not belong to this run or these settings."""


@dataclasses.dataclass(frozen=True)
class Order:
    """Everything the token order depends on: a saved position applies only under the same Order."""

    seed: int
    shuffle: bool
    buffer: int  # pieces mixed per group
    piece_tokens: int
    rank: int
    world: int
    worker: int
    workers: int
    exclude: tuple[int, ...]  # token ids left out
    streams: tuple[int, ...] | None

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["exclude"] = list(self.exclude)
        out["streams"] = None if self.streams is None else list(self.streams)
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Order:
        return cls(**{**obj, "exclude": tuple(obj["exclude"]),
                      "streams": None if obj["streams"] is None else tuple(obj["streams"])})


@dataclasses.dataclass(frozen=True)
class Position:
    """The next row to serve: row `row` (in permuted order) of group `group` of epoch `epoch`."""

    epoch: int
    group: int
    row: int


def run_fingerprint(info: RunInfo) -> str:
    return hashlib.sha256(info.to_bytes()).hexdigest()[:16]


def torch_worker() -> tuple[int, int]:
    """(worker id, number of workers) inside a torch DataLoader worker, else (0, 1)."""
    torch = sys.modules.get("torch")
    info = torch.utils.data.get_worker_info() if torch is not None else None
    return (0, 1) if info is None else (int(info.id), int(info.num_workers))


class TokenBatches:
    """An iterable of {"tokens": [b], name: [b, d], ...} batches over epochs; see the module docstring.

    Built by `Run.token_batches`. `state_dict()` after any batch and `load_state_dict()` on a fresh one
    (same run, same order settings) continue with exactly the batches that were still to come.
    """

    def __init__(self, run: Run, batch_size: int, names: list[str], *, seed: int, shuffle: bool, buffer: int,
                 piece_bytes: int, rank: int, world: int, worker: int | None, workers: int | None,
                 exclude: Sequence[int] | None, streams: Sequence[int] | None, snapshot: dict[int, int] | None,
                 epoch: int, epochs: int | None,
                 drop_last: bool, dtype: str | None, normalize: str | None, verify: str, on_corrupt: str,
                 prefetch: int, io_threads: int, convert: Callable[[np.ndarray], Any]):
        for value, what in ((batch_size, "batch_size"), (buffer, "shard_buffer"), (piece_bytes, "piece_bytes"),
                            (world, "world"), (io_threads, "io_threads")):
            if int(value) <= 0:
                raise ValueError(f"{what} must be positive, got {value}")
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
        self.run, self.batch_size, self.names = run, int(batch_size), names
        self.keys = ["tokens", *names]
        self.epochs, self.drop_last, self.convert = epochs, drop_last, convert
        self.prefetch, self.io_threads, self.on_corrupt = max(int(prefetch), 0), int(io_threads), on_corrupt
        stored = np.dtype(fmt.DTYPES.get(run.dtype, np.float32))
        self.out_dtype = np.dtype(fmt.DTYPES[dtype]) if dtype else (np.dtype(np.float32) if normalize else stored)
        self.hash = self._hash_shards(verify, stored)
        self._stored = stored
        self._raw = {"tokens": ((), np.dtype(np.int32)),  # gathered as unsigned ints: the same bits, a fast copy
                     **{n: ((run.tensors[n],), np.dtype(f"u{stored.itemsize}")) for n in names}}
        row_bytes = 4 + sum(run.tensors[n] * stored.itemsize for n in names)
        self._settings = dict(seed=int(seed), shuffle=bool(shuffle), buffer=int(buffer),
                              piece_tokens=max(int(piece_bytes) // row_bytes, 1),
                              rank=int(rank), world=int(world),
                              exclude=tuple(sorted(set(self._excluded(exclude)))),
                              streams=None if streams is None else tuple(sorted(int(s) for s in streams)))
        self._fixed_worker = None if worker is None else (int(worker), int(workers))
        self._affine = {n: self._normalization(n, normalize) for n in names} if normalize else {}
        self._pos = Position(int(epoch), 0, 0)
        self._first_epoch = int(epoch)
        self._shard_counts: dict[int, int] | None = None  # the shards of the current epoch, per stream
        self._snapshot = None if snapshot is None else {int(st): int(n) for st, n in snapshot.items()}
        self._loaded_order: Order | None = None
        self._layouts: dict[str, Future] = {}  # shard -> its checked ShardLayout, once per reader
        self._lock = threading.Lock()
        self.skipped_shards: set[str] = set()
        self.shards_seen = 0

    # settings --------------------------------------------------------------------------------------------
    def _hash_shards(self, verify: str, stored: np.dtype) -> bool:
        if verify != "auto":
            return verify == "sha256"
        asked = sum(self.run.tensors[n] for n in self.names) * stored.itemsize + 4
        every = sum(self.run.tensors.values()) * stored.itemsize + 4
        return 2 * asked >= every

    def _excluded(self, exclude: Sequence[int] | None) -> list[int]:
        if exclude is not None:
            return [int(t) for t in exclude]
        special = self.run.info.special_token_ids
        if special is None:
            log.info("%s: run.json records no special token ids (an older run): no token is left out; "
                     "pass exclude=[ids] to leave some out", self.run.url)
            return []
        return [int(t) for t in special]

    def _normalization(self, name: str, how: str) -> tuple[np.ndarray, np.ndarray]:
        """(shift, scale) with out = (x - shift) * scale, from the run's own merged stats."""
        stats = self.run.stats(name)
        if stats.count == 0:
            raise UserError(f"{self.run.url}: normalize={how!r} needs statistics, and {name} has no token yet")
        if how == "standardize":
            return stats.mean.astype(np.float32), (1 / np.sqrt(np.maximum(stats.var, 1e-12))).astype(np.float32)
        mean_sq_norm = float(np.sum(stats.m2 / stats.count + stats.mean**2))  # E ||x||^2 over the run
        scale = np.sqrt(len(stats.mean) / max(mean_sq_norm, 1e-12))
        return np.zeros(len(stats.mean), np.float32), np.full(len(stats.mean), scale, np.float32)

    def order(self) -> Order:
        worker, workers = self._fixed_worker or torch_worker()
        return Order(worker=worker, workers=workers, **self._settings)

    # state -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Where this reader stands: JSON-serializable, for a trainer's checkpoint."""
        return {"version": STATE_VERSION, "run": run_fingerprint(self.run.info),
                "order": (self._loaded_order or self.order()).to_json(), "epoch": self._pos.epoch,
                "group": self._pos.group, "row": self._pos.row, "first_epoch": self._first_epoch,
                "shards": None if self._shard_counts is None else {str(s): n for s, n in self._shard_counts.items()},
                "skipped_shards": sorted(self.skipped_shards)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where `state` (from `state_dict`) stood. Refused with one line if it is another run's,
        or was saved under other order settings (seed, split, buffer, filters)."""
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise StateError(f"{self.run.url}: not a reader state (want the dict state_dict() returned)")
        if state["run"] != run_fingerprint(self.run.info):
            raise StateError(f"{self.run.url}: the reader state was saved for another run "
                             f"(run.json fingerprint {state['run']}, this run's {run_fingerprint(self.run.info)})")
        saved, mine = Order.from_json(state["order"]), self.order()
        if saved != mine:
            diff = ", ".join(f"{k}={getattr(saved, k)!r} (now {getattr(mine, k)!r})"
                             for k in Order.__dataclass_fields__ if getattr(saved, k) != getattr(mine, k))
            raise StateError(f"{self.run.url}: the reader state was saved with other settings: {diff}")
        counts = state["shards"]
        self._shard_counts = None if counts is None else {int(s): int(n) for s, n in counts.items()}
        self._pos = Position(int(state["epoch"]), int(state["group"]), int(state["row"]))
        self._first_epoch = int(state["first_epoch"])
        self.skipped_shards = set(state["skipped_shards"])
        self._loaded_order = saved

    # the plan --------------------------------------------------------------------------------------------
    def _epoch_shards(self, order: Order) -> list[dict[str, Any]]:
        """The epoch's shards: as the state or the snapshot fixed them, else every shard committed now
        (re-listed when the run is still being written)."""
        run = self.run
        wanted = None if order.streams is None else set(order.streams)
        counts = self._shard_counts if self._shard_counts is not None else self._snapshot
        if counts is None and self._pos.epoch > self._first_epoch and not all(run.done(s) for s in run.streams):
            run.refresh()
        if counts is not None and any(len(run.shards_of(s)) < n for s, n in counts.items()):
            run.refresh()
        by_stream = {s: run.shards_of(s) for s in run.streams if wanted is None or s in wanted}
        if counts is None:
            counts = {s: len(scs) for s, scs in by_stream.items()}
        for s, n in counts.items():
            if len(by_stream.get(s, [])) < n:
                raise StateError(f"{run.url}: the reader state or snapshot names {n} shards of stream {s}, the run "
                                 f"has {len(by_stream.get(s, []))}: not this run's")
        self._shard_counts = counts
        shards = [sc for s in sorted(counts) for sc in by_stream[s][:counts[s]]]
        tokens = sum(sc.tokens for sc in shards)
        writing = sum(1 for s in counts if not run.done(s))
        self.shards_seen = len(shards)
        log.info("%s: epoch %d reads %d committed shards (%d tokens, %d streams%s)", run.url, self._pos.epoch,
                 len(shards), tokens, len(counts), f", {writing} still being written" if writing else "")
        return shards

    def _plan(self, order: Order, shards: list[dict[str, Any]]) -> list[list[shuffle.Piece]]:
        pieces = shuffle.cut([(sc.stream, sc.shard, sc.tokens) for sc in shards],
                             order.piece_tokens)
        mine = shuffle.share(shuffle.epoch_order(pieces, order.seed, self._pos.epoch, order.shuffle),
                             order.rank, order.world, order.worker, order.workers)
        return shuffle.groups(mine, order.buffer)

    # iteration -------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[dict[str, Any]]:
        order = self._loaded_order or self.order()
        self._loaded_order = order
        while self.epochs is None or self._pos.epoch < self._first_epoch + self.epochs:
            sidecars = {(sc.stream, sc.shard): sc for sc in self._epoch_shards(order)}
            plan = self._plan(order, list(sidecars.values()))
            yield from self._serve(order, plan, sidecars)
            self._pos, self._shard_counts = Position(self._pos.epoch + 1, 0, 0), None

    def _serve(self, order: Order, plan: list[list[shuffle.Piece]], sidecars: dict) -> Iterator[dict[str, Any]]:
        """The epoch's batches from self._pos on; pieces are read `prefetch` ahead of the group served."""
        epoch, start = self._pos.epoch, self._pos
        todo = [p for g in range(start.group, len(plan)) for p in plan[g]]
        pending: collections.deque[Future] = collections.deque()
        submitted = boundary = 0
        pool = ThreadPoolExecutor(max_workers=self.io_threads, thread_name_prefix="harvest-read")
        out: dict[str, np.ndarray] | None = None
        filled = 0
        try:
            for g in range(start.group, len(plan)):
                boundary += len(plan[g])
                while submitted < min(boundary + self.prefetch, len(todo)):
                    piece = todo[submitted]
                    pending.append(pool.submit(self._read_piece, piece, sidecars[(piece.stream, piece.shard)],
                                               order.exclude))
                    submitted += 1
                group = Group([pending.popleft().result() for _ in plan[g]])
                perm = shuffle.row_order(group.rows, order.seed, epoch, order.rank, order.worker, g, order.shuffle)
                row = start.row if g == start.group else 0
                while row < group.rows:
                    if out is None:
                        out = {k: np.empty((self.batch_size, *shape), dtype) for k, (shape, dtype) in self._raw.items()}
                        filled = 0
                    take = min(self.batch_size - filled, group.rows - row)
                    group.gather(perm[row:row + take], out, filled)
                    filled += take
                    row += take
                    if filled == self.batch_size:
                        self._pos = Position(epoch, g, row) if row < group.rows else Position(epoch, g + 1, 0)
                        yield self._emit(out)
                        out = None
                del group
            if out is not None and filled and not self.drop_last:
                self._pos = Position(epoch, len(plan), 0)
                yield self._emit({k: v[:filled] for k, v in out.items()})
        finally:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=False, cancel_futures=True)

    def _emit(self, raw: dict[str, np.ndarray]) -> dict[str, Any]:
        """A gathered batch in the stored dtypes' bits -> normalized, cast, converted."""
        cols = {"tokens": raw["tokens"]}
        for n in self.names:
            x = raw[n].view(self._stored)
            if n in self._affine:
                shift, scale = self._affine[n]
                x = ((x.astype(np.float32) - shift) * scale).astype(self.out_dtype, copy=False)
            elif x.dtype != self.out_dtype:
                x = x.astype(self.out_dtype)
            cols[n] = x
        return {k: self.convert(v) for k, v in cols.items()}

    # reading ---------------------------------------------------------------------------------------------
    def _read_piece(self, piece: shuffle.Piece, sc: dict[str, Any], exclude: tuple[int, ...]) -> Part:
        """A piece's rows (views of mapped or fetched bytes, as unsigned ints of the stored width) and which
        of them to serve: runs in the reading threads."""
        rel = self.run.shard_path(sc)
        try:
            cols = self._ranged(rel, sc, piece)
        except (ValueError, FileNotFoundError) as e:
            if self.on_corrupt == "stop":
                raise CorruptShardError(f"{self.run.url}/{rel}: {e}; run `harvest verify {self.run.url}`, or read "
                                        f"past it with on_corrupt='skip'") from None
            log.warning("%s/%s: %s; skipped", self.run.url, rel, e)
            with self._lock:
                self.skipped_shards.add(rel)
            return Part({k: np.empty((0, *shape), dtype) for k, (shape, dtype) in self._raw.items()}, None)
        cols = {k: v.view(self._raw[k][1]) for k, v in cols.items()}
        keep = None
        if exclude:
            mask = ~np.isin(cols["tokens"], exclude)
            keep = None if mask.all() else np.flatnonzero(mask)
        return Part(cols, keep)

    def _ranged(self, rel: str, sc: dict[str, Any], piece: shuffle.Piece) -> dict[str, np.ndarray]:
        layout = self._layout(rel, sc)
        storage = self.run.storage
        if not storage.is_local:
            return {k: read_rows(storage, rel, layout.tensors[k], piece.lo, piece.hi) for k in self.keys}
        buf = map_file(storage.path(rel))  # the page cache, copied once: where a batch gathers its rows
        cols = {k: rows_of(buf, layout.tensors[k], piece.lo, piece.hi) for k in self.keys}
        for v in cols.values():
            prefault(v)
        return cols

    def _layout(self, rel: str, sc: dict[str, Any]) -> ShardLayout:
        """A shard's header, read and checked once per reader (and its sha256 when hashing), whichever
        reading thread gets there first; the others wait for it."""
        with self._lock:
            known = self._layouts.get(rel)
            if known is None:
                known = self._layouts[rel] = Future()
                mine = True
            else:
                mine = False
        if mine:
            try:
                known.set_result(self._check(rel, sc))
            except BaseException as e:
                known.set_exception(e)
        return known.result()

    def _check(self, rel: str, sc: dict[str, Any]) -> ShardLayout:
        """The shard's header against its sidecar and run.json, its size, and with hashing its sha256.
        Raises ValueError naming what does not match."""
        storage = self.run.storage
        layout = read_layout(storage, rel)
        fields, tokens = layout.fields, sc.tokens
        if (fields.get("stream"), fields.get("shard")) != (str(sc.stream), str(sc.shard)):
            raise ValueError(f"its header names stream {fields.get('stream')} shard {fields.get('shard')}")
        if layout.size != sc.bytes:
            raise ValueError(f"its header describes {layout.size} bytes, its sidecar {sc.bytes}")
        for k in self.keys:
            span = layout.tensors.get(k)
            want = (tokens,) if k == "tokens" else (tokens, self.run.tensors[k])
            if span is None or span.shape != want:
                raise ValueError(f"tensor {k!r} is {'missing' if span is None else list(span.shape)}, "
                                 f"the sidecar and run.json say {list(want)}")
            if k != "tokens" and span.dtype != self._stored:
                raise ValueError(f"tensor {k!r} is {span.dtype}, run.json says {self.run.dtype}")
        size = storage.size(rel)
        if size != sc.bytes:
            raise ValueError(f"the file is {size} bytes, its sidecar says {sc.bytes} (cut short or replaced)")
        if self.hash and file_sha256(storage, rel) != sc.sha256:
            raise ValueError(f"its sha256 does not match its sidecar's ({sc.sha256[:12]}...)")
        return layout


@dataclasses.dataclass
class Part:
    """A piece as read: its columns (all its rows) and the rows to serve (None: all)."""

    cols: dict[str, np.ndarray]
    keep: np.ndarray | None

    @property
    def rows(self) -> int:
        return len(self.cols["tokens"]) if self.keep is None else len(self.keep)


class Group:
    """The parts mixed together: served rows numbered 0..rows-1 across them, gathered part by part."""

    def __init__(self, parts: list[Part]):
        self.parts = parts
        self.starts = np.cumsum([0, *(p.rows for p in parts)])
        self.rows = int(self.starts[-1])

    def gather(self, rows: np.ndarray, out: dict[str, np.ndarray], at: int) -> None:
        """Copy served rows `rows` into out[k][at:at+len(rows)]: one copy, straight from the mapped or
        fetched bytes. A batch holds its rows grouped by part (the set is the shuffled sample)."""
        part_of = np.searchsorted(self.starts, rows, side="right") - 1
        local = rows - self.starts[part_of]
        ordered = np.lexsort((local, part_of))
        part_of, local = part_of[ordered], local[ordered]
        bounds = np.searchsorted(part_of, np.arange(len(self.parts) + 1))
        for j in np.flatnonzero(np.diff(bounds)):
            lo, hi = bounds[j], bounds[j + 1]
            part = self.parts[j]
            idx = local[lo:hi] if part.keep is None else part.keep[local[lo:hi]]
            for k, v in part.cols.items():  # mode="clip": indices are valid, and "raise" would copy twice
                np.take(v, idx, axis=0, out=out[k][at + lo:at + hi], mode="clip")
