"""Checkpoint steps in storage (harvest.training.step_parts) on local disk, GCS and S3: a step is complete only
when every process's marker of one attempt is there, so a part left by a killed attempt is never joined with
a later attempt's; files stream in chunks and come back checked against their markers, a damaged one
named in one line. (Training through them, kills and damage included: tests/decoder/test_train_resume.py,
tests/decoder/test_bucket_checkpoints.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from harvest.training import step_parts
from harvest.storage import Storage

KILLED, LATER = "20260101T000000Z-0000000a", "20260101T000500Z-0000000b"


def write_part(local: Path, files: dict[str, bytes]) -> Path:
    for name, data in files.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
    return local


def test_a_killed_attempts_part_never_completes_a_later_attempts_step(root, tmp_path, monkeypatch):
    """Step 10 of a 2-process run: the killed attempt committed process 0's part and left process 1's files
    without a marker; the later attempt's process 1 then commits. Neither attempt is complete, nothing is
    fetched; once the later attempt's process 0 commits too, the step is that attempt's files alone."""
    monkeypatch.setattr(step_parts, "CHUNK", 1000)  # several chunks per file on every backend
    checkpoints = Storage(root).child("checkpoints")

    def files(attempt: str, process: int) -> dict[str, bytes]:
        return {"state/params.w/0.0": f"{attempt} {process} ".encode() * 500, f"process_{process}": b"",
                "_CHECKPOINT_METADATA": attempt.encode()}

    step_parts.upload_part(checkpoints, 10, KILLED, 0, 2, write_part(tmp_path / "killed0", files(KILLED, 0)))
    for name, data in files(KILLED, 1).items():  # killed before its marker
        checkpoints.write_bytes(f"10/{step_parts.part_dir(KILLED, 1)}/{name}", data)
    step_parts.upload_part(checkpoints, 10, LATER, 1, 2, write_part(tmp_path / "later1", files(LATER, 1)))

    assert step_parts.steps_present(checkpoints) == [10]
    assert step_parts.complete(checkpoints) == [] and step_parts.complete_steps(checkpoints) == []
    for attempt in (KILLED, LATER):
        with pytest.raises(step_parts.CorruptStep, match="not a complete checkpoint"):
            step_parts.fetch_step(checkpoints, 10, attempt, tmp_path / "fetched")
    assert step_parts.prune(checkpoints, keep=1) == []

    step_parts.upload_part(checkpoints, 10, LATER, 0, 2, write_part(tmp_path / "later0", files(LATER, 0)))
    assert step_parts.complete(checkpoints) == [(10, LATER)]
    step_parts.fetch_step(checkpoints, 10, LATER, tmp_path / "fetched")
    fetched = {p.relative_to(tmp_path / "fetched").as_posix(): p.read_bytes()
               for p in (tmp_path / "fetched").rglob("*") if p.is_file()}
    assert fetched == {**files(LATER, 1), **files(LATER, 0)}  # process 0's copy of a shared name


def test_a_damaged_file_is_named_and_nothing_of_the_copy_is_kept(root, tmp_path, monkeypatch):
    """A byte flipped or added, or the file gone, in a streamed file and in a small one (one request): the
    fetch names the file and keeps nothing; the step before is intact."""
    monkeypatch.setattr(step_parts, "CHUNK", 1000)
    checkpoints = Storage(root).child("checkpoints")
    files = {"a/b": bytes(range(256)) * 20, "small": b"0123456789" * 4}
    for step in (2, 4):
        step_parts.upload_part(checkpoints, step, LATER, 0, 1, write_part(tmp_path / f"part{step}", files))
    assert step_parts.complete(checkpoints) == [(4, LATER), (2, LATER)]
    for name, data in files.items():
        rel = f"4/{step_parts.part_dir(LATER, 0)}/{name}"
        for damaged in (data[:-1] + bytes([data[-1] ^ 1]), data + b"!"):
            checkpoints.write_bytes(rel, damaged)
            with pytest.raises(step_parts.CorruptStep, match=f"{len(damaged)} bytes that differ from what") as error:
                step_parts.fetch_step(checkpoints, 4, LATER, tmp_path / "fetched")
            assert checkpoints.url_of(rel) in str(error.value) and "process_00000.json recorded" in str(error.value)
            assert not (tmp_path / "fetched").exists()
        checkpoints.delete(rel)
        with pytest.raises(step_parts.CorruptStep, match=f"{name}: missing, though process_00000.json lists it"):
            step_parts.fetch_step(checkpoints, 4, LATER, tmp_path / "fetched")
        checkpoints.write_bytes(rel, data)
    step_parts.fetch_step(checkpoints, 4, LATER, tmp_path / "fetched")
    step_parts.fetch_step(checkpoints, 2, LATER, tmp_path / "fetched-2")
    for name, data in files.items():
        assert (tmp_path / "fetched" / name).read_bytes() == (tmp_path / "fetched-2" / name).read_bytes() == data
