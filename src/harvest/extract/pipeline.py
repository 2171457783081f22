"""The extraction pipeline: three stages joined by bounded queues (a slow stage makes the others wait;
nothing is dropped):
  feeder thread   reads records, renders and tokenizes them, packs rows, assembles batches;
  main thread     runs the forward on device and starts the device->host copies;
  host thread     takes the captures to host numpy and cuts them into shards, which the Committer's
                  threads encode and write (data, then sidecar).
A stage's exception reaches the main thread (and every stage stops); so does a lost lease. `stop()` (SIGTERM)
ends the run early on every process together: no batch is taken after it, the shards already closed are
committed within STOP_WAIT_S (what is still in flight then is abandoned, RetryLater) and the rows of the shards
still open are dropped (a rerun computes them again).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
from concurrent.futures import Future
import threading
import time
from typing import Any, Callable, Iterator

import jax
import numpy as np

from harvest.data.batching import Row
from harvest.extract.report import Progress
from harvest.extract.startup import Startup, since_start
from harvest.model import Decoder
from harvest.runtime import distributed
from harvest.runtime.mesh import data_slots
from harvest.store import format as fmt, quant
from harvest.store.committer import ABORT_WAIT_S, Committer, abandoned_at_stop

QUEUE_DEPTH = 2
STOP_WAIT_S = 5.0  # how long a stop (SIGTERM) waits for the commits in flight before it abandons them
log = logging.getLogger("harvest")


def run_pipeline(decoder: Decoder, todo: dict[int, list[int]], stream_rows, batch_size: int, seq_len: int,
                 writers: dict, committer: Committer, progress: Progress, failure: list[BaseException],
                 compiled: Future | None = None, stop: Callable[[], bool] = lambda: False,
                 startup: Startup | None = None, slot_rows: int | None = None) -> bool:
    """Feed, forward and write until every slot's streams are done (on every process together), or until
    `stop()` is true on any process; returns whether it stopped early, when the shards closed by then are
    committed. Raises the first failure of any stage. `compiled`: the forward's compile under way
    (model.compile_forward), awaited before the first batch. `startup`: records the feeder's first batch and the
    first forward's dispatch, and logs its line then. `slot_rows`: a slot's rows per step (default batch_size;
    the whole batch where it is one slot)."""
    shape = (data_slots(decoder.mesh) * batch_size, seq_len)
    idle = Batch(np.zeros(shape, np.int32), np.zeros(shape, np.int32), [None] * shape[0])
    batches = progress.waits.queue("feeder", QUEUE_DEPTH)  # its gets: the forward loop waiting on the feeder
    captured = progress.waits.queue("chip", QUEUE_DEPTH)  # its gets: the host waiting on the forward
    halt = threading.Event()
    startup = startup or Startup()
    rows_start = since_start()
    feeder = Stage(lambda: feed(todo, stream_rows, slot_rows or batch_size, shape, batches, failure, halt,
                                first=lambda: startup.span("rows", rows_start)), failure)
    host = Stage(lambda: to_shards(captured, decoder, writers, committer, progress), failure)
    deadline = None  # a stop's: the commits in flight then end by it, or are abandoned
    try:
        if compiled is not None:
            compiled.result()  # while the feeder makes the first rows
        stopped = _steps(decoder, batches, captured, idle, writers, failure, stop, startup)
        halt.set()
        deadline = time.monotonic() + STOP_WAIT_S if stopped else None
        put(captured, None, failure, deadline=deadline)
        host.join(failure, deadline)
        feeder.join(failure, deadline)
        with progress.waits.on("storage"):
            committer.close(deadline)
    except BaseException as error:
        _abandon(error, failure, halt, committer,
                 wait_s=ABORT_WAIT_S if deadline is None else max(0.5, deadline - time.monotonic()))
        raise
    return stopped


def _steps(decoder: Decoder, batches: queue.Queue, captured: queue.Queue, idle: Batch, writers: dict,
           failure: list[BaseException], stop: Callable[[], bool], startup: Startup) -> bool:
    """The forward loop: batches in, captures (their copies to host started) out; whether it stopped early."""
    local_done = False
    while True:
        if distributed.any_true(stop()):
            return True
        batch = None if local_done else get(batches, failure)
        local_done = batch is None
        # Every process runs every step (the model may span hosts); the run ends on all of them together.
        if not distributed.any_true(not local_done):
            return False
        outputs = decoder.step((batch or idle).tokens, (batch or idle).segments)
        if batch is not None and startup.batch_started():
            log.info(startup.line())
        if batch is not None and writers:
            for array in jax.tree.leaves(outputs):
                for shard in local_blocks(array):
                    shard.data.copy_to_host_async()
            if not put(captured, (batch, *outputs), failure, stop):  # stop: the host may wait on a held commit
                return True


def _abandon(error: BaseException, failure: list[BaseException], halt: threading.Event,
             committer: Committer, wait_s: float) -> None:
    """A failing run stops every stage (each sees the failure) and leaves none of its data objects behind: the
    Committer ends its commit in flight and deletes the rest, waiting at most `wait_s`. The host thread is not
    waited for: it may be blocked on a device whose peer died."""
    if not failure:
        failure.append(error)
    halt.set()
    committer.abort(wait_s)



@dataclasses.dataclass
class Batch:
    tokens: np.ndarray  # [slots * batch_size, seq]
    segments: np.ndarray
    rows: list[tuple[int, Row] | None]  # per batch row: (stream, row), None for padding rows


def local_blocks(array: jax.Array) -> list:
    """One addressable shard per distinct batch block (model-axis replicas hold the same rows) of an array
    [layers, batch, ...] (captures, their scales, moments); each holds whole rows (every layer, at full width),
    as forward's output sharding pins them."""
    seen: dict[int, Any] = {}
    for shard in array.addressable_shards:
        if shard.data.shape[:1] + shard.data.shape[2:] != array.shape[:1] + array.shape[2:]:
            raise AssertionError(f"captures split other than by batch row: {array.sharding}")
        seen.setdefault(shard.index[1].start or 0, shard)
    return [seen[k] for k in sorted(seen)]


class Stage(threading.Thread):
    """A pipeline thread whose exception is handed to the main thread instead of being lost."""

    def __init__(self, target, failure: list[BaseException]):
        super().__init__(daemon=True)
        self._target_fn = target
        self._failure = failure
        self.start()

    def run(self) -> None:
        try:
            self._target_fn()
        except BaseException as e:
            self._failure.append(e)

    def join(self, failure=None, deadline: float | None = None) -> None:  # type: ignore[override]
        super().join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if failure:
            raise failure[0]
        if self.is_alive():
            raise abandoned_at_stop()


def put(q: queue.Queue, item, failure: list[BaseException], halt: Callable[[], bool] | None = None,
        deadline: float | None = None) -> bool:
    """Put `item` when there is room; False (not put) once `halt()` is true. Past `deadline` (time.monotonic; a
    stop's), RetryLater."""
    while True:
        if failure:
            raise failure[0]
        if halt is not None and halt():
            return False
        if deadline is not None and time.monotonic() > deadline:
            raise abandoned_at_stop()
        try:
            q.put(item, timeout=0.5)
            return True
        except queue.Full:
            continue


def get(q: queue.Queue, failure: list[BaseException]):
    while True:
        if failure:
            raise failure[0]
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            continue


def feed(slots: dict[int, list[int]], stream_rows, batch_size: int, shape: tuple[int, int], batches: queue.Queue,
          failure: list[BaseException], halt: threading.Event, first: Callable[[], None] | None = None) -> None:
    """Batches of `batch_size` rows for each slot this process feeds (the other blocks stay empty: other
    processes feed them); a slot out of streams pads with empty rows. Stops when `halt` is set. `first()` is
    called once the first batch is made."""
    iterators = {k: _chain(streams_of_slot, stream_rows) for k, streams_of_slot in slots.items()}
    live = {k: True for k in slots}
    while any(live.values()):
        tokens, segments = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        rows: list[tuple[int, Row] | None] = [None] * shape[0]
        for k, it in iterators.items():
            for i in range(k * batch_size, (k + 1) * batch_size):
                item = next(it, None) if live[k] else None
                if item is None:
                    live[k] = False
                    continue
                rows[i] = item
                tokens[i], segments[i] = item[1].tokens, item[1].segments
        if not any(rows):
            continue
        if first is not None:
            first()
            first = None
        if not put(batches, Batch(tokens, segments, rows), failure, halt.is_set):
            return
    put(batches, None, failure, halt.is_set)


def _chain(stream_ids: list[int], stream_rows) -> Iterator[tuple[int, Row]]:
    for stream in stream_ids:
        for row in stream_rows(stream):
            yield stream, row


def to_shards(captured: queue.Queue, decoder: Decoder, writers, committer: Committer, progress: Progress) -> None:
    """Host side: the rows of the slots this process owns, to numpy, to their stream's writer; closed shards
    to the committer."""
    names = [(p, j, fmt.tensor_name(p, layer)) for p, layers in decoder.plan.points for j, layer in enumerate(layers)]
    while (item := captured.get()) is not None:
        batch, captures, moments = item
        with progress.waits.on("chip"):
            jax.block_until_ready((captures, moments))  # the forward's values: until then the host waits on the chip
        blocks = jax.tree.map(host_blocks, (captures, moments))
        # A quantizing decoder's scales [layers, batch, seq] go beside their codes, under the tensor's scale name.
        taken = names + [(quant.scale_name(p), j, quant.scale_name(name)) for p, j, name in names
                         if quant.scale_name(p) in captures]
        for r, entry in enumerate(batch.rows):
            if entry is None or entry[0] not in writers:  # another process writes that slot
                continue
            stream, row = entry
            values = {name: row_of(blocks[0][p], r)[j, : row.used] for p, j, name in taken}
            own = {name: tuple(row_of(m, r)[j] for m in blocks[1][p]) for p, j, name in names} if moments else None
            for shard in writers[stream].add_row(row, values, own):
                with progress.waits.on("storage"):
                    committer.submit(shard)  # blocks while storage is behind
            progress.rows_done(stream, row)


def host_blocks(array: jax.Array) -> list[tuple[int, np.ndarray]]:
    """(first batch row, host numpy) of each of this process's blocks of `array` [layers, batch, ...]."""
    return [(shard.index[1].start or 0, np.asarray(shard.data)) for shard in local_blocks(array)]


def row_of(blocks: list[tuple[int, np.ndarray]], r: int) -> np.ndarray:
    """Batch row r, [layers, ...], from the block that holds it."""
    start, block = next((s, b) for s, b in reversed(blocks) if s <= r)
    return block[:, r - start]
