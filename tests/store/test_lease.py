"""Leases, as a rule against duplicated work: compare-and-swap on local disk, fake-gcs-server and moto's S3
server; two contenders for one free lease never both win; a lease is taken over only after the taker saw
it unchanged for the holder's own TTL on its own monotonic clock, and never while it moves; a worker whose
lease was taken over is fenced out; the same worker id takes its lease back at once only from a holder
proven dead (gone, or a zombie), and a holder running on this host is taken over after its TTL like any."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from harvest.errors import FencedOut, UserError
from harvest.storage import Storage
from harvest.store.lease import LEASE, LeaseHeld, Leases, process_key
from harvest.store.records import LeaseRecord, now_iso


def _rel(stream: int) -> str:
    return f"stream_{stream:05d}/{LEASE}"


def _put(st: Storage, stream: int, **fields) -> LeaseRecord:
    record = LeaseRecord(**{"worker": "gone", "version": 7, "heartbeat_at": now_iso(), "holder": "h0",
                            "ttl_s": 300.0, "host": "elsewhere", "pid": 1, **fields})
    st.write_bytes(_rel(stream), record.to_bytes())
    return record


def _read(st: Storage, stream: int) -> LeaseRecord:
    return LeaseRecord.from_bytes(st.read_bytes(_rel(stream)))


class _CountingStorage(Storage):
    """Storage that counts compare-and-swaps lost to a concurrent writer (instrumentation, not a stand-in)."""

    lost_swaps = 0

    def replace_if(self, rel, data, token):
        swapped = super().replace_if(rel, data, token)
        if not swapped:
            type(self).lost_swaps += 1
        return swapped


@pytest.mark.parametrize("kind", ["local", "s3", "gs"])
def test_two_contenders_for_one_released_lease_exactly_one_wins(kind, tmp_path, request):
    url = str(tmp_path / "out") if kind == "local" else request.getfixturevalue(f"{'gcs' if kind == 'gs' else 's3'}_url")
    st = _CountingStorage(url)
    _CountingStorage.lost_swaps = 0
    rounds = 30 if kind != "gs" else 15  # the emulator serves one request at a time: slower
    for stream in range(rounds):
        _put(st, stream, released=True)
        gate = threading.Barrier(2)
        won: dict[str, bool] = {}
        # The loser watches the winner's lease (staleness is by TTL alone) until its heartbeat moves it.
        contenders = {name: Leases(st, name, ttl_s=1.0) for name in ("a", "b")}

        def contend(name: str) -> None:
            gate.wait()
            try:
                contenders[name].acquire([stream])
                won[name] = True
            except (LeaseHeld, FencedOut):
                won[name] = False

        threads = [threading.Thread(target=contend, args=(name,)) for name in contenders]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for leases in contenders.values():
            leases._stop.set()  # no more heartbeats, no release: the lease stays as the race left it
        winners = [name for name, ok in won.items() if ok]
        assert len(winners) == 1, f"round {stream}: {won}"
        record = _read(st, stream)
        assert record.worker == winners[0] and record.holder == contenders[winners[0]].id, record
    # Both read the stale lease and raced to swap it in some rounds: the swap, not luck, decided those.
    assert _CountingStorage.lost_swaps > 0


def test_a_worker_whose_lease_was_taken_over_is_fenced_out(root):
    st = Storage(root)
    errors: list[UserError] = []
    a = Leases(st, "a", ttl_s=1.0, on_lost=errors.append)
    a.process = ""  # as on another VM: nothing here proves it alive or gone
    a.acquire([3])
    a._stop.set()  # A stalls: no heartbeats
    started = time.monotonic()
    b = Leases(st, "b", ttl_s=60)  # B waits A's TTL (1 s, from A's record), not its own 60 s
    b.acquire([3])
    assert 1.0 <= time.monotonic() - started < 10 and _read(st, 3).worker == "b"
    a.refresh(3)  # A wakes: its compare-and-swap finds B's version
    with pytest.raises(FencedOut, match=r"stream 3 was taken over by worker 'b' on .* \(pid \d+\)"):
        a.check(3)
    assert len(errors) == 1 and isinstance(errors[0], FencedOut)
    a.release(3)  # a fenced-out worker releases nothing
    assert _read(st, 3).worker == "b" and not _read(st, 3).released
    b.release_all()
    assert _read(st, 3).released


def test_a_lease_that_moves_while_watched_is_refused_and_a_long_ttl_is_honoured(tmp_path):
    """The holder's TTL is in its lease: a taker started with --lease-ttl 0.3 still waits the holder's 2 s, and
    the holder's heartbeat (every 2/6 s) moves the version before then, so the taker stops (LeaseHeld)."""
    st = Storage(str(tmp_path / "out"))
    holder = Leases(st, "a", ttl_s=2.0)
    holder.process = ""  # as from another container: nothing on this host proves it alive or gone
    holder.acquire([0])
    try:
        started = time.monotonic()
        with pytest.raises(LeaseHeld, match="held by worker 'a' on .*whose lease moved while this worker watched"):
            Leases(st, "b", ttl_s=0.3).acquire([0])
        assert time.monotonic() - started < 2.0
        assert _read(st, 0).worker == "a"
    finally:
        holder.release_all()


def test_an_unconfirmed_lease_is_confirmed_before_a_write(root):
    """Stopped past half the TTL but not taken over: the check before a write refreshes it and goes on."""
    st = Storage(root)
    a = Leases(st, "a", ttl_s=0.6)
    a.acquire([0])
    a._stop.set()
    time.sleep(0.5)
    version = _read(st, 0).version
    a.check(0)
    assert _read(st, 0).version == version + 1


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_a_lease_write_whose_reply_was_lost_stays_this_workers(kind, request):
    """The request lands, its reply is dropped, the retry meets the worker's own record: still its lease."""
    st = Storage(request.getfixturevalue(f"{kind}_proxy_url"))
    proxy = request.getfixturevalue(f"{kind}_proxy")
    errors: list[UserError] = []
    a = Leases(st, "a", ttl_s=60, on_lost=errors.append)
    proxy.lose_replies(0.5)
    a.acquire([0, 1])  # creates whose replies were lost
    a._stop.set()  # no background heartbeat: the refreshes below are the only writers
    assert {_read(st, s).worker for s in (0, 1)} == {"a"} and a.held == {0, 1}
    version = _read(st, 0).version
    proxy.lose_replies(0.5)
    a.refresh(0)  # a swap whose reply was lost; its retry fails against the version it wrote
    a.check(0)
    assert not errors
    record = _read(st, 0)
    assert record.worker == "a" and record.version == version + 1 and a.held == {0, 1}
    a.release_all()
    assert all(_read(st, s).released for s in (0, 1))


def _proc(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


def test_only_a_holder_proven_dead_is_taken_at_once_else_the_ttl_whatever_runs_here(tmp_path):
    st = Storage(str(tmp_path / "out"))
    here = Leases(st, "probe").host
    live = _proc("import time; time.sleep(60)")
    dead = _proc("import time; time.sleep(60)")
    zombie = _proc("import time; time.sleep(60)")
    time.sleep(0.2)
    dead_key = process_key(dead.pid)  # taken while it ran: its pid, start time, boot and pid namespace
    dead.kill()
    dead.wait()
    zombie.kill()  # killed, not reaped: a zombie, which never writes again
    boot, ns, pid, start = dead_key.split(":")
    try:
        # Killed (SIGKILL, OOM): its pid is gone, or a zombie. The same worker id takes it at once.
        _put(st, 1, worker="w", host=here, process=dead_key)
        _put(st, 2, worker="w", host=here, pid=zombie.pid, process=process_key(zombie.pid))
        began = time.monotonic()
        Leases(st, "w").acquire([1, 2])
        assert time.monotonic() - began < 1.0 and _read(st, 1).version == 8 and _read(st, 2).version == 8
        # A TTL of silence frees the lease, whoever takes it: a holder running on this host but not renewing
        # (hung, stopped), another worker id however dead its holder, and the same id in another container
        # (pid namespace), on another VM, or on another boot under the same hostname (a VM or container
        # twin: the hostname proves nothing).
        _put(st, 0, worker="w", host=here, pid=live.pid, process=process_key(live.pid), ttl_s=1.0)
        _put(st, 3, worker="x", host=here, process=dead_key, ttl_s=1.0)
        _put(st, 4, worker="w", host="old-vm", ttl_s=1.0)
        _put(st, 5, worker="w", host=here, process=f"{boot}:another-namespace:1:{start}", ttl_s=1.0)
        _put(st, 7, worker="w", host=here, process=f"another-boot:{ns}:{pid}:{start}", ttl_s=1.0)
        # Released: anyone, at once.
        _put(st, 6, worker="x", released=True)
        began = time.monotonic()
        Leases(st, "w").acquire([0, 3, 4, 5, 6, 7])  # watched together: one TTL, not five
        assert 1.0 <= time.monotonic() - began < 3.0
        assert {_read(st, s).host for s in (0, 3, 4, 5, 6, 7)} == {here}
    finally:
        for proc in (live, zombie):
            proc.kill()
            proc.wait()


def test_all_or_none_and_a_corrupt_lease_is_one_line(tmp_path):
    st = Storage(str(tmp_path / "out"))
    holder = Leases(st, "x", ttl_s=1.0)
    holder.acquire([2])  # a live holder: its heartbeat moves the lease while the other watches it
    try:
        leases = Leases(st, "w")
        with pytest.raises(LeaseHeld):
            leases.acquire([0, 1, 2])
        assert _read(st, 0).released and _read(st, 1).released and not leases.held
    finally:
        holder.release_all()
    st.write_bytes(_rel(4), b'{"worker": 5}')
    with pytest.raises(UserError, match=r"lease.json: not a harvest lease .*'worker'") as caught:
        Leases(st, "w").acquire([4])
    assert "\n" not in str(caught.value)
