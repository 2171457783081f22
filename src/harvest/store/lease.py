"""One writer per stream, as a rule for not duplicating work: a lease object per stream (stream_NNNNN/lease.json,
a LeaseRecord), taken by create-if-absent and taken over or refreshed by compare-and-swap, so of two contenders
one wins. Exactly-once does not rest on it (the commit refuses a fenced worker's late write: harvest.store.commit).
Staleness is the holder's own TTL watched on this process's monotonic clock (no wall clock compared across
hosts), shortened only for a holder proven dead on this boot. A holder that finds another holder, or cannot
refresh for half its TTL, is fenced out: `check(stream)` raises from then on. The rules: docs/storage.md."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable

from harvest.clock import SYSTEM, Clock
from harvest.errors import FencedOut, RetryLater, UserError
from harvest.runtime.sigterm import Interrupted
from harvest.store import format as fmt, generation
from harvest.storage import Storage, Versioned
from harvest.store.holder import holder_alive, process_key
from harvest.store.records import GenerationRecord, LeaseRecord, now_iso

log = logging.getLogger(__name__)

LEASE = fmt.LEASE
MAX_POLL_S = 2.0  # a watched lease is read at least this often (more often for short TTLs)


class LeaseHeld(UserError):
    """A live worker holds the stream: this one stops before writing anything."""


class _Held:
    """What this worker knows about a lease it holds: the record it wrote, its token, when it was last
    confirmed (monotonic clock: a stopped or suspended process sees the whole gap)."""

    def __init__(self, record: LeaseRecord, token: str, confirmed: float):
        self.record, self.token, self.confirmed = record, token, confirmed


class _Watched:
    """A lease held by another worker, as first seen by this one: its version token and since when."""

    def __init__(self, record: LeaseRecord, token: str, since: float):
        self.record, self.token, self.since = record, token, since


class Leases:
    """This worker's leases. See the module docstring. `heartbeat=False` leaves the heartbeats to the
    caller (`refresh`), for a simulation that schedules them itself."""

    def __init__(self, storage: Storage, worker: str, ttl_s: float = 300.0,
                 on_lost: Callable[[UserError], None] | None = None, *, clock: Clock = SYSTEM,
                 heartbeat: bool = True):
        self.storage = storage
        self.worker = worker
        self.ttl_s = float(ttl_s)
        self.on_lost = on_lost or (lambda error: None)
        self.clock = clock
        self.id = uuid.uuid4().hex  # this process's identity in its lease records
        self.host, self.pid, self.process = socket.gethostname(), os.getpid(), process_key()
        self._heartbeat_on = heartbeat
        self._held: dict[int, _Held] = {}
        self._lost: dict[int, UserError] = {}
        self._given_up: dict[int, _Held] = {}  # lost streams, released by `release_all` where still this worker's
        self._io = threading.Lock()  # held while a lease is rewritten: a heartbeat never revives a release
        self._state = threading.Lock()  # guards _held and _lost (never held across storage calls)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def held(self) -> set[int]:
        return set(self._held)

    # --- taking -----------------------------------------------------------------------------------------

    def acquire(self, streams: list[int]) -> None:
        """Take every stream's lease, or none: on a refusal, release what was taken and raise.

        Leases held by others are watched together (not one TTL after another): each is taken once it stayed
        unchanged for its holder's TTL; the first one seen to move refuses the whole command. Streams are taken
        in one order everywhere, and none past one found held (those are only looked at), so that of two
        workers racing for the same streams one gets them all: they cannot split them and each wait, without
        heartbeats, for the other's half to go stale."""
        try:
            pending = sorted(streams)
            while pending:
                watched: dict[int, _Watched] = {}
                for stream in pending:
                    seen = self._held_by_other(stream) if watched else self._try_take(stream, None)
                    if seen is not None:
                        watched[stream] = seen
                if watched:
                    self._wait_out(watched)
                pending = [s for s in pending if s not in self._held]
        except BaseException:
            self.release_all()
            raise
        if self._heartbeat_on and self._thread is None:
            self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="lease-heartbeat")
            self._thread.start()

    def _wait_out(self, watched: dict[int, _Watched]) -> None:
        first = next(iter(watched.values())).record
        log.info("stream%s %s: held by %s (--lease-ttl %.0fs); taken over if unchanged for that long",
                 "s" if len(watched) > 1 else "", ",".join(map(str, sorted(watched))), first.describe(), first.ttl_s)
        while watched:
            poll = min(MAX_POLL_S, min(w.record.ttl_s for w in watched.values()) / 6)
            self.clock.sleep(max(0.05, poll))
            for stream in sorted(watched):
                seen = self._try_take(stream, watched[stream])
                if seen is None:
                    del watched[stream]
                else:
                    watched[stream] = seen

    def _record(self, version: int, like: LeaseRecord | GenerationRecord | None, released: bool = False
                ) -> LeaseRecord:
        """This worker's record of the lease after `like` (a fresh lease: the generation pointer's, or None),
        its generation carried on."""
        return LeaseRecord(worker=self.worker, version=version, heartbeat_at=now_iso(), holder=self.id,
                           ttl_s=self.ttl_s, host=self.host, pid=self.pid, process=self.process, released=released,
                           generation=like.generation if like else "", ended=list(like.ended) if like else [])

    def _held_by_other(self, stream: int) -> _Watched | None:
        """What is watched of the lease from now on where another worker holds it; None where it is free."""
        current = self.storage.read_versioned(fmt.lease_path(stream))
        if current is None:
            return None
        held = _parse(current, self.storage, stream)
        if held.holder == self.id or not self._live(held):
            return None
        return _Watched(held, current.token, self.clock.monotonic())

    def _live(self, held: LeaseRecord) -> bool:
        """Held, as far as this worker can tell (not released, not a holder of its own host proven dead)."""
        dead = not held.released and held.worker == self.worker and holder_alive(held) is False
        return not (held.released or dead)

    def _try_take(self, stream: int, watched: _Watched | None) -> _Watched | None:
        """Take the lease if it may be taken now (None); else what is watched of it from now on. Raises
        LeaseHeld when the watched lease moved: its holder is alive."""
        rel = fmt.lease_path(stream)
        first_sent = None  # when this process first wrote the lease: the freshness of any write of it that landed
        seen, fresh = None, False  # the generation pointer as read before this process's last write of the lease
        while True:
            current = self.storage.read_versioned(rel)
            if current is None:  # a fresh lease, from the pointer (a lease a person deleted loses nothing)
                seen, fresh = generation.read(self.storage, stream), True
                mine = self._record(1, generation.parse(self.storage, stream, seen))
                first_sent = self.clock.monotonic() if first_sent is None else first_sent
                if self.storage.create_exclusive(rel, mine.to_bytes()):
                    self._take(stream, mine, rel, first_sent, seen, fresh)
                    return None
                continue  # someone created it meanwhile: look again
            held = _parse(current, self.storage, stream)
            if held.holder == self.id and not held.released:  # this process's write landed; its reply was lost
                self._held[stream] = _Held(held, current.token, first_sent or self.clock.monotonic())
                self._follow(stream, seen, fresh)
                return None
            now = self.clock.monotonic()
            if self._live(held):
                if watched is None or first_sent is not None:
                    return _Watched(held, current.token, now)
                if current.token != watched.token:
                    raise LeaseHeld(f"stream {stream} is held by {held.describe()}, whose lease moved while this "
                                    "worker watched it; give each worker its own --streams (and --worker-id), "
                                    "or rerun after it stopped")
                if now - watched.since < held.ttl_s:
                    return watched
                log.warning("stream %d: %s left its lease unchanged for %.0fs (its --lease-ttl %.0fs); taking it over",
                            stream, held.describe(), now - watched.since, held.ttl_s)
            mine = self._record(held.version + 1, held)
            first_sent = now if first_sent is None else first_sent
            seen, fresh = generation.read(self.storage, stream), False
            if self.storage.replace_if(rel, mine.to_bytes(), current.token):
                self._take(stream, mine, rel, first_sent, seen, fresh)
                return None
            # Another contender won the swap: look again (it is probably held now).

    def _take(self, stream: int, mine: LeaseRecord, rel: str, sent: float, seen: Versioned | None,
              fresh: bool) -> None:
        written = self.storage.read_versioned(rel)
        if written is None or _parse(written, self.storage, stream) != mine:
            raise FencedOut(f"stream {stream}: the lease changed hands while it was being taken; rerun to retry")
        self._held[stream] = _Held(mine, written.token, sent)
        self._follow(stream, seen, fresh)

    def _follow(self, stream: int, seen: Versioned | None, fresh: bool) -> None:
        """Reconcile the stream's generation pointer with the lease just taken (harvest.store.generation.follow;
        `seen`: the pointer read before the take): a pointer ahead is taken into the lease by a fenced swap."""
        def adopt(named: GenerationRecord) -> None:
            self.refresh(stream, {"generation": named.generation, "ended": list(named.ended)})
            self.check(stream)
        generation.follow(self.storage, stream, self._held[stream].record, seen, fresh, adopt)

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
        silent = self.clock.monotonic() - held.confirmed
        if silent <= self.ttl_s / 2:
            return
        try:
            self.refresh(stream)
        except UserError as e:
            raise self.lose(stream, RetryLater(
                f"stream {stream}: its lease could not be refreshed for {silent:.0f}s, over half of --lease-ttl "
                f"{self.ttl_s:.0f}s ({e}); stopped writing it. Rerun the same command to resume")) from None
        lost = self._lost.get(stream)
        if lost is not None:
            raise lost

    def generation(self, stream: int) -> str:
        """The generation of `stream` this worker writes (harvest.store.commit): the one its lease names."""
        held = self._held.get(stream)
        if held is None:
            raise FencedOut(f"stream {stream}: this worker holds no lease on it")
        return held.record.generation

    def start_generation(self, stream: int, generation: str) -> list[str]:
        """Make `generation` the stream's current one (a wipe: harvest.store.commit.wipe), by one
        compare-and-swap of the lease from the version this worker holds: it lands only while this worker
        holds the stream. Returns the generations ended so far, the one just ended last; raises, and ends
        nothing, when the stream was lost."""
        self.check(stream)
        held = self._held[stream].record
        self.refresh(stream, {"generation": generation, "ended": [*held.ended, held.generation]})
        self.check(stream)
        return list(self._held[stream].record.ended)

    def lose(self, stream: int, error: UserError) -> UserError:
        """Record that this worker may no longer write `stream` (e.g. another writer committed its next
        shard first): every later `check` raises `error`."""
        with self._state:
            if stream in self._lost:
                return self._lost[stream]
            self._lost[stream] = error
            held = self._held.pop(stream, None)
            if held is not None:  # released at the end all the same: a swap that lands only where it is still ours
                self._given_up[stream] = held
        self.on_lost(error)
        return error

    def heartbeat_interval(self) -> float:
        return max(0.05, self.ttl_s / 6)  # about three tries before half the TTL runs out

    def heartbeat_once(self) -> None:
        for stream in sorted(self._held):
            try:
                self.refresh(stream)
            except (UserError, Interrupted) as e:  # storage trouble: retried next time, until check() gives up
                log.warning("stream %d: lease heartbeat failed (%s)", stream, e)
                with contextlib.suppress(UserError, Interrupted):
                    self.check(stream)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_interval()):
            self.heartbeat_once()

    def refresh(self, stream: int, change: dict | None = None) -> None:
        """One heartbeat: a compare-and-swap from the version this worker wrote last to the next one, with the
        fields in `change` set (a new generation: `start_generation`).

        A swap whose reply was lost may still have landed; the retry then fails against this process's own
        record. Read back, a record naming this process's id is ours (no one else writes it): it is adopted
        and swapped once more, so the confirmation time is that of a write known to have landed.
        """
        rel = fmt.lease_path(stream)
        with self._io:
            for _ in range(3):
                held = self._held.get(stream)
                if held is None:
                    return
                sent = self.clock.monotonic()  # fresh from when the heartbeat was written, not acknowledged
                mine = dataclasses.replace(self._record(held.record.version + 1, held.record), **(change or {}))
                self.storage.replace_if(rel, mine.to_bytes(), held.token)
                current = self.storage.read_versioned(rel)
                record = _parse(current, self.storage, stream) if current is not None else None
                if record == mine:
                    held.record, held.token, held.confirmed = mine, current.token, sent
                    return
                if record is None or record.holder != self.id or record.released:
                    break
                held.record, held.token = record, current.token
            else:
                raise UserError(f"stream {stream}: the replies to its lease heartbeats keep getting lost")
        holder = record.describe() if record is not None else "nobody (the lease was deleted)"
        self.lose(stream, FencedOut(f"stream {stream} was taken over by {holder} while this worker was "
                                    "stalled or cut off; it stopped writing there (nothing after that moment "
                                    "was committed)"))

    # --- giving back ------------------------------------------------------------------------------------

    def release(self, stream: int) -> None:
        """Mark the lease released (a compare-and-swap: a lease taken over meanwhile is left alone)."""
        with self._io:
            with self._state:
                held = self._held.pop(stream, None) or self._given_up.pop(stream, None)
            if held is None:
                return
            released = self._record(held.record.version + 1, held.record, released=True)
            try:
                self.storage.replace_if(fmt.lease_path(stream), released.to_bytes(), held.token)
            except (UserError, Interrupted) as e:  # it is taken over after its TTL instead
                log.warning("stream %d: could not release its lease (%s)", stream, e)

    def drop_untouched(self) -> list[int]:
        """Give back, as if this worker had never come, each held stream that holds nothing but its lease and
        generation pointer (never written to, never wiped: its lease names the generation "" and no ended one):
        the stream's directory is deleted whole while the lease is still this worker's (checked by its version,
        under the lock heartbeats take), so a worker waiting for the stream then finds it free. For a command
        that stops on bad input:
        it leaves no trace of the streams it did not write. Returns those streams; the others stay held
        (`release_all` releases them). Storage errors leave a stream held, for `release_all`."""
        dropped = []
        for stream in sorted(self._held):
            with self._io:
                held = self._held.get(stream)
                if held is None or held.record.generation or held.record.ended:
                    continue
                try:
                    if set(self.storage.listdir(fmt.stream_dir(stream))) - {LEASE, fmt.GENERATION}:
                        continue
                    current = self.storage.read_versioned(fmt.lease_path(stream))
                    if current is None or current.token != held.token:
                        continue
                    self.storage.delete_tree(fmt.stream_dir(stream))
                    with self._state:
                        self._held.pop(stream, None)
                except UserError as e:
                    log.warning("stream %d: could not remove its untouched directory (%s)", stream, e)
                    continue
                dropped.append(stream)
        return dropped

    def forget(self, stream: int) -> None:
        """Stop holding `stream` without writing its lease again: the caller deletes it with the stream. Taken
        under the lock heartbeats write under: once it returns, no write of the lease is in flight."""
        with self._io, self._state:
            self._held.pop(stream, None)

    def release_all(self) -> None:
        """Release every lease this process took, lost ones included (a lease lost while storage was unreachable
        may still be this worker's: the swap from the version it wrote lands only then)."""
        self._stop.set()
        for stream in sorted({*self._held, *self._given_up}):
            self.release(stream)


def _parse(current: Versioned, storage: Storage, stream: int) -> LeaseRecord:
    try:
        return LeaseRecord.from_bytes(current.data)
    except ValueError as e:
        problem = f"{storage.url_of(fmt.lease_path(stream))}: not a harvest lease ({e})"
    if storage.exists(fmt.generation_path(stream)):
        raise UserError(f"{problem}; delete it if no worker runs on that stream (the stream's committed generation "
                        "is kept in generation.json)")
    raise UserError(f"{problem}; do not delete it: it names the generation the stream's shards lie in (the run was "
                    "written before generation.json): restore it, or rerun with --overwrite of that stream after "
                    "fixing it by hand")
