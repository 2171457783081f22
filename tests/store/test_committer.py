"""A failing run leaves none of its data objects behind: `Committer.abort` lets the commit in flight end as
commits do (its sidecar created, or its object deleted) and deletes the objects of the shards queued behind it
(written already: a shard's object is written as soon as it closes). Before, a worker that learned of its lost
lease from a heartbeat exited with those objects in place, and a stream already complete has no next holder
to sweep them (test_fencing met this under load)."""

from __future__ import annotations

import threading
import time

from shard_helpers import closed_shard

from harvest.errors import FencedOut
from harvest.storage import PreconditionFailed, Storage
from harvest.store import format as fmt
from harvest.store.committer import Committer
from harvest.store.listing import read_chain


def data_objects(storage: Storage) -> set[str]:
    return {name for name in storage.listdir(fmt.stream_dir(0)) if fmt.data_file_shard(name) is not None}


def test_a_run_aborted_with_a_commit_in_flight_keeps_that_commit_and_deletes_the_shards_behind_it(
        tmp_path, monkeypatch):
    release = tmp_path / "release"
    monkeypatch.setenv("HARVEST_TEST_STOP_BEFORE_COMMIT", "0:1:60")  # shard 1's commit held past its lease check
    monkeypatch.setenv("HARVEST_TEST_RELEASE_COMMIT", str(release))
    storage = Storage(str(tmp_path / "run"))
    lost = threading.Event()

    def guard(stream: int) -> None:
        if lost.is_set():
            raise FencedOut(f"stream {stream} was taken over")

    committer = Committer(storage, attempt="a" * 16, guard=guard)
    for shard in range(4):
        committer.submit(closed_shard(shard, final=shard == 3))
    deadline = time.monotonic() + 30
    while len(data_objects(storage)) < 4:  # every object written; shard 0 committed, 1 held, 2 and 3 queued
        assert time.monotonic() < deadline, data_objects(storage)
        time.sleep(0.02)
    lost.set()  # the heartbeat found the lease taken: the main thread aborts
    threading.Timer(0.5, release.touch).start()
    committer.abort()
    chain = read_chain(storage, 0)
    assert [sidecar.shard for sidecar in chain] == [0, 1]
    assert data_objects(storage) == {sidecar.file for sidecar in chain}


def test_a_commit_whose_lease_is_lost_before_its_create_deletes_its_object(tmp_path):
    storage = Storage(str(tmp_path / "run"))
    written = threading.Event()

    def guard(stream: int) -> None:  # the write's check passes; the commit's, after it, finds the lease lost
        if written.is_set():
            raise FencedOut(f"stream {stream} was taken over")
        written.set()

    committer = Committer(storage, attempt="a" * 16, guard=guard)
    committer.submit(closed_shard(0))
    try:
        committer.close()
    except FencedOut:
        pass
    else:
        raise AssertionError("the commit went ahead without its lease")
    assert data_objects(storage) == set() and read_chain(storage, 0) == []


class _ResentCreates:
    """A backend whose sidecar creates land and then answer "exists", as a transport that resent the request
    unseen would make them answer."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def create(self, path: str, data: bytes) -> None:
        self.inner.create(path, data)
        raise PreconditionFailed(path)


def test_a_commit_that_landed_though_the_store_said_exists_keeps_its_data_object(tmp_path):
    plain = Storage(str(tmp_path / "run"))
    storage = Storage(str(tmp_path / "run"), backend=_ResentCreates(plain.backend))
    committer = Committer(storage, attempt="a" * 16)
    for shard in range(3):
        committer.submit(closed_shard(shard, final=shard == 2))
    committer.close()
    chain = read_chain(plain, 0)
    assert [sidecar.shard for sidecar in chain] == [0, 1, 2] and chain[-1].final
    assert data_objects(plain) == {sidecar.file for sidecar in chain}
