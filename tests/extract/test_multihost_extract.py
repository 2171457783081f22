"""`harvest extract` on 2 processes x 4 CPU devices (jax.distributed on 127.0.0.1), as on a pod: each slot
writes its own streams; the result equals a one-process run; a dead process stops the other; a config
mismatch stops both at start."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from extract_helpers import committed, data_of
from processes import free_port
from safetensors.numpy import load_file

from harvest.demo import demo_checkpoint
from harvest.storage import Storage

pytestmark = pytest.mark.slow
POINTS = "resid_pre:1,attn_out:0,mlp_hidden:1,resid_post:2-3"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """5 streams of very different lengths (more streams than slots) and the demo model with tokenizer."""
    root = tmp_path_factory.mktemp("pod")
    rng = np.random.default_rng(7)
    # Record i lands in stream i % 5; stream s's texts are ~(1 + 10 s) times as long as stream 0's.
    rows = [{"text": "".join(rng.choice(list("abc de.fg"), 3 + (1 + 10 * (i % 5)) * rng.integers(1, 4)))}
            for i in range(64)]
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    streams = root / "streams"
    run([sys.executable, "-m", "harvest", "streams", "create", "--data", str(data), "--num-streams", "5",
         "--out", str(streams)], env=env(1)).check_returncode()
    model = demo_checkpoint(root)
    reference = root / "single"
    run(extract_cmd(model, streams, reference, "data=1"), env=env(1)).check_returncode()
    return root, model, streams, reference


def env(devices: int) -> dict:
    return {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}


def run(cmd, env, timeout=240):
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def extract_cmd(model, streams, out, mesh, *extra):
    return [sys.executable, "-m", "harvest", "-q", "extract", "--model", str(model), "--data", str(streams),
            "--out", str(out), "--points", POINTS, "--mesh", mesh, "--max-seq-len", "48", "--batch-size", "2",
            "--shard-size", "6KB", "--dtype", "float32", *extra]


def start_pod(cmd, extra_per_process=((), ())):
    port = free_port()
    return [subprocess.Popen([*cmd, *extra, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                              "--process-id", str(i)], env=env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True) for i, extra in enumerate(extra_per_process)]


def finish(procs, timeout=240):
    results = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        results.append((p.returncode, out, err))
    return results


def shards(out: Path) -> dict[str, dict]:
    """Each committed shard's tensors, by its sidecar's name (data objects carry the writing attempt's id)."""
    return {str(f.relative_to(out)): load_file(data_of(f)) for f in sorted(out.glob("stream_*/shard_*.json"))}


def sidecar_ranges(out: Path) -> dict[str, tuple]:
    return {str(f.relative_to(out)): (m["start"], m["next"], m["samples"], m["tokens"], m["final"])
            for f in sorted(out.glob("stream_*/shard_*.json")) for m in [json.loads(f.read_text())]}


def assert_matches_single(out: Path, reference: Path):
    assert sidecar_ranges(out) == sidecar_ranges(reference)
    ours, theirs = shards(out), shards(reference)
    assert ours.keys() == theirs.keys()
    for name, tensors in theirs.items():
        for key in ("tokens", "offsets", "sample_ids", "variants"):
            np.testing.assert_array_equal(ours[name][key], tensors[key], err_msg=f"{name} {key}")
        for key, want in tensors.items():
            if "." in key:
                scale = float(np.abs(want).max())
                np.testing.assert_allclose(ours[name][key], want, rtol=1e-5, atol=1e-5 * scale, err_msg=key)


def verify_ok(out: Path):
    result = run([sys.executable, "-m", "harvest", "verify", str(out)], env=env(1))
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("mesh", ["2d", "1d", "3d"])
def test_pod_run_equals_single_process_and_repeats_bit_for_bit(setup, mesh):
    root, model, streams, reference = setup
    out = root / f"pod-{mesh}"
    results = finish(start_pod(extract_cmd(model, streams, out, mesh)))
    assert all(rc == 0 for rc, _, _ in results), results
    assert_matches_single(out, reference)
    verify_ok(out)
    if mesh == "2d":  # the same command again: bit-identical shards
        again = root / "pod-2d-again"
        results = finish(start_pod(extract_cmd(model, streams, again, mesh)))
        assert all(rc == 0 for rc, _, _ in results), results
        assert committed(Storage(str(out))) == committed(Storage(str(again)))


def test_different_points_stop_both_processes_at_start(setup):
    root, model, streams, _ = setup
    out = root / "pod-mismatch"
    cmd = extract_cmd(model, streams, out, "2d", "--peer-timeout", "10")
    cmd = cmd[: cmd.index("--points")] + cmd[cmd.index("--points") + 2 :]
    results = finish(start_pod(cmd, (("--points", POINTS), ("--points", "resid_post:1"))))
    for rc, _, err in results:
        assert rc == 2, err
        assert "processes disagree on the run's settings" in err and "tensors" in err, err
    assert not out.exists() or not any(out.rglob("shard_*"))


def test_a_dead_process_stops_the_other_and_a_restart_finishes(setup):
    root, model, streams, reference = setup
    out = root / "pod-kill"
    cmd = extract_cmd(model, streams, out, "2d", "--peer-timeout", "10")
    procs = start_pod(cmd)
    deadline = time.monotonic() + 120
    while not any(out.glob("stream_*/shard_*.json")) and time.monotonic() < deadline:
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    procs[1].wait()
    _, err = procs[0].communicate(timeout=90)
    waited = time.monotonic() - killed_at
    assert procs[0].returncode == 2, err
    assert "another process of this run stopped" in err and "Traceback" not in err, err
    assert waited < 10, f"the survivor took {waited:.0f}s to exit"
    results = finish(start_pod(cmd))
    assert all(rc == 0 for rc, _, _ in results), results
    assert_matches_single(out, reference)
    verify_ok(out)
