"""Exactly once under the faults a fleet meets, with the real CLI in subprocesses: two identical commands
started together (one extracts, the other stops when it sees the first's lease move); two containers on one VM, alike in worker id,
host, boot and pid; a worker that keeps its long TTL against a command with a short one, and against one
whose clock runs an hour ahead; a worker stopped (SIGSTOP) past --lease-ttl, whose streams another worker
takes over and finishes, wakes up (SIGCONT) and exits without committing anything; a writer stopped
between its last lease check and its commit, whose commit then fails; storage unreachable for longer
than half the TTL stops the worker, and a rerun finishes with the same bytes. Locally, on fake-gcs-server
and on moto's S3 where storage matters."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import types

import libfaketime
import pytest
from extract_helpers import (RELEASE_COMMIT, another_vm, committed as committed_of, harvest_cmd, harvest_env,
                             release_when, run_harvest)

from harvest.storage import Storage

pytestmark = pytest.mark.slow

TTL = 4


@pytest.fixture(scope="module")
def setup(fault_reference, tmp_path_factory):
    """The session's 3 streams of a 240-record dataset and its reference extraction (conftest's fault_reference);
    this module's runs and logs in a directory of its own."""
    base = fault_reference
    return types.SimpleNamespace(root=tmp_path_factory.mktemp("fencing"), cache=base.cache, args=base.args,
                                 reference=committed(base.reference))


def committed(url: str) -> dict[str, bytes]:
    """The run's committed data, whichever attempts wrote it (run.json aside: it records --out)."""
    return committed_of(Storage(url))[0]


def sidecar_count(url: str) -> int:
    st = Storage(url)
    return sum(n.endswith(".json") and n.startswith("shard_") for d in st.listdir() if d.startswith("stream_")
               for n in st.listdir(d))


def start(setup, out: str, *extra: str, log: str, prefix: tuple[str, ...] = (), env: dict | None = None
          ) -> subprocess.Popen:
    """`harvest extract` in the background; `prefix` runs it under another command (its own pid namespace),
    in a session of its own, so that signals to the process group reach harvest itself."""
    with open(setup.root / log, "wb") as f:
        return subprocess.Popen([*prefix, *harvest_cmd(*setup.args(out, *extra))],
                                env=env or harvest_env(setup.cache, devices=2), stdout=subprocess.DEVNULL, stderr=f,
                                start_new_session=True)


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    os.killpg(proc.pid, sig)


def stopped(proc: subprocess.Popen) -> bool:
    """Whether every process of its group is stopped (state T), as SIGSTOP leaves them."""
    states = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == proc.pid:  # its process group
                states.append(fields[0])
    return bool(states) and all(state == "T" for state in states)


def wait_for_commits(proc: subprocess.Popen, url: str, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while sidecar_count(url) < n:
        assert proc.poll() is None, f"harvest exited ({proc.returncode}) before {n} shards were committed"
        assert time.monotonic() < deadline, f"no {n} committed shards after {timeout}s"
        time.sleep(0.05)


def error_line(setup, log: str) -> str:
    lines = [ln for ln in (setup.root / log).read_text().splitlines() if ln.startswith("harvest: error:")]
    assert len(lines) == 1 and "Traceback" not in (setup.root / log).read_text(), (setup.root / log).read_text()
    return lines[0]


def assert_verified(url: str, env) -> None:
    checked = run_harvest("verify", url, env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_two_identical_commands_at_once_one_extracts(setup):
    """Two terminals, one command: the second watches the first's lease (a holder running on this host is
    watched like any other: only its TTL of silence would free it), sees it move and stops with one line."""
    out = str(setup.root / "twins")
    # The holder's first commit waits (heartbeats going on) until the other has stopped, so that the other surely
    # watches it meanwhile (at most 120 s).
    release = setup.root / "twins.release"
    env = {**harvest_env(setup.cache, devices=2), "HARVEST_TEST_STOP_BEFORE_COMMIT": "0:0:120",
           RELEASE_COMMIT: str(release)}
    twins = [start(setup, out, "--lease-ttl", str(TTL), log=f"twin{i}.log", env=env) for i in range(2)]
    release_when(lambda: any(p.poll() is not None for p in twins), release)
    codes = [p.wait(timeout=300) for p in twins]
    assert sorted(codes) == [0, 2], codes
    winner, loser = (twins[0], 1) if codes[0] == 0 else (twins[1], 0)
    line = error_line(setup, f"twin{loser}.log")
    host = socket.gethostname()
    assert f"held by worker '{host}:0' on {host} (pid {winner.pid}), whose lease moved" in line, line
    assert committed(out) == setup.reference  # the refused twin wrote nothing of its own
    assert_verified(out, harvest_env(setup.cache))


@pytest.mark.parametrize("kind", ["local", "gs", "s3"])
def test_a_worker_stopped_past_the_ttl_is_fenced_out_and_commits_nothing(setup, kind, request):
    out = str(setup.root / "stalled") if kind == "local" else request.getfixturevalue(f"{'gcs' if kind == 'gs' else 's3'}_url")
    env = harvest_env(setup.cache, devices=2)
    # A runs as on another VM: nothing here can prove it alive or gone, so B waits out A's own TTL.
    a = start(setup, out, "--worker-id", "a", "--lease-ttl", str(TTL), log=f"a-{kind}.log", prefix=another_vm())
    try:
        wait_for_commits(a, out, 2)
        signal_group(a, signal.SIGSTOP)
        began = time.monotonic()
        b = run_harvest(*setup.args(out, "--worker-id", "b", "--lease-ttl", "600"), env=env, timeout=300)
        assert b.returncode == 0, b.stderr
        assert "worker 'a'" in b.stderr and "left its lease unchanged" in b.stderr, b.stderr
        assert time.monotonic() - began > TTL  # A's TTL, as its lease records it, not B's 600 s
        after_b = committed(out)
        signal_group(a, signal.SIGCONT)
        woke = time.monotonic()
        code = a.wait(timeout=60)
        took = time.monotonic() - woke  # its heartbeat or its next write notices at once (~0.3 s here)
        assert code == 3 and took < TTL, (code, took, (setup.root / f"a-{kind}.log").read_text())
    finally:
        if a.poll() is None:
            signal_group(a, signal.SIGCONT)
            signal_group(a, signal.SIGKILL)
            a.wait()
    line = error_line(setup, f"a-{kind}.log")  # its heartbeat found B's lease, or its commit in flight failed
    assert "was taken over by worker 'b'" in line or "was committed by another writer first" in line, line
    assert committed(out) == after_b == setup.reference  # nothing of A's landed after B took over
    assert_verified(out, env)


def test_two_containers_alike_in_worker_id_host_boot_and_pid_one_commits_each_shard(setup):
    """`docker run --net=host` twice on one VM, the same command: the same worker id, hostname and boot id,
    and each harvest is pid 1 of its own namespace. One extracts; the other sees the lease move (the
    first's heartbeat) and stops with one line, having written nothing."""
    out = str(setup.root / "containers")
    # The holder's first commit waits (heartbeats going on) until the other has stopped (at most 120 s), so that the
    # other is sure to start while it holds the lease: under load, one whole run can end before the other has
    # started, and both rightly exit 0.
    release = setup.root / "containers.release"
    env = {**harvest_env(setup.cache, devices=2), "HARVEST_TEST_STOP_BEFORE_COMMIT": "0:0:120",
           RELEASE_COMMIT: str(release)}
    twins = [start(setup, out, "--worker-id", "w", "--lease-ttl", str(TTL), log=f"container{i}.log",
                   prefix=another_vm(), env=env) for i in range(2)]
    release_when(lambda: any(p.poll() is not None for p in twins), release)
    codes = [p.wait(timeout=300) for p in twins]
    assert sorted(codes) == [0, 2], codes
    line = error_line(setup, f"container{codes.index(2)}.log")
    assert "held by worker 'w'" in line and "moved while this worker watched it" in line and "(pid 1)" in line, line
    assert committed(out) == setup.reference
    assert_verified(out, harvest_env(setup.cache))


def test_a_long_ttl_holds_against_a_short_one_and_against_a_clock_an_hour_ahead(setup):
    """A holds its streams with --lease-ttl 60 (heartbeat every 10 s) from another pid namespace, one of its
    commits held (a slow write) until the others have stopped, so that it is still running. A command with
    --lease-ttl 2, and one whose wall clock runs an hour ahead (libfaketime), watch A's lease for A's 60 s, see
    it move, and stop (exit 2); neither takes it over, and A finishes alone."""
    out = str(setup.root / "long-ttl")
    release = setup.root / "long-ttl.release"
    slow = {**harvest_env(setup.cache, devices=2), "HARVEST_TEST_STOP_BEFORE_COMMIT": "0:1:120",
            RELEASE_COMMIT: str(release)}
    a = start(setup, out, "--worker-id", "a", "--lease-ttl", "60", log="long-ttl-a.log", prefix=another_vm(),
              env=slow)
    try:
        wait_for_commits(a, out, 1)
        env = harvest_env(setup.cache, devices=2)
        ahead = {**env, **libfaketime.get_reload_information()[1], "FAKETIME": "+1h"}
        takers = [start(setup, out, "--worker-id", "b", "--lease-ttl", "2", log="long-ttl-b.log"),
                  start(setup, out, "--worker-id", "c", "--lease-ttl", "2", log="long-ttl-c.log", env=ahead)]
        codes = [t.wait(timeout=120) for t in takers]
        assert a.poll() is None, "A finished before the takers decided: the test proves nothing"
        release.touch()
        assert codes == [2, 2], (codes, [(setup.root / f"long-ttl-{w}.log").read_text() for w in "bc"])
        for who in "bc":
            assert "moved while this worker watched it" in error_line(setup, f"long-ttl-{who}.log")
        assert a.wait(timeout=300) == 0, (setup.root / "long-ttl-a.log").read_text()
    finally:
        if a.poll() is None:
            signal_group(a, signal.SIGKILL)
            a.wait()
    assert committed(out) == setup.reference
    assert_verified(out, harvest_env(setup.cache))


@pytest.mark.parametrize("kind", ["local", "gs", "s3"])
def test_a_writer_stopped_between_its_lease_check_and_its_commit_commits_nothing(setup, kind, request):
    """A stops (SIGSTOP, from a test hook) after its last lease check and before it creates shard 1's
    sidecar, its data object already written. B takes the stream over and finishes the run. A wakes and
    creates the sidecar: the create fails, A stops with one line, nothing of A's is committed, and the run
    verifies with every sample once."""
    out = str(setup.root / f"paused-{kind}") if kind == "local" else \
        request.getfixturevalue(f"{'gcs' if kind == 'gs' else 's3'}_url")
    env = harvest_env(setup.cache, devices=2)
    hooked = {**env, "HARVEST_TEST_STOP_BEFORE_COMMIT": "0:1"}
    a = start(setup, out, "--worker-id", "a", "--lease-ttl", str(TTL), "--streams", "0", log=f"paused-a-{kind}.log",
              env=hooked)  # not as pid 1 of a namespace: that one cannot SIGSTOP itself
    try:
        deadline = time.monotonic() + 120
        while not stopped(a):
            assert a.poll() is None and time.monotonic() < deadline, (setup.root / f"paused-a-{kind}.log").read_text()
            time.sleep(0.05)
        names = Storage(out).listdir("stream_00000")
        a_object = [n for n in names if n.startswith("shard_000001-")]
        assert len(a_object) == 1 and "shard_000001.json" not in names, names  # its data written, not committed
        # B, every stream, as on another VM: it cannot prove A alive, so it waits out A's TTL on stream 0.
        b = subprocess.run([*another_vm(), *harvest_cmd(*setup.args(out, "--worker-id", "b", "--lease-ttl", str(TTL)))],
                           env=env, capture_output=True, text=True, timeout=300)
        assert b.returncode == 0, b.stderr
        signal_group(a, signal.SIGCONT)
        assert a.wait(timeout=60) == 3, (setup.root / f"paused-a-{kind}.log").read_text()
    finally:
        if a.poll() is None:
            signal_group(a, signal.SIGCONT)
            signal_group(a, signal.SIGKILL)
            a.wait()
    line = error_line(setup, f"paused-a-{kind}.log")  # its commit failed; its heartbeat may have said so first
    assert "stream 0: shard 1 was committed by another writer first" in line or "taken over by worker 'b'" in line
    ours, leftovers = committed_of(Storage(out))
    assert ours == setup.reference  # every sample once, as a run never interrupted commits them
    assert a_object[0] not in Storage(out).listdir("stream_00000") and not leftovers
    assert_verified(out, env)


def test_storage_unreachable_past_half_the_ttl_stops_the_worker_and_a_rerun_finishes(setup, s3_proxy_url, s3_proxy):
    out, env = s3_proxy_url, harvest_env(setup.cache, devices=2)
    a = start(setup, out, "--lease-ttl", str(TTL), log="cut-off.log")
    try:
        wait_for_commits(a, out, 2)
        s3_proxy.outage(TTL * 2.5)
        code = a.wait(timeout=60)
    finally:
        if a.poll() is None:
            a.kill()
            a.wait()
    assert code == 75, (setup.root / "cut-off.log").read_text()
    line = error_line(setup, "cut-off.log")
    assert "rerun the same command to resume" in line.lower(), line
    while s3_proxy.down:
        time.sleep(0.1)
    rerun = run_harvest(*setup.args(out), env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert committed(out) == setup.reference
    assert_verified(out, env)
    leases = [json.loads(Storage(out).read_bytes(f"stream_{s:05d}/lease.json")) for s in range(3)]
    assert all(lease["released"] for lease in leases)


def data_objects(url: str, shard: int) -> list[str]:
    return [n for n in Storage(url).listdir("stream_00000") if n.startswith(f"shard_{shard:06d}-")]


def lease_holders(url: str) -> dict[int, tuple[int, bool]]:
    """Each stream's lease: (its holder's pid, released)."""
    st = Storage(url)
    leases = {}
    for d in (d for d in st.listdir() if d.startswith("stream_")):
        if st.exists(f"{d}/lease.json"):
            record = json.loads(st.read_bytes(f"{d}/lease.json"))
            leases[int(d[7:])] = (record["pid"], record["released"])
    return leases


def wait_until(condition, proc: subprocess.Popen, log: str, setup, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, (setup.root / log).read_text()
        time.sleep(0.05)


def test_a_stalled_writer_that_commits_first_after_a_takeover_leaves_the_new_holder_going(setup):
    """A stops (SIGSTOP) before committing shard 2; B waits out A's TTL, takes the stream and re-extracts it,
    its own commit of shard 2 held until A has woken (SIGCONT) and committed shard 2 first. B finds the same range
    committed and goes on to finish (exit 0); A, no longer holding the stream, exits 3; no lease is left held.
    Where A's heartbeat sees the takeover before its commit thread runs (a loaded machine), A stops without
    committing and B's hold ends after 30 s: the same outcome, by the other order."""
    out = str(setup.root / "wake-order")
    env = harvest_env(setup.cache, devices=2)
    a = start(setup, out, "--worker-id", "a", "--lease-ttl", str(TTL), "--streams", "0", log="wake-a.log",
              env={**env, "HARVEST_TEST_STOP_BEFORE_COMMIT": "0:2"})
    release = setup.root / "wake-order.release"
    b = None
    try:
        wait_until(lambda: stopped(a), a, "wake-a.log", setup)
        b = start(setup, out, "--worker-id", "b", "--lease-ttl", str(TTL), log="wake-b.log",
                  env={**env, "HARVEST_TEST_STOP_BEFORE_COMMIT": "0:2:30", RELEASE_COMMIT: str(release)})
        wait_until(lambda: len(data_objects(out, 2)) == 2, b, "wake-b.log", setup)  # B's shard 2 written, held
        signal_group(a, signal.SIGCONT)
        wait_until(lambda: Storage(out).exists("stream_00000/shard_000002.json"), b, "wake-b.log", setup)
        release.touch()
        assert b.wait(timeout=300) == 0, (setup.root / "wake-b.log").read_text()
        assert a.wait(timeout=60) == 3, (setup.root / "wake-a.log").read_text()
    finally:
        for proc in (a, b):
            if proc is not None and proc.poll() is None:
                signal_group(proc, signal.SIGCONT)
                signal_group(proc, signal.SIGKILL)
                proc.wait()
    assert "taken over by worker 'b'" in error_line(setup, "wake-a.log")
    assert all(released for _, released in lease_holders(out).values()), lease_holders(out)
    assert committed(out) == setup.reference
    assert_verified(out, env)


def _sigterm_timed(proc: subprocess.Popen, timeout: float) -> tuple[int, float]:
    """SIGTERM to `proc`'s group: its exit code and the seconds it took to exit."""
    signal_group(proc, signal.SIGTERM)
    began = time.monotonic()
    code = proc.wait(timeout=timeout)
    return code, time.monotonic() - began


def _killed(proc: subprocess.Popen) -> None:
    """`proc`'s group SIGKILLed where it still runs (a test that failed before it exited)."""
    if proc.poll() is None:
        signal_group(proc, signal.SIGKILL)
        proc.wait()


def test_sigterm_while_waiting_out_another_holders_ttl_exits_75_at_once(setup):
    """A's lease is left by a SIGKILLed worker with --lease-ttl 60; B waits it out, and SIGTERM (a preemption
    notice) ends that wait within seconds: exit 75, no lease held by B."""
    out = str(setup.root / "sigterm-wait")
    a = start(setup, out, "--worker-id", "a", "--lease-ttl", "60", "--streams", "0", log="sigterm-wait-a.log")
    try:
        wait_for_commits(a, out, 1)
    finally:
        signal_group(a, signal.SIGKILL)
        a.wait()
    b = start(setup, out, "--worker-id", "b", "--lease-ttl", "60", log="sigterm-wait-b.log")
    try:
        wait_until(lambda: "taken over if unchanged" in (setup.root / "sigterm-wait-b.log").read_text(), b,
                   "sigterm-wait-b.log", setup)
        code, took = _sigterm_timed(b, timeout=60)
    finally:
        _killed(b)
    assert code == 75 and took < 15, (code, took, (setup.root / "sigterm-wait-b.log").read_text())
    assert "stopped on SIGTERM" in error_line(setup, "sigterm-wait-b.log")
    assert all(pid != b.pid or released for pid, released in lease_holders(out).values()), lease_holders(out)


def test_sigterm_while_a_commit_is_held_exits_75_within_the_deadline(setup):
    """A commit held in flight (a write that does not end) does not hold up a stop: SIGTERM exits 75 within the
    stop's deadline, the leases released; a rerun finishes the run."""
    out = str(setup.root / "sigterm-commit")
    env = harvest_env(setup.cache, devices=2)
    a = start(setup, out, "--lease-ttl", "60", log="sigterm-commit.log",
              env={**env, "HARVEST_TEST_STOP_BEFORE_COMMIT": "0:1:120"})
    try:
        wait_until(lambda: Storage(out).exists("stream_00000/shard_000000.json") and data_objects(out, 1), a,
                   "sigterm-commit.log", setup)
        time.sleep(0.5)  # past the last lease check: the commit is held
        code, took = _sigterm_timed(a, timeout=150)
    finally:
        _killed(a)
    assert code == 75 and took < 25, (code, took, (setup.root / "sigterm-commit.log").read_text())
    assert all(released for _, released in lease_holders(out).values()), lease_holders(out)
    rerun = run_harvest(*setup.args(out, "--lease-ttl", "60"), env=env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    assert committed(out) == setup.reference
    assert_verified(out, env)
