"""A resume reads the input it started with, or refuses in one line (issue 36, point 7): each sidecar pins its
stream's content through the records its shards were made from (harvest.data.pin), and a resume re-reads that
prefix. Real `harvest extract` processes over a plain jsonl, a glob of two files and a streams directory, each
killed part-way, its input edited (the same line count, only the text changed), and resumed.
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
import xxhash
from extract_helpers import (
    count_sidecars,
    data_files,
    harvest_cmd,
    run_harvest,
    text_streams,
    wait_for_sidecars,
    write_text_dataset,
)

pytestmark = pytest.mark.slow

SETTINGS = ("--points", "resid_post:1", "--max-seq-len", "64", "--long", "truncate", "--batch-size", "2",
            "--shard-size", "24KB")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """The demo checkpoint, a 240-record dataset split into 2 streams, and `args(data, out, *extra)`."""
    root = tmp_path_factory.mktemp("pins")
    checkpoint, env, streams = text_streams(root, 2, n=240)

    def args(data: Path | str, out: Path, *extra: str) -> list[str]:
        return ["extract", "--model", str(checkpoint), "--data", str(data), "--out", str(out), *SETTINGS, *extra]

    return root, env, streams, args


def killed_after(args: list[str], env: dict, out: Path, shards: int) -> None:
    """Run `harvest extract` until `shards` shards are committed, then SIGKILL it (a preemption)."""
    proc = subprocess.Popen(harvest_cmd(*args), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_sidecars(proc, out, shards)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def upper_cased(path: Path, lines: slice = slice(None)) -> bytes:
    """Upper-case the text of the records in `lines` of a jsonl file (same line count); returns the old bytes."""
    old = path.read_bytes()
    rows = old.decode().split("\n")
    for i in range(len(rows))[lines]:
        try:
            row = json.loads(rows[i])
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("text"), str) and row["text"] != row["text"].upper():
            rows[i] = json.dumps({**row, "text": row["text"].upper()}, ensure_ascii=False)
    path.write_text("\n".join(rows), encoding="utf-8")
    assert path.read_bytes() != old and path.read_text().count("\n") == old.decode().count("\n")
    return old


def assert_refused(args: list[str], env: dict, out: Path, where: str) -> None:
    """The resume exits 2 with one line naming the input and what to do, and commits nothing."""
    before = sorted(p.name for p in out.rglob("shard_*"))
    refused = run_harvest(*args, env=env)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    line = refused.stderr.strip()
    assert len(line.splitlines()) == 1, refused.stderr
    assert line.startswith(f"harvest: error: {where}: ") and "changed since the run began" in line, line
    assert "--overwrite" in line and "restore the input" in line, line
    assert sorted(p.name for p in out.rglob("shard_*")) == before
    assert not any(json.loads(p.read_text())["released"] is False for p in out.glob("stream_*/lease.json"))


def test_a_plain_source_edited_under_a_resume_is_refused_and_restored_resumes_byte_identical(setup):
    root, env, _, args = setup
    source = write_text_dataset(root / "plain.jsonl", n=160, seed=7)
    reference, out = root / "plain-reference", root / "plain-out"
    done = run_harvest(*args(source, reference), env=env)
    assert done.returncode == 0, done.stderr
    assert count_sidecars(reference) >= 8, count_sidecars(reference)
    killed_after(args(source, out), env, out, 4)
    pinned = [json.loads(p.read_text()) for p in sorted(out.glob("stream_00000/shard_*.json"))]
    assert pinned and all(len(sc["source_digest"]) == 32 for sc in pinned)

    before = sum(sc["long"]["truncated"] for sc in pinned)
    assert before > 0

    kept = upper_cased(source)
    assert_refused(args(source, out), env, out, str(source))
    source.write_bytes(kept)  # restored: the resume goes on and writes what a run never stopped writes
    resumed = run_harvest(*args(source, out), env=env)
    assert resumed.returncode == 0, resumed.stderr
    # The summary counts the run's long samples, those of the shards committed before the kill included.
    truncated = sum(json.loads(p.read_text())["long"]["truncated"] for p in out.glob("stream_*/shard_*.json"))
    assert f"long samples: {truncated} truncated," in resumed.stdout, resumed.stdout
    assert f"long samples: {truncated} truncated," in done.stdout, done.stdout
    files_ref, _ = data_files(reference)
    files_out, temps = data_files(out)
    run_ref, run_out = json.loads(files_ref.pop("run.json")), json.loads(files_out.pop("run.json"))
    assert run_ref["data"] == run_out["data"] and not temps
    assert files_ref == files_out
    assert run_harvest("verify", str(out), env=env).returncode == 0


def test_an_edit_past_the_consumed_prefix_resumes(setup):
    """Only what the committed shards were made from is pinned: records not yet read may change."""
    root, env, _, args = setup
    source = write_text_dataset(root / "tail.jsonl", n=160, seed=7)
    out = root / "tail-out"
    killed_after(args(source, out), env, out, 2)
    last = max(json.loads(p.read_text())["next"][0] for p in out.glob("stream_00000/shard_*.json"))
    assert last < 150
    upper_cased(source, slice(150, None))
    resumed = run_harvest(*args(source, out), env=env)
    assert resumed.returncode == 0, resumed.stderr
    final = json.loads(max(out.glob("stream_00000/shard_*.json")).read_text())
    assert final["final"] and final["source_digest"] == xxhash.xxh3_128(source.read_bytes()).hexdigest()


def test_a_glob_with_an_edited_file_is_refused(setup):
    root, env, _, args = setup
    parts = root / "parts"
    parts.mkdir()
    write_text_dataset(parts / "a.jsonl", n=90, seed=3)
    write_text_dataset(parts / "b.jsonl", n=90, seed=4)
    out = root / "glob-out"
    killed_after(args(f"{parts}/*.jsonl", out), env, out, 4)
    upper_cased(parts / "a.jsonl", slice(0, 3))
    assert_refused(args(f"{parts}/*.jsonl", out), env, out, f"{parts}/*.jsonl")


def test_a_streams_directory_edited_in_place_is_refused(setup):
    """streams.json keeps its counts and sha256 (not re-read on every resume): the pin sees the edit."""
    root, env, streams, args = setup
    out = root / "streams-out"
    killed_after(args(streams, out), env, out, 4)
    committed = {int(p.parent.name[-5:]) for p in out.glob("stream_*/shard_*.json")}
    stream = min(committed)
    upper_cased(streams / f"stream_{stream:05d}.jsonl", slice(0, 2))
    assert_refused(args(streams, out), env, out, str(streams / f"stream_{stream:05d}.jsonl"))
