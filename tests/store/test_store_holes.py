"""The writer-side holes of issue 27, each met as a user meets it (real processes on local disk, and on moto's
S3 where a wipe touches object storage): a full --overwrite with fewer streams; a partial --overwrite against a
writer stopped between its data write and its commit; a killed worker not yet reaped (a zombie); a worker
stopped past its TTL on the taker's own host; SIGTERM during extract; a run written in another format version.
Creates without hard links: tests/store/test_creates_without_hard_links.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import types

import numpy as np
import pytest
from extract_helpers import (RELEASE_COMMIT, another_vm, committed as committed_of, harvest_cmd, harvest_env,
                             run_harvest)

from harvest.storage import Storage
from harvest.storage.errors import StorageError
from harvest.store import encoding, format as fmt
from harvest.store.commit import commit, sweep, wipe
from harvest.store.format import sidecar_name
from harvest.store.lease import Leases
from harvest.store.listing import read_chain, stream_generation
from harvest.store.records import Sidecar
from harvest.store.verify import ended_files

TTL = 4


@pytest.fixture(scope="module")
def setup(fault_reference, tmp_path_factory):
    """The session's 3 streams of a 240-record dataset and its reference extraction (conftest's fault_reference),
    the same records in 2 streams; this module's runs and logs in a directory of its own."""
    base = fault_reference
    root = tmp_path_factory.mktemp("holes")
    two = root / "streams2"
    made = run_harvest("streams", "create", "--data", str(base.source), "--num-streams", "2", "--out", str(two),
                       env=harvest_env(base.cache))
    assert made.returncode == 0, made.stderr
    return types.SimpleNamespace(root=root, cache=base.cache, args=base.args, two=two, reference=base.reference,
                                 committed=committed_of(Storage(base.reference))[0])


def start(setup, out: str, *extra: str, log: str, env: dict | None = None, prefix: tuple[str, ...] = ()
          ) -> subprocess.Popen:
    with open(setup.root / log, "wb") as f:
        return subprocess.Popen([*prefix, *harvest_cmd(*setup.args(out, *extra))],
                                env=env or harvest_env(setup.cache), stdout=subprocess.DEVNULL, stderr=f,
                                start_new_session=True)


def shard_dir(url: str, stream: int) -> str:
    """Where the stream's current generation keeps its shards (an --overwrite starts a new one)."""
    return fmt.shard_dir(stream, stream_generation(Storage(url), stream))


def sidecars(url: str, stream: int) -> list[str]:
    names = Storage(url).listdir(shard_dir(url, stream))
    return sorted(n for n in names if n.startswith("shard_") and n.endswith(".json"))


def wait_until(predicate, proc: subprocess.Popen, log, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert proc.poll() is None, f"harvest exited ({proc.returncode}): {log.read_text()}"
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)


def state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def error_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.startswith("harvest: error:")]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def assert_verified(url: str, env) -> None:
    checked = run_harvest("verify", url, env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# --- 1: a full --overwrite leaves exactly the streams the new run.json names ---------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_full_overwrite_with_fewer_streams_leaves_only_the_new_runs_streams(setup, kind, request):
    out = str(setup.root / "fewer") if kind == "local" else request.getfixturevalue("s3_url")
    env = harvest_env(setup.cache)  # after the server's fixture: it sets the endpoint's environment
    if kind == "local":
        shutil.copytree(setup.reference, out)
    else:
        assert run_harvest(*setup.args(out), env=env).returncode == 0
    done = run_harvest(*setup.args(out, "--overwrite", data=setup.two), env=env)
    assert done.returncode == 0, done.stderr
    st = Storage(out)
    assert sorted(n for n in st.listdir() if n.startswith("stream_")) == ["stream_00000", "stream_00001"]
    assert json.loads(st.read_bytes("run.json"))["data"]["num_streams"] == 2
    assert_verified(out, env)


# --- 2: a partial --overwrite never deletes what a stalled writer may still commit -----------------------------


@pytest.mark.slow
def test_a_partial_overwrite_against_a_stalled_writer_loses_no_shard(setup):
    """A stops (SIGSTOP, the test hook) with shard 3's data written and its sidecar not; B, as on another VM
    (a pid namespace of its own), overwrites stream 0 with the same settings after A's TTL (a new generation:
    A's objects are deleted) and holds its own commit of shard 3; A wakes and creates shard 3's sidecar in the
    generation B ended, where no reader looks, then finds its lease gone; a plain rerun finishes, and the run
    is the reference, verified."""
    out = str(setup.root / "partial")
    shutil.copytree(setup.reference, out)
    env = harvest_env(setup.cache)
    a = start(setup, out, "--streams", "0", "--overwrite", "--worker-id", "a", "--lease-ttl", str(TTL), log="p-a.log",
              env={**env, "HARVEST_TEST_STOP_BEFORE_COMMIT": "0:3"})
    b, release = None, setup.root / "partial.release"  # B's shard 3 is held until A has exited
    try:
        wait_until(lambda: state(a.pid) == "T", a, setup.root / "p-a.log")
        a_data = [n for n in Storage(out).listdir(shard_dir(out, 0)) if n.startswith("shard_000003-")]
        assert len(a_data) == 1 and sidecars(out, 0)[-1] == "shard_000002.json"
        b = start(setup, out, "--streams", "0", "--overwrite", "--worker-id", "b", "--lease-ttl", str(TTL),
                  log="p-b.log", prefix=another_vm(),
                  env={**env, "HARVEST_TEST_STOP_BEFORE_COMMIT": "0:3:120", RELEASE_COMMIT: str(release)})
        # B wiped stream 0 and committed shards 0-2 anew (under its own attempt), and holds shard 3's commit.
        a_attempt = a_data[0][len("shard_000003-"):-len(".safetensors")]

        def b_committed_three() -> bool:
            directory = shard_dir(out, 0)  # once: B's wipe may start its generation between two lookups
            names = [n for n in Storage(out).listdir(directory) if n.startswith("shard_") and n.endswith(".json")]
            try:
                files = [json.loads(Storage(out).read_bytes(f"{directory}/{n}"))["file"] for n in names]
            except StorageError:  # listed in the generation B's wipe has just ended and deleted
                return False
            return len(names) == 3 and not any(a_attempt in f for f in files)

        wait_until(b_committed_three, b, setup.root / "p-b.log")
        os.killpg(a.pid, signal.SIGCONT)
        assert a.wait(timeout=60) == 3, (setup.root / "p-a.log").read_text()
        release.touch()
        assert b.wait(timeout=120) in (0, 3), (setup.root / "p-b.log").read_text()
    finally:
        kill(a)
        if b is not None:
            kill(b)
    rerun = run_harvest(*setup.args(out), env=env)
    assert rerun.returncode == 0, rerun.stderr
    ours, leftovers = committed_of(Storage(out))
    assert ours == setup.committed and not leftovers
    assert_verified(out, env)


def test_a_writer_stalled_across_a_sweep_and_a_wipe_commits_nothing_a_reader_reads(root):
    """W stops after writing shard 0's data, past its last lease check; X takes the stream over after W's TTL,
    commits both shards and sweeps W's object (its shard is committed to X's); Z runs --overwrite (a wipe);
    W wakes and creates shard 0's sidecar, naming its deleted object; Z commits. Readers read Z's shards, each
    with its data: W's sidecar lies in the generation Z's wipe ended. On local disk, fake-gcs-server and moto."""
    st = Storage(root)

    def shard(k: int, leases: Leases) -> tuple[Sidecar, bytes]:
        data = encoding.encode_shard({"resid_post.0": np.full((1, 2), k, np.float32)}, np.array([k], np.int32),
                                     np.ones(1, np.int64), np.array([k]), np.zeros(1, np.int32),
                                     metadata={"stream": "0", "shard": str(k)})
        sidecar = Sidecar.of_shard(data, stream=0, shard=k, stats={}, attempt=leases.id[:16], start=(k, 0),
                                   next=(k + 1, 0), row_start=(k + 1, 0), samples=1, tokens=1, skipped=[], long={},
                                   final=k == 1, records=k + 1, generation=leases.generation(0))
        return sidecar, data

    def extract(leases: Leases) -> None:
        leases.acquire([0])
        for k in range(2):
            sidecar, data = shard(k, leases)
            commit(st, sidecar, data, leases.check)
        sweep(st, 0, leases.generation(0))
        leases.release_all()

    w = Leases(st, "w", ttl_s=1.0, heartbeat=False)
    w.acquire([0])
    stalled, wake, checks = threading.Event(), threading.Event(), []

    def stops_after_its_last_check(stream: int) -> None:
        w.check(stream)
        checks.append(stream)
        if len(checks) == 2:  # commit's check after the data write: where HARVEST_TEST_STOP_BEFORE_COMMIT stops
            stalled.set()
            wake.wait(60)

    w_sidecar, w_data = shard(0, w)
    stopped_w = threading.Thread(target=commit, args=(st, w_sidecar, w_data, stops_after_its_last_check))
    stopped_w.start()
    try:
        assert stalled.wait(60)
        extract(x := Leases(st, "x", ttl_s=1.0, heartbeat=False))  # takes over after W's TTL
        assert not st.exists(f"stream_00000/{w_sidecar.file}") and len(read_chain(st, 0)) == 2  # swept
        z = Leases(st, "z", ttl_s=1.0, heartbeat=False)
        z.acquire([0])
        wipe(st, 0, z)
        z.release_all()
    finally:
        wake.set()
        stopped_w.join()
    assert st.exists(f"stream_00000/{sidecar_name(0)}")  # W's late create landed, in the generation Z ended
    extract(z)
    chain = read_chain(st, 0)
    assert [sc.file.split("-")[1][:16] for sc in chain] == [z.id[:16]] * 2 and x.id != z.id
    for sc in chain:
        assert sc.mismatch(st.read_bytes(fmt.data_path(0, sc.file, sc.generation))) is None
    # harvest verify lists what the ended generation still holds: W's late sidecar, nothing else
    generation = stream_generation(st, 0)
    assert ended_files(st, 0, generation, st.listdir(fmt.shard_dir(0, generation))) == [
        f"stream_00000/{sidecar_name(0)}"]


# --- 3: a zombie counts as dead ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_worker_not_yet_reaped_counts_as_dead(setup):
    """SIGKILL, and its parent (this test) does not reap it: a zombie. A rerun on this host takes its
    streams back at once (not after --lease-ttl 600) and finishes with the reference bytes."""
    out = str(setup.root / "zombie")
    env = harvest_env(setup.cache)
    a = start(setup, out, "--lease-ttl", "600", log="z-a.log")
    try:
        wait_until(lambda: len(sidecars(out, 0)) >= 1, a, setup.root / "z-a.log")
        os.kill(a.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while state(a.pid) != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.02)
        began = time.monotonic()
        rerun = run_harvest(*setup.args(out, "--lease-ttl", "600"), env=env)
        assert rerun.returncode == 0, rerun.stderr
        assert time.monotonic() - began < 300 and state(a.pid) == "Z"
    finally:
        a.wait()
    assert committed_of(Storage(out))[0] == setup.committed
    assert_verified(out, env)


# --- 4: staleness by TTL alone, wherever the taker runs --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("where", ["this host", "another hostname"])
def test_a_worker_stopped_past_its_ttl_is_taken_over_from_its_own_host(setup, where):
    """A stops (SIGSTOP) in this very pid namespace; B runs on the same machine, under the same hostname or
    another (unshare -u): either way it waits out A's TTL, takes the streams over and finishes; A, woken,
    exits 3 having committed nothing more."""
    out = str(setup.root / f"stopped-{where.replace(' ', '-')}")
    env = harvest_env(setup.cache)
    a = start(setup, out, "--worker-id", "a", "--lease-ttl", str(TTL), log=f"s-a-{where}.log")
    try:
        wait_until(lambda: len(sidecars(out, 0)) >= 1, a, setup.root / f"s-a-{where}.log")
        os.killpg(a.pid, signal.SIGSTOP)
        prefix = ["unshare", "-u", "sh", "-c", 'hostname elsewhere && exec "$@"', "sh"] if where != "this host" else []
        began = time.monotonic()
        b = subprocess.run([*prefix, *harvest_cmd(*setup.args(out, "--worker-id", "b"))], env=env,
                           capture_output=True, text=True, timeout=300)
        assert b.returncode == 0, b.stderr
        assert "left its lease unchanged" in b.stderr and time.monotonic() - began > TTL, b.stderr
        os.killpg(a.pid, signal.SIGCONT)
        assert a.wait(timeout=60) == 3, (setup.root / f"s-a-{where}.log").read_text()
    finally:
        kill(a)
    assert committed_of(Storage(out))[0] == setup.committed
    assert_verified(out, env)


# --- 7: SIGTERM in extract -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_commits_what_is_closed_releases_the_leases_and_exits_75(setup):
    """A preemption notice mid-run: within seconds the worker stops taking batches, commits the shard whose
    commit is in flight (held 5 s here), releases its leases and exits 75 with one line; the rerun takes the
    streams at once (not after --lease-ttl 600) and finishes with the reference bytes."""
    out = str(setup.root / "sigterm")
    env = harvest_env(setup.cache)
    a = start(setup, out, "--lease-ttl", "600", log="t-a.log", env={**env, "HARVEST_TEST_STOP_BEFORE_COMMIT": "0:2:5"})
    try:
        wait_until(lambda: len(sidecars(out, 0)) == 2, a, setup.root / "t-a.log")
        time.sleep(1.0)  # shard 2's commit is held now
        signalled = time.monotonic()
        os.kill(a.pid, signal.SIGTERM)
        code = a.wait(timeout=60)
        took = time.monotonic() - signalled
    finally:
        kill(a)
    log = (setup.root / "t-a.log").read_text()
    assert code == 75 and took < 20, (code, took, log)
    assert "stopped on SIGTERM" in error_line(log)
    assert "shard_000002.json" in sidecars(out, 0)  # the commit in flight was completed, not cut
    st = Storage(out)
    assert all(json.loads(st.read_bytes(f"stream_{s:05d}/lease.json"))["released"] for s in range(3))
    began = time.monotonic()
    rerun = run_harvest(*setup.args(out, "--lease-ttl", "600"), env=env)
    assert rerun.returncode == 0 and "left its lease unchanged" not in rerun.stderr, rerun.stderr
    assert time.monotonic() - began < 300
    assert committed_of(st)[0] == setup.committed
    assert_verified(out, env)


# --- suspicion: the format version is agreed -------------------------------------------------------------------


@pytest.mark.slow
def test_a_run_written_in_another_format_version_is_not_appended_to(setup):
    out = setup.root / "newer-format"
    shutil.copytree(setup.reference, out)
    for sidecar in out.glob("stream_00002/shard_*.json"):  # the run is unfinished: a rerun would append
        sidecar.unlink()
    info = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**info, "format_version": info["format_version"] + 1}))
    before = sorted(p.name for p in (out / "stream_00002").iterdir())
    refused = run_harvest(*setup.args(str(out)), env=harvest_env(setup.cache))
    assert refused.returncode == 2, refused.stderr
    assert "format_version" in error_line(refused.stderr)
    assert sorted(p.name for p in (out / "stream_00002").iterdir()) == before
