"""Conditional writes (create_exclusive, replace_if) on local disk, fake-gcs-server and moto S3: the store
decides, so of two writers racing exactly one wins, and a write whose reply was lost is still told right.
Then the hooks a simulation builds on: Storage over any backend, waiting on any clock."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import threading
import time

import pytest

from harvest.storage import Backend, PreconditionFailed, Storage, StorageError, StorageUnreachable, Versioned

pytest_plugins = ["storage_servers"]

LOGGER = "harvest.storage.storage"


def _race(*calls):
    """Run the calls at the same moment, one thread each; their results in order."""
    barrier = threading.Barrier(len(calls))
    results: list = [None] * len(calls)

    def go(i: int) -> None:
        barrier.wait()
        results[i] = calls[i]()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_create_exclusive(root):
    st = Storage(root)
    assert st.create_exclusive("s/lease.json", b'{"worker": "a"}') is True
    assert st.create_exclusive("s/lease.json", b'{"worker": "b"}') is False
    assert st.read_bytes("s/lease.json") == b'{"worker": "a"}'
    st.delete("s/lease.json")
    assert st.create_exclusive("s/lease.json", b'{"worker": "c"}') is True
    assert st.read_bytes("s/lease.json") == b'{"worker": "c"}'


def test_create_exclusive_race_has_one_winner(root):
    st = Storage(root)
    for round_ in range(4):
        rel = f"race/{round_}.json"
        won = _race(*[lambda w=w: st.create_exclusive(rel, f'{{"worker": "w{w}"}}'.encode()) for w in range(2)])
        assert won.count(True) == 1, won
        assert st.read_json(rel) == {"worker": f"w{won.index(True)}"}


def test_a_create_cut_short_leaves_a_temp_that_goes_once_the_file_exists(tmp_path, monkeypatch):
    """A kill inside run.json's create leaves its temp; a resumed worker clears it once run.json exists, and
    only then (before, its creator may still be writing it). A contender whose temp was cleared under it is
    told the file exists, as any other contender is."""
    import harvest.storage.local as local

    st = Storage(str(tmp_path / "run"))
    os.makedirs(tmp_path / "run")
    cut = ".run.json.harvest-tmp-4194305-0123456789ab"  # a pid no process here has
    other = ".progress.json.harvest-tmp-4194305-ba9876543210"
    for name in (cut, other):
        (tmp_path / "run" / name).write_bytes(b"{")
    assert st.remove_stale_temps(of="run.json") == []
    assert st.create_exclusive("run.json", b'{"run": 1}') is True
    assert st.remove_stale_temps(of="run.json") == [cut]
    assert sorted(os.listdir(tmp_path / "run")) == [other, "run.json"]

    write_synced = local._write_synced

    def swept_meanwhile(tmp, parts):
        write_synced(tmp, parts)
        os.remove(tmp)  # another worker's remove_stale_temps(of="run.json")

    monkeypatch.setattr(local, "_write_synced", swept_meanwhile)
    assert st.create_exclusive("run.json", b'{"run": 2}') is False
    assert st.read_bytes("run.json") == b'{"run": 1}'
    assert sorted(os.listdir(tmp_path / "run")) == [other, "run.json"]


def test_replace_if(root):
    st = Storage(root)
    assert st.read_versioned("k.json") is None
    assert st.replace_if("k.json", b"x", "1") is False and not st.exists("k.json")
    st.write_bytes("k.json", b"one")
    first = st.read_versioned("k.json")
    assert first.data == b"one"
    assert st.replace_if("k.json", b"two", first.token) is True
    assert st.replace_if("k.json", b"three", first.token) is False  # a stale version never swaps
    assert st.replace_if("k.json", b"three", "not-a-version") is False
    assert st.read_bytes("k.json") == b"two"
    second = st.read_versioned("k.json")
    assert second.token != first.token and st.replace_if("k.json", b"three", second.token) is True
    third = st.read_versioned("k.json")
    st.delete("k.json")
    assert st.replace_if("k.json", b"four", third.token) is False and not st.exists("k.json")  # gone


def test_replace_if_race_has_one_winner(root):
    st = Storage(root)
    st.write_bytes("lease.json", b"v0")
    for round_ in range(4):
        token = st.read_versioned("lease.json").token
        won = _race(*[lambda w=w: st.replace_if("lease.json", f"r{round_}w{w}".encode(), token) for w in range(2)])
        assert won.count(True) == 1, won
        assert st.read_bytes("lease.json") == f"r{round_}w{won.index(True)}".encode()


class _Unanswered:
    """A real backend whose first conditional write gets no answer: with `lands`, the write is done and its
    reply lost; without, the request is lost and another writer's gets there first."""

    def __init__(self, inner: Backend, lands: bool):
        self.inner, self.lands, self.unanswered = inner, lands, 0

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def _first(self, write, theirs) -> None:
        if self.unanswered:
            return write()
        self.unanswered += 1
        write() if self.lands else theirs()
        raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")

    def create(self, path: str, data: bytes) -> None:
        self._first(lambda: self.inner.create(path, data), lambda: self.inner.create(path, b"theirs"))

    def replace(self, path: str, data: bytes, token: str) -> None:
        self._first(lambda: self.inner.replace(path, data, token), lambda: self.inner.replace(path, b"theirs", token))


@pytest.mark.parametrize("op", ["create", "replace"])
@pytest.mark.parametrize("lands", [True, False], ids=["reply-lost", "request-lost"])
def test_an_unanswered_conditional_write_is_told_by_reading_back(root, op, lands):
    """Ours landed, its reply lost: the retry finds the object there, reads our bytes back: True. Ours never
    arrived and another writer's did: the retry finds theirs: False."""
    st = Storage(root)
    lossy = _Unanswered(st.backend, lands)
    mine = Storage(root, backend=lossy, backoff=0.01)
    if op == "create":
        won = mine.create_exclusive("lease.json", b'{"worker": "me"}')
    else:
        st.write_bytes("lease.json", b'{"worker": "old"}')
        won = mine.replace_if("lease.json", b'{"worker": "me"}', st.read_versioned("lease.json").token)
    assert lossy.unanswered == 1
    assert won is lands
    assert st.read_bytes("lease.json") == (b'{"worker": "me"}' if lands else b"theirs")


def test_replies_lost_on_the_wire(flaky, caplog):
    """The proxy passes the write on and drops its reply (the server acted): the retry still answers
    True, exactly once. The reply lost is the write's own, whenever its request comes; a transport that
    resent the write unseen (aiohttp does for a PUT) would meet its own object and answer False."""
    url, proxy = flaky
    st = Storage(url)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    proxy.lose_next_replies(1)
    assert st.create_exclusive("lease.json", b'{"worker": "me", "version": 1}') is True
    token = st.read_versioned("lease.json").token
    proxy.lose_next_replies(1)
    assert st.replace_if("lease.json", b'{"worker": "me", "version": 2}', token) is True
    assert len([r for r in caplog.records if r.name == LOGGER and "retry" in r.getMessage()]) >= 2
    assert st.read_json("lease.json") == {"worker": "me", "version": 2}
    assert st.create_exclusive("lease.json", b'{"worker": "other"}') is False
    assert st.replace_if("lease.json", b'{"worker": "other"}', token) is False


@pytest.fixture(params=["gs", "s3"])
def flaky(request):
    """(URL through a FlakyProxy, the proxy)."""
    prefix = "gcs" if request.param == "gs" else "s3"
    return request.getfixturevalue(f"{prefix}_proxy_url"), request.getfixturevalue(f"{prefix}_proxy")


# --- the hooks a simulation uses: any backend, any clock ---------------------------------------------


class MemoryBackend(Backend):
    """The eight required operations over a dict; `fail` transient errors before each of the next calls."""

    def __init__(self):
        self.objects: dict[str, tuple[bytes, int]] = {}
        self.generation = 0
        self.fail = 0

    def _op(self) -> None:
        if self.fail:
            self.fail -= 1
            raise ConnectionResetError(errno.ECONNRESET, "connection reset by peer")

    def _put(self, path: str, data) -> None:
        self.generation += 1
        self.objects[path] = (bytes(data), self.generation)

    def read(self, path):
        self._op()
        if path not in self.objects:
            raise FileNotFoundError(path)
        return self.objects[path][0]

    def read_versioned(self, path):
        data = self.read(path)
        return Versioned(data, str(self.objects[path][1]))

    def write(self, path, parts):
        self._op()
        self._put(path, b"".join(parts))

    def create(self, path, data):
        self._op()
        if path in self.objects:
            raise PreconditionFailed(path)
        self._put(path, data)

    def replace(self, path, data, token):
        self._op()
        if path not in self.objects or str(self.objects[path][1]) != token:
            raise PreconditionFailed(path)
        self._put(path, data)

    def listdir(self, path):
        self._op()
        return sorted({p[len(path) + 1:].split("/", 1)[0] for p in self.objects if p.startswith(path + "/")})

    def find(self, path):
        self._op()
        return [p for p in self.objects if p == path or p.startswith(path + "/")]

    def delete(self, paths):
        self._op()
        for p in paths:
            self.objects.pop(p, None)


class FakeClock:
    def __init__(self):
        self.now = 100.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds

    def wall(self) -> float:
        return 1e9 + self.now


def test_storage_over_any_backend_waits_on_its_clock():
    clock, mem = FakeClock(), MemoryBackend()
    st = Storage("sim://bucket/run", backend=mem, clock=clock)
    assert (st.url, st.protocol, st.is_local, st.path("a/b.json")) == ("sim://bucket/run", "sim", False,
                                                                       "bucket/run/a/b.json")
    st.write_json("a/b.json", {"x": 1})
    with st.open_write("a/c.txt") as f:
        f.write(b"line 1\nline 2\n")
    assert st.read_json("a/b.json") == {"x": 1} and st.read_range("a/c.txt", 5, 8) == b"1\nl"
    with st.open_text("a/c.txt") as f:
        assert list(f) == ["line 1\n", "line 2\n"]
    assert st.listdir() == ["a"] and st.listdir("a") == ["b.json", "c.txt"] and st.exists("a")
    assert st.size("a/c.txt") == 14 and st.child("a").read_json("b.json") == {"x": 1}
    assert st.create_exclusive("a/lease", b"1") is True and st.create_exclusive("a/lease", b"2") is False
    token = st.read_versioned("a/lease").token
    assert st.replace_if("a/lease", b"3", token) is True and st.replace_if("a/lease", b"4", token) is False
    assert clock.slept == []

    started = time.monotonic()
    mem.fail = 2
    assert st.read_bytes("a/lease") == b"3"
    assert len(clock.slept) == 2 and clock.now == pytest.approx(100.0 + sum(clock.slept))
    child = st.child("a")
    assert child.clock is clock and child.backend is mem
    mem.fail = 100
    before = clock.now
    with pytest.raises(StorageUnreachable) as info:
        child.read_bytes("lease")
    assert f"gave up after 6 attempts over {clock.now - before:.1f}s" in str(info.value)
    assert clock.now - before >= 3.1 and time.monotonic() - started < 3.0  # simulated waits, not real ones
    mem.fail = 0
    st.delete_tree("a")
    assert st.listdir() == [] and not st.exists("a")


def test_the_local_directory_lock_waits_on_the_clock(tmp_path):
    """A compare-and-swap whose directory lock another process holds waits `lock_wait_s` on the Storage's
    clock, then gives up with one line."""
    clock = FakeClock()
    st = Storage(str(tmp_path), clock=clock, attempts=1)
    st.write_bytes("lease.json", b"v1")
    token = st.read_versioned("lease.json").token
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another open file description: flock excludes it
        started = time.monotonic()
        with pytest.raises(StorageError, match="directory lock is held by another process"):
            st.replace_if("lease.json", b"v2", token)
        assert clock.now - 100.0 > 5.0 and time.monotonic() - started < 4.0  # waited on the clock, not for real
    finally:
        os.close(fd)
    assert st.replace_if("lease.json", b"v2", token) is True
