"""Exactly once under the faults a fleet meets, with the real CLI in subprocesses: two identical commands
started together (one extracts, the other stops at once); a worker stopped (SIGSTOP) past --lease-ttl,
whose streams another worker takes over and finishes, wakes up (SIGCONT) and exits without committing
anything; storage unreachable for longer than half the TTL stops the worker, and a rerun finishes with
the same bytes. Locally and on S3 (moto honours If-Match); fake-gcs-server honours ifGenerationMatch too,
and tests/test_lease.py races contenders on all three."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import types

import pytest
from extract_helpers import harvest_cmd, harvest_env, run_harvest, text_streams

from harvest.storage import Storage

pytestmark = pytest.mark.slow

TTL = 4
SETTINGS = ("--points", "resid_post:1-3,mlp_out:2", "--max-seq-len", "128", "--long", "chunk", "--batch-size", "2",
            "--shard-size", "160KB")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """3 streams of a 240-record dataset and a reference extraction, never interrupted."""
    root = tmp_path_factory.mktemp("fencing")
    checkpoint, env, streams = text_streams(root, 3, n=240)
    cache = root / "cache"

    def args(out: str, *extra: str) -> list[str]:
        return ["extract", "--model", str(checkpoint), "--data", str(streams), "--out", out, *SETTINGS, *extra]

    reference = str(root / "reference")
    done = run_harvest(*args(reference), env=env)
    assert done.returncode == 0, done.stderr
    return types.SimpleNamespace(root=root, cache=cache, args=args, reference=committed(reference))


def committed(url: str) -> dict[str, bytes]:
    """The run's data: shards and sidecars by name (run.json aside: it records --out)."""
    st = Storage(url)
    return {f"{d}/{n}": st.read_bytes(f"{d}/{n}") for d in st.listdir() if d.startswith("stream_")
            for n in st.listdir(d) if n.startswith("shard_")}


def sidecar_count(url: str) -> int:
    st = Storage(url)
    return sum(n.endswith(".json") and n.startswith("shard_") for d in st.listdir() if d.startswith("stream_")
               for n in st.listdir(d))


def start(setup, out: str, *extra: str, log: str) -> subprocess.Popen:
    with open(setup.root / log, "wb") as f:
        return subprocess.Popen(harvest_cmd(*setup.args(out, *extra)), env=harvest_env(setup.cache, devices=2),
                                stdout=subprocess.DEVNULL, stderr=f)


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
    out = str(setup.root / "twins")
    twins = [start(setup, out, log=f"twin{i}.log") for i in range(2)]
    codes = [p.wait(timeout=300) for p in twins]
    assert sorted(codes) == [0, 2], codes
    winner, loser = (twins[0], 1) if codes[0] == 0 else (twins[1], 0)
    line = error_line(setup, f"twin{loser}.log")
    host = socket.gethostname()
    assert f"held by worker '{host}:0' on {host} (pid {winner.pid})" in line, line
    assert committed(out) == setup.reference  # the refused twin wrote nothing of its own
    assert_verified(out, harvest_env(setup.cache))


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_worker_stopped_past_the_ttl_is_fenced_out_and_commits_nothing(setup, kind, request):
    out = str(setup.root / "stalled") if kind == "local" else request.getfixturevalue("s3_url")
    env = harvest_env(setup.cache, devices=2)
    a = start(setup, out, "--worker-id", "a", "--lease-ttl", str(TTL), log=f"a-{kind}.log")
    try:
        wait_for_commits(a, out, 2)
        os.kill(a.pid, signal.SIGSTOP)
        time.sleep(TTL + 0.5)
        b = run_harvest(*setup.args(out, "--worker-id", "b", "--lease-ttl", str(TTL)), env=env, timeout=300)
        assert b.returncode == 0, b.stderr
        assert "took over the lease of worker 'a'" in b.stderr, b.stderr
        after_b = committed(out)
        os.kill(a.pid, signal.SIGCONT)
        woke = time.monotonic()
        code = a.wait(timeout=60)
        took = time.monotonic() - woke  # its heartbeat or its next write notices at once (~0.3 s here)
        assert code == 3 and took < TTL, (code, took, (setup.root / f"a-{kind}.log").read_text())
    finally:
        if a.poll() is None:
            os.kill(a.pid, signal.SIGCONT)
            a.kill()
            a.wait()
    line = error_line(setup, f"a-{kind}.log")
    assert "was taken over by worker 'b'" in line, line
    assert committed(out) == after_b == setup.reference  # nothing of A's landed after B took over
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
