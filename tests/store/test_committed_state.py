"""A run's committed state as every reader sees it, with real `harvest extract` processes: a flipped byte in a
committed shard is refused by every path that returns activations (one line naming the shard), a run
overwritten with fewer streams is read as the streams its run.json names, and the end-of-run summary after a
resume counts what is committed (what `harvest verify` counts), not what was computed twice.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import types
from pathlib import Path

import numpy as np
import pytest
from extract_helpers import data_of, harvest_cmd, run_harvest, text_streams

import harvest
from harvest.read import CorruptShardError
from harvest.storage import Storage
from harvest.store.snapshot import read_shard

pytestmark = pytest.mark.slow

SETTINGS = ("--points", "resid_post:1-2", "--max-seq-len", "128", "--long", "chunk", "--batch-size", "2",
            "--shard-size", "16KB")
VERIFIED = re.compile(r"OK \S+: (\d+) streams, [\d,]+ records, \d+ shards, ([\d,]+) samples, ([\d,]+) tokens")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The demo checkpoint, and the same 60 records split into 3 streams and into 2."""
    root = tmp_path_factory.mktemp("committed")
    checkpoint, env, three = text_streams(root / "three", 3, n=60)
    _, _, two = text_streams(root / "two", 2, n=60)
    return types.SimpleNamespace(root=root, checkpoint=checkpoint, env=env, three=three, two=two)


def extract_args(data, streams: Path, out: Path, *extra: str) -> list[str]:
    return ["extract", "--model", str(data.checkpoint), "--data", str(streams), "--out", str(out), *SETTINGS, *extra]


def verified(out: Path, env) -> tuple[int, int, int]:
    """(streams, samples, tokens) as `harvest verify` counts them; the run must pass."""
    checked = run_harvest("verify", str(out), env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    streams, samples, tokens = VERIFIED.search(checked.stdout).groups()
    return int(streams), int(samples.replace(",", "")), int(tokens.replace(",", ""))


def test_the_summary_after_a_resume_counts_what_is_committed(data):
    """A worker stalled before its third commit of stream 0 and killed; the rerun's summary names the run's
    committed samples and tokens, as verify counts them (it counted re-packed rows twice)."""
    out = data.root / "resumed"
    env = {**data.env, "HARVEST_TEST_STOP_BEFORE_COMMIT": "0:2"}
    proc = subprocess.Popen(harvest_cmd(*extract_args(data, data.three, out)), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while _state(proc.pid) != "T":
            assert proc.poll() is None and time.monotonic() < deadline, "the worker never reached shard 2"
            time.sleep(0.05)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert len(list((out / "stream_00000").glob("shard_*.json"))) == 2
    resumed = run_harvest(*extract_args(data, data.three, out), env=data.env)
    assert resumed.returncode == 0, resumed.stderr
    said = re.search(r"wrote \S+: (\d+) samples, (\d+) tokens in (\d+) streams", resumed.stdout)
    assert said, resumed.stdout
    streams, samples, tokens = verified(out, data.env)
    assert (int(said.group(3)), int(said.group(1)), int(said.group(2))) == (streams, samples, tokens), resumed.stdout


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.fixture(scope="module")
def corrupted(data):
    """A finished 3-stream run with one byte flipped inside an activation tensor of stream 1's first shard."""
    out = data.root / "flipped"
    done = run_harvest(*extract_args(data, data.three, out), env=data.env)
    assert done.returncode == 0, done.stderr
    sidecar = out / "stream_00001" / "shard_000000.json"
    path = data_of(sidecar)
    raw = bytearray(path.read_bytes())
    (n,) = np.frombuffer(bytes(raw[:8]), "<u8")
    begin, end = json.loads(bytes(raw[8:8 + int(n)]))["resid_post.2"]["data_offsets"]
    raw[8 + int(n) + (begin + end) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    return types.SimpleNamespace(out=out, shard=path.name)


def test_a_flipped_byte_is_refused_by_every_reader_of_activations(data, corrupted):
    run = harvest.open(str(corrupted.out))
    sc = next(sc for sc in run.shards if (sc.stream, sc.shard) == (1, 0))
    first = int(np.asarray(read_shard(Storage(str(corrupted.out)), run.shards[0])["sample_ids"])[0])
    assert run.sample(first).activations  # an intact shard still serves
    calls = {"read_shard": lambda: run.read_shard(sc), "store read_shard": lambda: read_shard(run.storage, sc),
             "sample": lambda: run.sample(1), "iter_samples": lambda: list(run.iter_samples([1])),
             "shard_samples": lambda: list(run.shard_samples(sc))}
    for name, call in calls.items():
        with pytest.raises(CorruptShardError) as raised:
            call()
        assert corrupted.shard in str(raised.value) and "\n" not in str(raised.value), (name, raised.value)
    # harvest inspect shows a sample of the first shard with samples (stream 0's): with a byte of each of
    # stream 0's shards flipped too, it refuses in one line naming the shard.
    for p in (corrupted.out / "stream_00000").glob("shard_*.json"):
        target = data_of(p)
        raw = bytearray(target.read_bytes())
        raw[-1] ^= 0x01
        target.write_bytes(bytes(raw))
    shown = run_harvest("inspect", str(corrupted.out), env=data.env)
    assert shown.returncode == 2 and len(shown.stderr.strip().splitlines()) == 1, shown.stdout + shown.stderr
    assert "stream_00000/shard_000000-" in shown.stderr and "harvest verify" in shown.stderr, shown.stderr


def test_a_run_overwritten_with_fewer_streams_reads_the_streams_run_json_names(data):
    """3 streams, then a full --overwrite with the same records in 2 streams: the reader, status and inspect
    see the 2 streams run.json names and every sample once, whatever stream directories storage still holds
    (the old stream_00002/ is stale data, which verify reports)."""
    out = data.root / "overwritten"
    assert run_harvest(*extract_args(data, data.three, out), env=data.env).returncode == 0
    old = data.root / "old-stream-2"
    shutil.copytree(out / "stream_00002", old)
    redone = run_harvest(*extract_args(data, data.two, out, "--overwrite"), env=data.env)
    assert redone.returncode == 0, redone.stderr
    said = re.search(r"wrote \S+: (\d+) samples, (\d+) tokens in 2 streams", redone.stdout)
    samples, tokens = int(said.group(1)), int(said.group(2))  # what it committed (as verify counts, see above)
    if not (out / "stream_00002").exists():  # the overwrite cleared it: put the stale stream back for the readers
        shutil.copytree(old, out / "stream_00002")
    run = harvest.open(str(out))
    assert run.streams == [0, 1]
    assert (run.num_samples, run.num_tokens) == (samples, tokens)
    keys = [(s.sample_id, s.variant) for s in run.iter_samples()]
    assert len(keys) == len(set(keys)) == samples
    assert run.stats("resid_post.1").count == tokens
    shown = run_harvest("inspect", str(out), env=data.env)
    assert shown.returncode == 0 and f"{samples:,} samples, {tokens:,} tokens" in shown.stdout, shown.stdout
    status = run_harvest("status", str(out), env=data.env)
    assert status.returncode == 0 and "2/2 streams done" in status.stdout, status.stdout
    checked = run_harvest("verify", str(out), env=data.env)
    assert checked.returncode == 1 and "stream_00002/: stream directory outside the run" in checked.stdout
