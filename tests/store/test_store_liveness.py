"""Committed state that no lease operation can lose, and drops that never race their own heartbeat (issue 36, points
5 and 6), met as a user meets them, with real processes on local disk: a lease.json deleted after an --overwrite
(as the message about a damaged one allows) loses nothing; a stream of thousands of objects dropped under a lease
heartbeating every 50 ms is deleted without a write of its lease landing in it; a drop cut short is finished by
the next extract."""

from __future__ import annotations

import shutil
import time
import types

import pytest
from extract_helpers import committed as committed_of, harvest_env, run_harvest

import harvest
from harvest.storage import Storage
from harvest.store import format as fmt
from harvest.store.commit import wipe
from harvest.store.lease import Leases
from harvest.store.listing import read_generation

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def setup(fault_reference, tmp_path_factory):
    """The session's 3 streams of a 240-record dataset and its reference extraction (conftest's fault_reference)."""
    base = fault_reference
    return types.SimpleNamespace(root=tmp_path_factory.mktemp("liveness"), cache=base.cache, args=base.args,
                                 reference=base.reference, committed=committed_of(Storage(base.reference))[0],
                                 samples=harvest.open(base.reference).num_samples)


def copy_of_reference(setup, name: str):
    out = setup.root / name
    shutil.copytree(setup.reference, out)
    return out


def extract(setup, out, *extra: str) -> None:
    done = run_harvest(*setup.args(str(out), *extra), env=harvest_env(setup.cache), timeout=300)
    assert done.returncode == 0, done.stderr


def assert_whole(setup, out) -> None:
    """The run holds every sample of the reference once, reads back whole and verifies."""
    assert committed_of(Storage(str(out))) == (setup.committed, [])
    assert harvest.open(str(out)).num_samples == setup.samples
    checked = run_harvest("verify", str(out), env=harvest_env(setup.cache))
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_a_lease_deleted_after_an_overwrite_loses_nothing(setup):
    out = copy_of_reference(setup, "lease-deleted")
    extract(setup, out, "--overwrite", "--streams", "0")
    pointer = read_generation(Storage(str(out)), 0)
    assert pointer.generation and pointer.ended == [""]
    (out / fmt.lease_path(0)).unlink()  # damaged, say, and deleted by a person while no worker runs
    assert read_generation(Storage(str(out)), 0) == pointer
    assert_whole(setup, out)
    extract(setup, out)  # a resume takes a fresh lease from the pointer: nothing to do
    assert read_generation(Storage(str(out)), 0) == pointer
    (out / fmt.lease_path(0)).unlink()
    extract(setup, out, "--overwrite", "--streams", "0")  # and an overwrite ends the committed generation
    again = read_generation(Storage(str(out)), 0)
    assert again.generation not in ("", pointer.generation) and again.ended == ["", pointer.generation]
    assert sorted(p.name for p in (out / fmt.stream_dir(0)).glob("gen_*")) == [f"gen_{again.generation}"]
    assert_whole(setup, out)


def test_a_damaged_lease_says_whether_it_may_be_deleted(setup):
    out = copy_of_reference(setup, "lease-damaged")
    extract(setup, out, "--overwrite", "--streams", "0")
    assert not (out / fmt.generation_path(1)).exists()  # never wiped: its lease names its generation, ""
    for stream in (0, 1):
        (out / fmt.lease_path(stream)).write_text("{")
    refused = run_harvest(*setup.args(str(out), "--streams", "0"), env=harvest_env(setup.cache))
    assert refused.returncode == 2 and "delete it if no worker runs on that stream" in refused.stderr, refused.stderr
    refused = run_harvest(*setup.args(str(out), "--streams", "1"), env=harvest_env(setup.cache))
    assert refused.returncode == 2 and "do not delete it" in refused.stderr, refused.stderr


def dropped_stream(out, files: int) -> None:
    """A stream beyond the run's 3, as a run of more streams left it: `files` objects."""
    directory = out / fmt.stream_dir(3)
    directory.mkdir()
    for k in range(files):
        (directory / f"{fmt.shard_stem(k)}-0eaa0eaa0eaa0eaa.safetensors").write_bytes(b"x")


def test_a_dropped_stream_of_many_objects_is_deleted_without_its_heartbeat(tmp_path):
    """The drop's own lease, heartbeating every 50 ms (TTL 0.3 s), over a delete of 20,000 objects: its heartbeat
    stops before the directory goes, so no lease write lands in it (a temp file: 'Directory not empty') and the
    lease is not found deleted under a live holder (fenced out)."""
    dropped_stream(tmp_path, 20000)
    storage, lost = Storage(str(tmp_path)), []
    leases = Leases(storage, "w", ttl_s=0.3, on_lost=lost.append)
    leases.acquire([3])
    try:
        time.sleep(0.2)  # heartbeats going
        wipe(storage, 3, leases, whole=True)
        time.sleep(0.3)
    finally:
        leases.release_all()
    assert not lost and not (tmp_path / fmt.stream_dir(3)).exists() and leases.held == set()


def test_a_drop_cut_short_is_finished_by_the_next_extract(setup):
    out = copy_of_reference(setup, "drop-cut-short")
    dropped_stream(out, 20)  # what a drop interrupted in its delete left
    extract(setup, out)
    assert not (out / fmt.stream_dir(3)).exists()
    assert_whole(setup, out)
