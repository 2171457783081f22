"""One writer per stream, enforced: a lease object per stream, taken and refreshed by conditional writes.

`stream_NNNNN/lease.json` names its holder (worker id, host, boot id, pid) and a version. Taking a free
lease is a create-if-absent; taking over a released or stale one, and every heartbeat, is a
compare-and-swap on the object's version (`Storage.replace_if`), so of two contenders exactly one wins.

Who may take a lease held by someone else:
- anyone, once it is released or its heartbeat is older than the TTL;
- the same worker id, when its holder is provably gone: another boot of this host, or a dead pid on this
  boot. The same worker id on another host (a fleet worker recovered on a new VM) waits for the TTL.
Anyone else is refused at once (`LeaseHeld`, exit 2), before writing anything.

A holder that finds, on a heartbeat, that someone else holds its lease, or whose heartbeats have failed
for longer than half the TTL, is fenced out: `check(stream)` raises from then on and the committer calls
it before every write of the stream, so nothing lands after that moment; `on_lost` tells the job, which
stops with one line (`FencedOut`, exit 3, or `RetryLater`, exit 75 when storage was unreachable).
Half the TTL leaves the other half as margin before another worker may take over.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable

from harvest.errors import FencedOut, RetryLater, UserError
from harvest.store import format as fmt
from harvest.storage import Storage, Versioned
from harvest.store.records import LeaseRecord, now_iso

log = logging.getLogger(__name__)

LEASE = "lease.json"


class LeaseHeld(UserError):
    """A live worker holds the stream: this one stops before writing anything."""


def boot_id() -> str:
    """This boot of this host (Linux); '' where unknown, which proves nothing about the holder."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Held:
    """What this worker knows about a lease it holds: the record it wrote, its token, when it was last
    confirmed (monotonic clock: a stopped or suspended process sees the whole gap)."""

    def __init__(self, record: LeaseRecord, token: str, confirmed: float):
        self.record, self.token, self.confirmed = record, token, confirmed


class Leases:
    """This worker's leases. See the module docstring."""

    def __init__(self, storage: Storage, worker: str, ttl_s: float = 300.0,
                 on_lost: Callable[[UserError], None] | None = None):
        self.storage = storage
        self.worker = worker
        self.ttl_s = float(ttl_s)
        self.on_lost = on_lost or (lambda error: None)
        self.host, self.boot, self.pid = socket.gethostname(), boot_id(), os.getpid()
        self._held: dict[int, _Held] = {}
        self._lost: dict[int, UserError] = {}
        self._io = threading.Lock()  # held while a lease is rewritten: a heartbeat never revives a release
        self._state = threading.Lock()  # guards _held and _lost (never held across storage calls)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> set[int]:
        return set(self._held)

    # --- taking -----------------------------------------------------------------------------------------

    def acquire(self, streams: list[int]) -> None:
        """Take every stream's lease in order, or none: on a refusal, release what was taken and raise."""
        try:
            for stream in sorted(streams):  # one order everywhere: of two racing workers, one gets them all
                self._acquire(stream)
        except BaseException:
            self.release_all()
            raise
        if self._thread is None:
            self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="lease-heartbeat")
            self._thread.start()

    def _record(self, version: int, released: bool = False) -> LeaseRecord:
        return LeaseRecord(worker=self.worker, host=self.host, boot_id=self.boot, pid=self.pid, version=version,
                           heartbeat_at=now_iso(), released=released)

    def _acquire(self, stream: int) -> None:
        rel = _rel(stream)
        first_sent = None  # when this process first wrote the lease: the freshness of any write of it that landed
        while True:
            current = self.storage.read_versioned(rel)
            if current is None:
                mine = self._record(1)
                first_sent = time.monotonic() if first_sent is None else first_sent
                if self.storage.create_exclusive(rel, mine.to_bytes()):
                    self._take(stream, mine, rel, first_sent)
                    return
                continue  # someone created it meanwhile: look again
            held = _parse(current, self.storage.url_of(rel))
            if first_sent is not None and self._wrote(held):  # this process's write landed; its reply was lost
                self._held[stream] = _Held(held, current.token, first_sent)
                return
            wait = self._wait_before_taking(stream, held)
            if wait > 0:
                log.info("stream %d: its lease is held by the same worker id %r on %s (pid %d), which cannot be "
                         "proven gone from here; waiting %.0fs for its heartbeat to expire",
                         stream, held.worker, held.host, held.pid, wait)
                time.sleep(min(wait, 10.0))
                continue
            mine = self._record(held.version + 1)
            first_sent = time.monotonic() if first_sent is None else first_sent
            if self.storage.replace_if(rel, mine.to_bytes(), current.token):
                if not held.released:
                    log.warning("stream %d: took over the lease of %s", stream, held.describe())
                self._take(stream, mine, rel, first_sent)
                return
            # Another contender won the swap: look again (it is probably held now).

    def _take(self, stream: int, mine: LeaseRecord, rel: str, sent: float) -> None:
        written = self.storage.read_versioned(rel)
        if written is None or _parse(written, rel) != mine:
            raise FencedOut(f"stream {stream}: the lease changed hands while it was being taken; rerun to retry")
        self._held[stream] = _Held(mine, written.token, sent)

    def _wait_before_taking(self, stream: int, held: LeaseRecord) -> float:
        """0: the lease may be taken now; > 0: seconds until it may; raises LeaseHeld if it may not."""
        age = held.age_s()
        if held.released or age > self.ttl_s:
            return 0.0
        if held.worker == self.worker:
            same_host = held.host == self.host
            if same_host and held.boot_id and self.boot and held.boot_id != self.boot:
                return 0.0  # the host rebooted: the holder is gone
            if same_host and held.boot_id == self.boot and held.pid != self.pid and not pid_alive(held.pid):
                return 0.0  # a dead process of this boot
            if not same_host:
                return self.ttl_s - age
        raise LeaseHeld(f"stream {stream} is held by {held.describe()}, heartbeat {age:.0f}s ago; "
                        "give each worker its own --streams (and --worker-id), or rerun after it stopped")

    # --- holding ----------------------------------------------------------------------------------------

    def check(self, stream: int) -> None:
        """Raise if this worker may no longer write `stream`. Called before every write of it.

        Cheap while the heartbeat keeps the lease confirmed. Unconfirmed for over half the TTL (the
        process was stopped, starved or cut off), it confirms now with one compare-and-swap, which
        succeeds only if nobody touched the lease since: otherwise the stream is lost, to the holder it
        names, or, storage unreachable, for now.
        """
        lost = self._lost.get(stream)
        if lost is not None:
            raise lost
        held = self._held.get(stream)
        if held is None:
            raise FencedOut(f"stream {stream}: this worker holds no lease on it")
        silent = time.monotonic() - held.confirmed
        if silent <= self.ttl_s / 2:
            return
        try:
            self.refresh(stream)
        except UserError as e:
            raise self._lose(stream, RetryLater(
                f"stream {stream}: its lease could not be refreshed for {silent:.0f}s, over half of --lease-ttl "
                f"{self.ttl_s:.0f}s ({e}); stopped writing it. Rerun the same command to resume")) from None
        lost = self._lost.get(stream)
        if lost is not None:
            raise lost

    def _lose(self, stream: int, error: UserError) -> UserError:
        with self._state:
            if stream in self._lost:
                return self._lost[stream]
            self._lost[stream] = error
            self._held.pop(stream, None)
        self.on_lost(error)
        return error

    def _heartbeat(self) -> None:
        interval = max(0.05, self.ttl_s / 6)  # about three tries before half the TTL runs out
        while not self._stop.wait(interval):
            for stream in sorted(self._held):
                try:
                    self.refresh(stream)
                except UserError as e:  # storage trouble: retried next time, until check() gives up
                    log.warning("stream %d: lease heartbeat failed (%s)", stream, e)
                    with contextlib.suppress(UserError):
                        self.check(stream)

    def refresh(self, stream: int) -> None:
        """One heartbeat: a compare-and-swap from the version this worker wrote last to the next one.

        A swap whose reply was lost may still have landed; the retry then fails against this process's own
        record. Read back, a record naming this process is ours (no one else writes that identity): it is
        adopted and swapped once more, so the confirmation time is that of a write known to have landed.
        """
        rel = _rel(stream)
        with self._io:
            for _ in range(3):
                held = self._held.get(stream)
                if held is None:
                    return
                sent = time.monotonic()  # the lease is fresh from when its heartbeat was written, not acknowledged
                mine = self._record(held.record.version + 1)
                self.storage.replace_if(rel, mine.to_bytes(), held.token)
                current = self.storage.read_versioned(rel)
                record = _parse(current, rel) if current is not None else None
                if record == mine:
                    held.record, held.token, held.confirmed = mine, current.token, sent
                    return
                if record is None or not self._wrote(record):
                    break
                held.record, held.token = record, current.token
            else:
                raise UserError(f"stream {stream}: the replies to its lease heartbeats keep getting lost")
        holder = record.describe() if record is not None else "nobody (the lease was deleted)"
        self._lose(stream, FencedOut(f"stream {stream} was taken over by {holder} while this worker was "
                                     "stalled or cut off; it stopped writing there (nothing after that moment "
                                     "was committed)"))

    def _wrote(self, record: LeaseRecord) -> bool:
        """Whether `record` is one this process wrote and did not release (worker id, host, boot and pid)."""
        return (not record.released and record.worker == self.worker and record.host == self.host
                and record.boot_id == self.boot and record.pid == self.pid)

    # --- giving back ------------------------------------------------------------------------------------

    def release(self, stream: int) -> None:
        """Mark the lease released (a compare-and-swap: a lease taken over meanwhile is left alone)."""
        with self._io:
            with self._state:
                held = self._held.pop(stream, None)
            if held is None:
                return
            released = self._record(held.record.version + 1, released=True)
            try:
                self.storage.replace_if(_rel(stream), released.to_bytes(), held.token)
            except UserError as e:  # it expires by its TTL instead
                log.warning("stream %d: could not release its lease (%s)", stream, e)

    def release_all(self) -> None:
        self._stop.set()
        for stream in sorted(self._held):
            self.release(stream)


def _rel(stream: int) -> str:
    return f"{fmt.stream_dir(stream)}/{LEASE}"


def _parse(current: Versioned, where: str) -> LeaseRecord:
    try:
        return LeaseRecord.from_bytes(current.data)
    except ValueError as e:
        raise UserError(f"{where}: not a harvest lease ({e}); delete it if no worker runs on that stream") from None

