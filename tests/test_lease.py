"""Leases that are enforced: compare-and-swap on local disk, the GCS emulator and moto's S3 server; two
contenders for one stale lease never both win; a worker whose lease was taken over is fenced out; the
same worker id takes its lease back only when the holder is provably gone."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from harvest.errors import FencedOut, UserError
from harvest.storage import Storage
from harvest.store.lease import LEASE, LeaseHeld, Leases, boot_id
from harvest.store.records import LeaseRecord, now_iso

LONG_AGO = "2020-01-01T00:00:00+00:00"


def _rel(stream: int) -> str:
    return f"stream_{stream:05d}/{LEASE}"


def _put(st: Storage, stream: int, **fields) -> LeaseRecord:
    record = LeaseRecord(**{"worker": "gone", "host": "elsewhere", "boot_id": "b0", "pid": 1, "version": 7,
                            "heartbeat_at": now_iso(), **fields})
    st.write_bytes(_rel(stream), record.to_bytes())
    return record


def _read(st: Storage, stream: int) -> LeaseRecord:
    return LeaseRecord.from_bytes(st.read_bytes(_rel(stream)))


def test_compare_and_swap(root):
    st = Storage(root)
    assert st.read_versioned("k.json") is None
    assert st.replace_if("k.json", b"x", "anything") is False and not st.exists("k.json")
    st.write_bytes("k.json", b"one")
    first = st.read_versioned("k.json")
    assert first.data == b"one"
    assert st.replace_if("k.json", b"two", first.token) is True
    assert st.read_bytes("k.json") == b"two"
    assert st.replace_if("k.json", b"three", first.token) is False  # a stale version never swaps
    assert st.read_bytes("k.json") == b"two"
    second = st.read_versioned("k.json")
    assert second.token != first.token and st.replace_if("k.json", b"three", second.token) is True


class _CountingStorage(Storage):
    """Storage that counts compare-and-swaps lost to a concurrent writer (instrumentation, not a stand-in)."""

    lost_swaps = 0

    def replace_if(self, rel, data, token):
        swapped = super().replace_if(rel, data, token)
        if not swapped:
            type(self).lost_swaps += 1
        return swapped


@pytest.mark.parametrize("kind", ["local", "s3", "gs"])
def test_two_contenders_for_one_stale_lease_exactly_one_wins(kind, tmp_path, request):
    url = str(tmp_path / "out") if kind == "local" else request.getfixturevalue(f"{'gcs' if kind == 'gs' else 's3'}_url")
    st = _CountingStorage(url)
    _CountingStorage.lost_swaps = 0
    rounds = 50 if kind != "gs" else 20  # the emulator serves one request at a time: slower
    for stream in range(rounds):
        _put(st, stream, heartbeat_at=LONG_AGO)
        gate = threading.Barrier(2)
        won: dict[str, bool] = {}

        def contend(name: str) -> None:
            leases = Leases(st, name, ttl_s=60)
            gate.wait()
            try:
                leases.acquire([stream])
                won[name] = True
            except LeaseHeld:
                won[name] = False
            finally:
                leases._stop.set()  # no heartbeat, no release: the lease stays as the race left it

        threads = [threading.Thread(target=contend, args=(name,)) for name in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [name for name, ok in won.items() if ok]
        assert len(winners) == 1, f"round {stream}: {won}"
        record = _read(st, stream)
        assert record.worker == winners[0] and record.version == 8, record
    # Both read the stale lease and raced to swap it in some rounds: the swap, not luck, decided those.
    assert _CountingStorage.lost_swaps > 0


def test_a_worker_whose_lease_was_taken_over_is_fenced_out(root):
    st = Storage(root)
    errors: list[UserError] = []
    a = Leases(st, "a", ttl_s=60, on_lost=errors.append)
    a.acquire([3])
    a._stop.set()  # A stalls: no heartbeats
    time.sleep(1.1)
    b = Leases(st, "b", ttl_s=1.0)  # to B, A's heartbeat is past the TTL
    b.acquire([3])
    assert _read(st, 3).worker == "b"
    a.refresh(3)  # A wakes: its compare-and-swap finds B's version
    with pytest.raises(FencedOut, match=r"stream 3 was taken over by worker 'b' on .* \(pid \d+\)"):
        a.check(3)
    assert len(errors) == 1 and isinstance(errors[0], FencedOut)
    a.release(3)  # a fenced-out worker releases nothing
    assert _read(st, 3).worker == "b" and not _read(st, 3).released
    b.release_all()
    assert _read(st, 3).released


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


def test_the_same_worker_id_takes_its_lease_back_only_from_a_holder_provably_gone(tmp_path):
    st = Storage(str(tmp_path / "out"))
    here, boot = socket.gethostname(), boot_id()
    live = _proc("import time; time.sleep(60)")
    dead = _proc("pass")
    dead.wait()
    try:
        # Two terminals, one command: the holder is a live process of this boot.
        _put(st, 0, worker="w", host=here, boot_id=boot, pid=live.pid)
        with pytest.raises(LeaseHeld, match=rf"stream 0 is held by worker 'w' on {here} \(pid {live.pid}\)"):
            Leases(st, "w").acquire([0])
        assert _read(st, 0).pid == live.pid
        # Killed (SIGKILL, OOM): a dead pid of this boot.
        _put(st, 1, worker="w", host=here, boot_id=boot, pid=dead.pid)
        Leases(st, "w").acquire([1])
        assert _read(st, 1).version == 8 and _read(st, 1).pid != dead.pid
        # The host rebooted.
        _put(st, 2, worker="w", host=here, boot_id="another-boot", pid=live.pid)
        Leases(st, "w").acquire([2])
        # Another worker id, however dead its pid: only the TTL frees the lease.
        _put(st, 3, worker="x", host=here, boot_id=boot, pid=dead.pid)
        with pytest.raises(LeaseHeld, match="worker 'x'"):
            Leases(st, "w").acquire([3])
        # Released, or stale: anyone.
        _put(st, 4, worker="x", released=True)
        _put(st, 5, worker="x", heartbeat_at=LONG_AGO)
        Leases(st, "w").acquire([4, 5])
        # The same id on another host (a recovered VM) cannot prove the old one gone: it waits for the TTL.
        _put(st, 6, worker="w", host="old-vm")
        started = time.monotonic()
        Leases(st, "w", ttl_s=1.5).acquire([6])
        assert time.monotonic() - started > 1.0 and _read(st, 6).host == here
    finally:
        live.kill()
        live.wait()


def test_all_or_none_and_a_corrupt_lease_is_one_line(tmp_path):
    st = Storage(str(tmp_path / "out"))
    _put(st, 2, worker="x")
    leases = Leases(st, "w")
    with pytest.raises(LeaseHeld):
        leases.acquire([0, 1, 2])
    assert _read(st, 0).released and _read(st, 1).released and not leases.held
    st.write_bytes(_rel(4), b'{"worker": 5}')
    with pytest.raises(UserError, match=r"lease.json: not a harvest lease .*'worker'") as caught:
        Leases(st, "w").acquire([4])
    assert "\n" not in str(caught.value)
