"""Helpers for tests that run `harvest extract` as a user would: a subprocess, killed at will.

Every process gets HARVEST_CACHE, JAX_PLATFORMS=cpu and XLA_FLAGS with a small fake-device count, so a
test controls the mesh regardless of the suite's conftest defaults.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

TMP_MARK = ".harvest-tmp-"  # harvest.storage: local temp files of writes in flight (hidden from listdir)
# Per stream: bookkeeping, and the pointer to the generation (a random name; `committed` reads through it).
VOLATILE = {"progress.json", "lease.json", "generation.json"}


def harvest_env(cache: Path, devices: int = 2) -> dict[str, str]:
    return {**os.environ, "HARVEST_CACHE": str(cache), "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def harvest_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "harvest", *args]


def run_harvest(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(harvest_cmd(*args), env=env, capture_output=True, text=True, timeout=timeout)


def write_text_dataset(path: Path, n: int = 300, seed: int = 1234) -> Path:
    """`n` jsonl records of 5..400 chars (most short, some long enough to be chunked), deterministic, with
    two malformed lines, one empty text and a few non-ASCII characters (several byte tokens each)."""
    rng = random.Random(seed)
    words = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly zebras "
             "naïve café déjà vu 猫 🙂 residual stream sparse autoencoder").split()
    lines = []
    for i in range(n):
        if i in (41, 177):
            lines.append('{"text": "torn line without its end')
            continue
        if i == 99:
            lines.append(json.dumps({"text": ""}))
            continue
        length = int(5 + 395 * rng.random() ** 3)
        text = ""
        while len(text) < length:
            text += rng.choice(words) + rng.choice(" ,. \n")
        lines.append(json.dumps({"text": text[:length], "id": i}, ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def text_streams(root: Path, num_streams: int, n: int, devices: int = 2) -> tuple[Path, dict[str, str], Path]:
    """(the demo checkpoint, the env for harvest subprocesses, a streams directory) for `n` text records
    of write_text_dataset split into `num_streams` streams, all under `root`."""
    from harvest.demo import demo_checkpoint

    cache = root / "cache"
    checkpoint = demo_checkpoint(cache)
    env = harvest_env(cache, devices=devices)
    source = write_text_dataset(root / "data.jsonl", n=n)
    streams = root / "streams"
    made = run_harvest("streams", "create", "--data", str(source), "--num-streams", str(num_streams),
                       "--out", str(streams), env=env)
    assert made.returncode == 0, made.stderr
    return checkpoint, env, streams


# A commit held by HARVEST_TEST_STOP_BEFORE_COMMIT=STREAM:SHARD:SECONDS ends early once the file this names exists.
RELEASE_COMMIT = "HARVEST_TEST_RELEASE_COMMIT"


def release_when(condition, release: Path, timeout: float = 300) -> None:
    """Release a held commit (create `release`, the file RELEASE_COMMIT names) once `condition()` holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"the held commit's condition did not hold within {timeout} s"
        time.sleep(0.05)
    release.touch()


# The fault tests' extraction (tests/store/test_fencing.py, tests/store/test_store_holes.py): 3 streams of 240
# records, small shards.
FAULT_SETTINGS = ("--points", "resid_post:1-3,mlp_out:2", "--max-seq-len", "128", "--long", "chunk",
                  "--batch-size", "2", "--shard-size", "160KB")


def fault_reference(root: Path):
    """The fault tests' common ground, built once a session: the demo checkpoint and its cache (compiled programs
    shared by every process those tests start), 3 streams of a 240-record dataset, `args(out, *extra, data=)`
    for `harvest extract` with FAULT_SETTINGS, and a reference extraction never interrupted, under `root`."""
    import types

    checkpoint, env, streams = text_streams(root, 3, n=240)

    def args(out: str, *extra: str, data=streams) -> list[str]:
        return ["extract", "--model", str(checkpoint), "--data", str(data), "--out", out, *FAULT_SETTINGS, *extra]

    reference = str(root / "reference")
    done = run_harvest(*args(reference), env=env)
    assert done.returncode == 0, done.stderr
    return types.SimpleNamespace(root=root, cache=root / "cache", args=args, source=root / "data.jsonl",
                                 reference=reference)


def sidecars(out: Path) -> list[Path]:
    return sorted(out.glob("stream_*/shard_*.json"))


def count_sidecars(out: Path) -> int:
    total = 0
    try:
        streams = [e.path for e in os.scandir(out) if e.name.startswith("stream_")]
    except FileNotFoundError:
        return 0
    for d in streams:
        try:
            total += sum(1 for e in os.scandir(d) if e.name.startswith("shard_") and e.name.endswith(".json"))
        except FileNotFoundError:
            pass
    return total


def is_complete(out: Path, num_streams: int) -> bool:
    """Every stream's last committed sidecar (in its current generation) is `final`."""
    from harvest.storage import Storage
    from harvest.store import format as fmt
    from harvest.store.listing import stream_generation

    for s in range(num_streams):
        found = sorted((out / fmt.shard_dir(s, stream_generation(Storage(str(out)), s))).glob("shard_*.json"))
        if not found or not json.loads(found[-1].read_text())["final"]:
            return False
    return True


def kill_at_random(cmd: list[str], env: dict[str, str], out: Path, rng: random.Random, log: Path,
                   timeout: float = 120) -> dict:
    """Start `cmd`, SIGKILL it at a moment drawn from `rng`: after 1-12 more shards committed (plus up to
    0.2 s), or after a plain delay of 0.5-3 s that may land in start-up (a job starts in ~1-2 s here: a longer
    delay could let it commit most of a small run). Returns what happened."""
    before = count_sidecars(out)
    with open(log, "ab") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)
    if rng.random() < 0.75:
        mode, target, extra = "shards", before + rng.randint(1, 12), rng.uniform(0.0, 0.2)
        deadline = time.monotonic() + timeout
        while count_sidecars(out) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(extra)
    else:
        mode, target = "delay", None
        try:
            proc.wait(timeout=rng.uniform(0.5, 3.0))
        except subprocess.TimeoutExpired:
            pass
    alive = proc.poll() is None
    if alive:
        os.kill(proc.pid, signal.SIGKILL)
    rc = proc.wait()
    return {"mode": mode, "target": target, "killed": alive, "rc": rc, "before": before,
            "after": count_sidecars(out)}


def wait_for_sidecars(proc: subprocess.Popen, out: Path, n: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while count_sidecars(out) < n:
        if proc.poll() is not None:
            raise AssertionError(f"harvest exited ({proc.returncode}) before {n} shards were committed")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {n} committed shards after {timeout}s")
        time.sleep(0.01)


def files_under(root: Path) -> dict[str, Path]:
    """Every file under root (hidden ones too), by path relative to root."""
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def data_of(sidecar: Path) -> Path:
    """The data object a sidecar commits (its name carries the writing attempt's id)."""
    return sidecar.parent / json.loads(sidecar.read_text())["file"]


def committed(storage) -> tuple[dict[str, bytes], list[str]]:
    """(what a run's streams hold as committed, the data objects no sidecar names) on any Storage.

    Data objects are keyed by their shard's name (`stream_00001/shard_000003.safetensors`) and sidecars
    carry that name in `file`, so two runs written by different attempts compare equal when their
    content is."""
    from harvest.store import format as fmt
    from harvest.store.listing import stream_generation

    data, leftovers = {}, []
    for stream in (n for n in storage.listdir() if n.startswith("stream_")):
        where = fmt.shard_dir(fmt.dir_stream(stream), stream_generation(storage, fmt.dir_stream(stream)))
        names = storage.listdir(where)
        named = {}
        for name in names:
            if name.startswith("shard_") and name.endswith(".json"):
                sidecar = json.loads(storage.read_bytes(f"{where}/{name}"))
                sidecar.pop("generation", None)  # a wipe's random name for the stream's directory
                stem = name[: -len(".json")]
                named[sidecar["file"]] = stem
                sidecar["file"] = stem + ".safetensors"
                data[f"{stream}/{name}"] = json.dumps(sidecar, sort_keys=True).encode()
        for name in names:
            if name.startswith("shard_") and name.endswith(".safetensors"):
                if name in named:
                    data[f"{stream}/{named[name]}.safetensors"] = storage.read_bytes(f"{where}/{name}")
                else:
                    leftovers.append(f"{where}/{name}")
    return data, leftovers


def data_files(root: Path) -> tuple[dict[str, bytes], list[str]]:
    """(what a local run holds, as `committed` gives it, with run.json and any other file beside the
    streams; the files no finished run should keep: local temp files of interrupted writes and data
    objects no sidecar names). Per-stream progress.json, lease.json and generation.json (VOLATILE) are left out."""
    from harvest.storage import Storage

    data, leftovers = committed(Storage(str(root)))
    for rel, path in files_under(root).items():
        if TMP_MARK in path.name:
            leftovers.append(rel)
        elif path.name not in VOLATILE and not path.name.startswith("shard_"):
            data[rel] = path.read_bytes()
    return data, leftovers


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Names, sizes and mtimes of everything under root (directories included): any write shows."""
    return {p.relative_to(root).as_posix(): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


def json_diff(a, b, path: str = "") -> list[str]:
    """Dotted paths where two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            sub = f"{path}.{k}" if path else str(k)
            out += json_diff(a.get(k), b.get(k), sub) if k in a and k in b else [sub]
        return out
    return [] if a == b else [path]


def another_vm() -> tuple[str, ...]:
    """A prefix that runs a command in a pid namespace of its own, as in another container or on another VM:
    a lease holder's pid proves nothing there, so a taker waits out the holder's TTL (root, or where user
    namespaces are allowed). The command then runs as pid 1 of its namespace."""
    import shutil

    import pytest

    for prefix in (("unshare", "--pid", "--fork", "--mount-proc"),
                   ("unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc")):
        if shutil.which("unshare") and subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    pytest.skip("unshare cannot make a pid namespace here (needs root or user namespaces)")


def wait_stopped(pid: int, timeout: float = 10.0) -> None:
    """Until every thread of process `pid` is stopped (SIGSTOP is delivered asynchronously: a thread may
    finish a write after kill() returned)."""
    deadline = time.monotonic() + timeout
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        if states and all(state in "Tt" for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: {states}"
        time.sleep(0.01)
