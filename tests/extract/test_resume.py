"""Exactly once, as a user meets it (the real CLI in subprocesses, the demo checkpoint, 2 fake CPU devices):
`harvest extract` killed at random moments and rerun writes the bytes of a run never killed; verify catches
a missing or altered shard; another worker's lease stops a second worker before it writes; a run.json made
with other settings is refused unless --overwrite; a finished run named from elsewhere is left as it is."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
import subprocess
import types
from pathlib import Path

import pytest
from extract_helpers import (
    committed,
    count_sidecars,
    data_of,
    data_files,
    harvest_cmd,
    is_complete,
    json_diff,
    kill_at_random,
    run_harvest,
    sidecars,
    snapshot,
    text_streams,
    wait_for_sidecars,
)

import harvest
from harvest.storage import Storage

pytestmark = pytest.mark.slow

NUM_STREAMS = 3
POINTS = "resid_post:1-3,mlp_out:2"
SETTINGS = ("--points", POINTS, "--max-seq-len", "128", "--long", "chunk", "--batch-size", "2",
            "--shard-size", "64KB")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Streams of a 300-record dataset and a reference extraction into `a`, never interrupted."""
    root = tmp_path_factory.mktemp("resume")
    checkpoint, env, streams = text_streams(root, NUM_STREAMS, n=300)

    def extract_args(out: Path, *extra: str) -> list[str]:
        return ["extract", "--model", str(checkpoint), "--data", str(streams), "--out", str(out), *SETTINGS, *extra]

    a = root / "a"
    first = run_harvest(*extract_args(a), env=env)
    assert first.returncode == 0, first.stderr
    assert "chunked" in first.stdout and "bad inputs skipped: 3" in first.stdout, first.stdout
    checked = run_harvest("verify", str(a), env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    per_stream = [len(list((a / f"stream_{s:05d}").glob("shard_*.json"))) for s in range(NUM_STREAMS)]
    assert min(per_stream) >= 20, f"want many shards per stream, got {per_stream}"
    return types.SimpleNamespace(root=root, env=env, a=a, args=extract_args, per_stream=per_stream)


def assert_same_run(a: Path, b: Path) -> list[str]:
    """b holds exactly a's files, byte for byte (progress.json and leases aside); run.json differs only in
    the --out it records (config.out: the one setting that must differ between two output directories).
    Returns the temp files of interrupted writes found in b (checked by the caller, after the rest)."""
    files_a, temps_a = data_files(a)
    files_b, temps_b = data_files(b)
    assert not temps_a
    assert sorted(files_a) == sorted(files_b), (sorted(set(files_a) ^ set(files_b)))
    run_a, run_b = json.loads(files_a.pop("run.json")), json.loads(files_b.pop("run.json"))
    assert json_diff(run_a, run_b) == ["config.out"], json_diff(run_a, run_b)
    differ = [rel for rel in files_a if files_a[rel] != files_b[rel]]
    assert not differ, f"{len(differ)} files differ, e.g. {differ[:5]}"
    for out in (a, b):  # a finished run holds no lease
        assert_released(out)
    return temps_b


def assert_released(out: Path) -> None:
    """No stream's lease is held: each lease object left is marked released by its last holder."""
    held = [p for p in out.glob("stream_*/lease.json") if not json.loads(p.read_text())["released"]]
    assert not held, f"leases still held: {held}"


def verify(out: Path, env) -> subprocess.CompletedProcess:
    return run_harvest("verify", str(out), env=env)


def test_killed_at_random_moments_and_resumed_writes_the_same_bytes(run):
    b = run.root / "b"
    cmd = harvest_cmd(*run.args(b))
    rng = random.Random(20261121)
    kills = [kill_at_random(cmd, run.env, b, rng, log=run.root / "b.log") for _ in range(4)]
    mid_run = [k for k in kills if k["killed"] and k["after"] > k["before"]]
    assert mid_run, f"no kill landed mid-run: {kills}"
    assert not is_complete(b, NUM_STREAMS), f"the run finished before the last kill: {kills}"
    finished = run_harvest(*run.args(b), env=run.env)
    assert finished.returncode == 0, finished.stderr
    temps = assert_same_run(run.a, b)
    checked = verify(b, run.env)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # A kill just after a shard's data landed but before its sidecar, simulated on the finished run:
    # stream 0 loses its last sidecar (the final shard), stream 1 its last sidecar with the orphan data
    # object cut short, stream 2 its last sidecar with one byte of the orphan flipped. Resume commits each
    # shard again, with the same bytes (under its own attempt's name), and sweeps the orphans.
    streams = [sorted((b / f"stream_{s:05d}").glob("shard_*.json")) for s in range(NUM_STREAMS)]
    streams[0][-1].unlink()
    orphan = data_of(streams[1][-1])
    streams[1][-1].unlink()
    orphan.write_bytes(orphan.read_bytes()[: orphan.stat().st_size // 2])
    orphan = data_of(streams[2][-1])
    streams[2][-1].unlink()
    data = bytearray(orphan.read_bytes())
    data[len(data) // 2] ^= 0xFF
    orphan.write_bytes(bytes(data))
    resumed = run_harvest(*run.args(b), env=run.env)
    assert resumed.returncode == 0, resumed.stderr
    temps += assert_same_run(run.a, b)
    checked = verify(b, run.env)
    assert checked.returncode == 0, checked.stdout + checked.stderr

    # A sidecar lost from the middle of a stream (never by harvest: sidecars are created in order and never
    # deleted but by --overwrite): the stream cannot resume past it, and the rerun says so in one line.
    middle = sorted((b / "stream_00002").glob("shard_*.json"))[5]
    kept = middle.read_bytes()
    middle.unlink()
    before = data_files(b)
    refused = run_harvest(*run.args(b), env=run.env)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert f"{middle.name} is missing" in refused.stderr and "--overwrite" in refused.stderr, refused.stderr
    assert data_files(b) == before
    middle.write_bytes(kept)
    # Temp files of writes a SIGKILL cut short (up to a whole shard each): invisible to harvest, but the
    # resumed worker, holding the stream's lease, must clear them, or every preemption leaks disk.
    assert not temps, f"temp files of killed writes left behind after resume: {sorted(set(temps))}"


def test_verify_names_a_missing_or_altered_shard(run):
    missing = run.root / "v-missing"
    shutil.copytree(run.a, missing)
    data_of(missing / "stream_00001/shard_000003.json").unlink()
    result = verify(missing, run.env)
    assert result.returncode == 1, result.stdout + result.stderr
    problems = result.stdout.splitlines()[:-1]
    assert problems and all("stream_00001/shard_000003" in line for line in problems), result.stdout
    assert "sidecar without its data: shard_000003-" in result.stdout, result.stdout
    assert "FAILED" in result.stdout.splitlines()[-1]

    flipped = run.root / "v-flipped"
    shutil.copytree(run.a, flipped)
    altered = data_of(flipped / "stream_00002/shard_000005.json").relative_to(flipped).as_posix()
    data = bytearray((flipped / altered).read_bytes())
    data[-7] ^= 0x01  # in the tensor data, not the header: the file still decodes
    (flipped / altered).write_bytes(bytes(data))
    result = verify(flipped, run.env)
    assert result.returncode == 1, result.stdout + result.stderr
    problems = result.stdout.splitlines()[:-1]
    assert problems and all(altered in line for line in problems), result.stdout
    assert "checksum mismatch" in result.stdout, result.stdout


def written_the_old_way(sidecar: Path) -> bytes:
    """Rewrite a sidecar as harvest wrote it before sidecars named their checksum: the whole file's sha256
    under `sha256`, each tensor's under `tensor_sha256`. Returns its new bytes."""
    obj = json.loads(sidecar.read_text())
    data = data_of(sidecar).read_bytes()
    n = int.from_bytes(data[:8], "little")
    spans = {name: entry["data_offsets"] for name, entry in json.loads(data[8 : 8 + n]).items()
             if name != "__metadata__"}
    for key in ("checksum", "digest", "tensor_digests", "chunk_bytes", "chunk_digests", "source_digest"):
        obj.pop(key, None)  # nor did they have chunk digests, nor pin their source
    obj["sha256"] = hashlib.sha256(data).hexdigest()
    obj["tensor_sha256"] = {name: hashlib.sha256(data[8 + n + a : 8 + n + b]).hexdigest()
                            for name, (a, b) in spans.items()}
    sidecar.write_text(json.dumps(obj, sort_keys=True))
    return sidecar.read_bytes()


def test_a_run_written_before_sidecars_named_their_checksum_reads_verifies_and_resumes(run):
    """An upgraded harvest meets a run cut short by an older one: it verifies the old sidecars (sha256), resumes
    the run after them with its own checksum, writes the same shards as a run never cut short, and reads both."""
    old = run.root / "old"
    shutil.copytree(run.a, old)
    paths = [sorted((old / f"stream_{s:05d}").glob("shard_*.json")) for s in range(NUM_STREAMS)]
    kept = {path: written_the_old_way(path) for stream in paths for path in stream}
    checked = verify(old, run.env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    data = bytearray(data_of(paths[1][3]).read_bytes())
    data[-7] ^= 0x01
    data_of(paths[1][3]).write_bytes(bytes(data))
    refused = verify(old, run.env)
    assert refused.returncode == 1 and "shard_000003-" in refused.stdout and "checksum mismatch" in refused.stdout
    data[-7] ^= 0x01
    data_of(paths[1][3]).write_bytes(bytes(data))
    for stream in paths:
        for path in stream[len(stream) // 2 :]:  # cut short halfway (the rest never committed)
            data_of(path).unlink()
            path.unlink()
            del kept[path]
    resumed = run_harvest(*run.args(old), env=run.env)
    assert resumed.returncode == 0, resumed.stderr
    assert {path: path.read_bytes() for path in kept} == kept
    new = [json.loads(p.read_text()) for p in old.glob("stream_*/shard_*.json") if p not in kept]
    assert new and all(sc["checksum"] == "xxh3_128" and "sha256" not in sc for sc in new)
    assert not any("source_digest" in sc for sc in new)  # resumed as before pins: unpinned
    checked = verify(old, run.env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (data_a, _), (data_old, leftovers) = (committed(Storage(str(out))) for out in (run.a, old))
    shards = [rel for rel in data_a if rel.endswith(".safetensors")]
    assert not leftovers and sorted(shards) == sorted(r for r in data_old if r.endswith(".safetensors"))
    assert all(data_a[rel] == data_old[rel] for rel in shards)  # the same bytes as a run never cut short
    tokens = [len(b["tokens"]) for b in harvest.open(str(old)).token_batches(256, verify="sha256")]
    assert sum(tokens) == sum(json.loads(p.read_text())["tokens"] for p in run.a.glob("stream_*/shard_*.json"))


def test_a_stream_leased_by_another_worker_stops_the_second_before_it_writes(run):
    out = run.root / "leased"
    args = run.args(out, "--max-samples", "30")
    log = run.root / "leased-a.log"
    # A runs and renews its leases (every 0.5 s) while one of its commits is held, so it is sure to hold them
    # while B tries: B sees them move and stops. (A stopped would be taken over after its TTL, as it should.)
    held = {**run.env, "HARVEST_TEST_STOP_BEFORE_COMMIT": "0:1:150"}
    with open(log, "wb") as f:
        worker_a = subprocess.Popen(harvest_cmd(*args, "--worker-id", "a", "--lease-ttl", "3"), env=held, stdout=f,
                                    stderr=subprocess.STDOUT)
    try:
        wait_for_sidecars(worker_a, out, 1)
        refused_while_a_runs(run, out, args)
    finally:
        worker_a.kill()
        worker_a.wait()
    # A killed: the same worker id proves its holder gone (a dead pid of this boot) and resumes at once.
    resumed = run_harvest(*args, "--worker-id", "a", env=run.env)
    assert resumed.returncode == 0, resumed.stderr
    assert is_complete(out, NUM_STREAMS)
    assert_released(out)
    checked = verify(out, run.env)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def written_by_others(out: Path, holders: dict[Path, str]) -> list[str]:
    """What in `out` another worker than A wrote or changed: a lease that no longer names A's process, or a
    data object of an attempt other than A's (the run is A's alone so far)."""
    changed = [str(p) for p, holder in holders.items() if json.loads(p.read_text())["holder"] != holder
               or json.loads(p.read_text())["released"]]
    attempts = {p.name.split("-")[1] for p in out.glob("stream_*/shard_*-*.safetensors")}
    return changed + (sorted(attempts) if len(attempts) > 1 else [])


def refused_while_a_runs(run, out: Path, args: list[str]) -> None:
    assert not is_complete(out, NUM_STREAMS)
    leases = sorted(out.glob("stream_*/lease.json"))
    assert leases and all(json.loads(p.read_text())["worker"] == "a" for p in leases)
    holders = {p: json.loads(p.read_text())["holder"] for p in leases}
    committed_before = sidecars(out)

    second = run_harvest(*args, "--worker-id", "b", env=run.env)
    assert second.returncode == 2, second.stdout + second.stderr
    lines = [ln for ln in second.stderr.splitlines() if ln.startswith("harvest: error:")]  # after what it watched
    assert len(lines) == 1 and "Traceback" not in second.stderr, second.stderr
    stream = int(leases[0].parent.name.split("_")[1])
    assert f"stream {stream} " in lines[0] and "'a'" in lines[0], lines[0]
    assert not written_by_others(out, holders), "the refused worker changed the output"
    # --overwrite deletes a worker's streams: only once it holds them, never under another worker's lease.
    wiping = run_harvest(*args, "--worker-id", "b", "--overwrite", env=run.env)
    assert wiping.returncode == 2 and f"stream {stream} " in wiping.stderr, wiping.stdout + wiping.stderr
    assert not written_by_others(out, holders), "--overwrite by a worker without the lease changed the output"
    assert set(committed_before) <= set(sidecars(out)), "--overwrite by a worker without the lease deleted shards"


def test_other_settings_into_the_same_out_are_refused_unless_overwrite(run):
    out = run.root / "mismatch"
    shutil.copytree(run.a, out)
    before = snapshot(out)
    other = run.args(out)
    other[other.index("--points") + 1] = "resid_post:1-2"
    refused = run_harvest(*other, env=run.env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "points: 'mlp_out:2,resid_post:1-3' -> 'resid_post:1-2'" in lines[0] and "--overwrite" in lines[0], lines[0]
    assert snapshot(out) == before, "the refused run changed the output"

    redone = run_harvest(*other, "--overwrite", env=run.env)
    assert redone.returncode == 0, redone.stderr
    info = json.loads((out / "run.json").read_text())
    assert info["points"] == [["resid_post", [1, 2]]] and sorted(info["tensors"]) == ["resid_post.1", "resid_post.2"]
    checked = verify(out, run.env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert is_complete(out, NUM_STREAMS)
    assert count_sidecars(out) == len(sidecars(out)) < sum(run.per_stream)  # fewer tensors: fewer shards


def test_rerunning_a_finished_run_from_another_directory_changes_nothing(run):
    """The same streams and out, spelled relative to another working directory (a worker restarted from
    elsewhere, another host's mount), and the same points spelled as TransformerLens hook names: the run is
    recognised as the same one, finds every stream done and writes nothing."""
    out = run.root / "finished"
    shutil.copytree(run.a, out)
    before, _ = data_files(out)
    args = run.args(out)
    args[args.index("--data") + 1] = "streams"
    args[args.index("--out") + 1] = "finished"
    args[args.index("--points") + 1] = "blocks.2.hook_mlp_out,resid_post:3,blocks.1.hook_resid_post,resid_post:2"
    rerun = subprocess.run(harvest_cmd(*args), env=run.env, cwd=run.root, capture_output=True, text=True,
                           timeout=180)
    assert rerun.returncode == 0, rerun.stderr
    assert "this run 0 tokens" in rerun.stdout and "0 shards" in rerun.stdout, rerun.stdout
    after, temps = data_files(out)
    assert after == before and not temps
    assert_released(out)


def test_overwrite_of_some_streams_keeps_run_json_true_for_all(tmp_path):
    """--overwrite --streams 0 of a 4-stream run replaces stream 0 only: other settings are refused (run.json
    must go on describing streams 1-3), the same settings redo it, and the run verifies, every stream's
    tensors read and checked against run.json."""
    checkpoint, env, streams = text_streams(tmp_path, 4, n=48)
    out = tmp_path / "four"

    def args(points: str, *extra: str) -> list[str]:
        return ["extract", "--model", str(checkpoint), "--data", str(streams), "--out", str(out), "--points", points,
                "--max-seq-len", "128", "--long", "chunk", "--shard-size", "64KB", *extra]

    assert run_harvest(*args(POINTS), env=env).returncode == 0
    before = data_files(out)
    refused = run_harvest(*args("resid_post:1-2", "--overwrite", "--streams", "0"), env=env)
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "points:" in refused.stderr and "--overwrite of some streams keeps the others" in refused.stderr
    assert data_files(out) == before
    redone = run_harvest(*args(POINTS, "--overwrite", "--streams", "0"), env=env)
    assert redone.returncode == 0, redone.stderr
    assert data_files(out) == before  # the same settings: the same bytes, stream 0 written again
    checked = verify(out, env)
    assert checked.returncode == 0 and "4 streams" in checked.stdout, checked.stdout + checked.stderr
