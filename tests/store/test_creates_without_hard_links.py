"""Atomic create-if-absent on a filesystem without hard links (issue 27, hole 5): a create near a full disk
(ENOSPC on a small tmpfs) is whole or absent, contenders (renameat2 or a directory lock) leave one winner and no
partial file a reader sees, and a lease taken on a full disk leaves nothing that blocks the stream."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import threading

import pytest

import harvest.storage.local as local
from harvest.errors import UserError
from harvest.storage import Storage
from harvest.store.lease import Leases


@pytest.fixture
def no_hard_links(monkeypatch):
    """A filesystem without hard links, as some FUSE/SMB mounts are: link(2) fails with EPERM."""
    def refuse(src, dst, *args, **kwargs):
        raise OSError(errno.EPERM, "Operation not permitted", src)
    monkeypatch.setattr(os, "link", refuse)


@pytest.fixture
def small_tmpfs(tmp_path):
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_create_near_a_full_disk_is_whole_or_absent(no_hard_links, small_tmpfs):
    """Room for one copy of a sidecar (100 KB of a 256 KB tmpfs left after 100 KB of filler): it is created
    whole (a temp file renamed if absent, never a second copy written in place). No room at all: the create
    fails and leaves neither the name nor a temp file, for a sidecar, lease.json and run.json alike."""
    st = Storage(str(small_tmpfs))
    st.write_bytes("filler", b"x" * 100_000)
    big = b"{" + b" " * 100_000 + b"}"
    assert st.create_exclusive("stream_00000/shard_000000.json", big)
    assert st.read_bytes("stream_00000/shard_000000.json") == big
    st.write_bytes("filler2", b"x" * 45_000)
    for rel in ("stream_00000/shard_000001.json", "stream_00000/lease.json", "run.json"):
        with pytest.raises(UserError):
            st.create_exclusive(rel, big)
        assert not st.exists(rel)
    assert os.listdir(small_tmpfs / "stream_00000") == ["shard_000000.json"]  # no temp file either
    st.delete_many(["filler", "filler2"])
    assert st.create_exclusive("stream_00000/shard_000001.json", big)
    assert st.read_bytes("stream_00000/shard_000001.json") == big


@pytest.mark.parametrize("rename_if_absent", [True, False], ids=["renameat2", "directory-lock"])
def test_contenders_without_hard_links_one_wins_and_no_reader_sees_a_partial_file(no_hard_links, rename_if_absent,
                                                                                 tmp_path, monkeypatch):
    """Three writers create the same big name at once, five times over, while a reader reads it: one wins each
    time, and the reader only ever sees the whole winner (no name before its content, no part of it)."""
    if not rename_if_absent:  # a C library or filesystem without RENAME_NOREPLACE
        monkeypatch.setattr(local, "_renameat2", None, raising=False)
    st = Storage(str(tmp_path / "out"))
    size = 16_000_000  # a write long enough for a reader to meet it midway where the name is written in place
    payloads = {name: name.encode() * size for name in ("a", "b", "c")}
    for round_ in range(5):
        rel = f"stream_00000/shard_{round_:06d}.json"
        won: dict[str, bool] = {}
        seen: list[int] = []
        stop = threading.Event()

        def read_while() -> None:
            path = tmp_path / "out" / rel
            while not stop.is_set():
                try:
                    seen.append(len(path.read_bytes()))
                except FileNotFoundError:
                    pass

        reader = threading.Thread(target=read_while)
        reader.start()
        gate = threading.Barrier(len(payloads))

        def contend(name: str) -> None:
            gate.wait()
            won[name] = st.create_exclusive(rel, payloads[name])

        threads = [threading.Thread(target=contend, args=(name,)) for name in payloads]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stop.set()
        reader.join()
        winners = [name for name, ok in won.items() if ok]
        assert len(winners) == 1, won
        assert st.read_bytes(rel) == payloads[winners[0]]
        assert set(seen) <= {size}, "a reader saw a partial file"
    assert sorted(os.listdir(tmp_path / "out" / "stream_00000")) == [f"shard_{k:06d}.json" for k in range(5)]


def test_a_lease_taken_on_a_full_disk_without_hard_links_leaves_nothing_that_blocks_the_stream(no_hard_links,
                                                                                                small_tmpfs):
    """The disk is full when a worker takes a stream: with no room at all it fails with one line and leaves no
    lease.json; with room for one copy of the lease it takes the stream (never a second copy written in place,
    which would leave an empty lease.json no later worker could read); with room, workers hand it on."""
    st = Storage(str(small_tmpfs / "out"))
    st.write_bytes("stream_00000/progress.json", b"{}")  # the stream's directory exists
    with open(small_tmpfs / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"x" * 4096)
    with pytest.raises(UserError, match="no space left"):
        Leases(st, "a", ttl_s=60).acquire([0])
    assert not st.exists("stream_00000/lease.json")
    os.truncate(small_tmpfs / "filler", os.path.getsize(small_tmpfs / "filler") - 4096)  # one page free
    first = Leases(st, "first", ttl_s=60)
    first.acquire([0])
    assert first.held == {0}
    os.remove(small_tmpfs / "filler")
    first.release_all()
    a = Leases(st, "a", ttl_s=60)
    a.acquire([0, 1])
    a.release_all()
    b = Leases(st, "b", ttl_s=60)
    b.acquire([0, 1])
    assert b.held == {0, 1}
    b.release_all()
