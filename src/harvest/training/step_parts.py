"""Numbered steps of a directory tree kept in storage by several processes that share no filesystem.

Layout under a root (a run's `checkpoints/`):
    <step>/<attempt>/process_NNNNN/<files>   what process N of one attempt wrote for the step
    <step>/<attempt>/process_NNNNN.json      its marker (a CheckpointPart: each file's size and sha256)
An attempt is one start of the command; all its processes share its id, which sorts by start time. A marker
is written after the files it lists: a part without its marker does not exist, and a step holds a complete
copy only when the markers of all `num_processes` processes of one attempt are there. Attempts never write
each other's objects, so a part left by a killed attempt is never joined with a later attempt's. No
process waits for another to commit its part.

Files move as streams in chunks (bounded memory: THREADS files at once, CHUNK bytes each). A fetch joins
the parts of one attempt into a local directory (process 0's copy of a name that several parts hold),
hashing every file as it streams in and checking it against its marker.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harvest.errors import UserError
from harvest.storage import Storage, StorageError, StorageNotFoundError, is_transient
from harvest.store.records import Record

log = logging.getLogger(__name__)

THREADS = 8  # files moved at once per process
CHUNK = 4 * 2**20  # bytes read or written at a time per file


@dataclasses.dataclass(frozen=True)
class CheckpointPart(Record):
    """`checkpoints/<step>/<attempt>/process_NNNNN.json`: the commit marker of one process's part of a checkpoint
    step, written after the files it lists (names relative to the part's directory, '/'-separated). `attempt`
    names the start of `harvest train` that wrote it (every process of a start shares it): a step is complete
    only when all `num_processes` markers of one attempt are there."""

    step: int
    attempt: str
    process: int
    num_processes: int
    files: list  # [{"name": str, "bytes": int, "sha256": str}]

    @classmethod
    def from_json(cls, obj: Any) -> CheckpointPart:
        part = super().from_json(obj)
        for entry in part.files:
            if not (isinstance(entry, dict) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("bytes"), int) and isinstance(entry.get("sha256"), str)):
                raise ValueError(f"field 'files': expected {{name, bytes, sha256}} entries, got {entry!r:.80}")
        if not 0 <= part.process < part.num_processes:
            raise ValueError(f"process {part.process} outside 0..{part.num_processes - 1}")
        if not (0 < len(part.attempt) <= 64 and part.attempt.isascii() and part.attempt.replace("-", "").isalnum()):
            raise ValueError(f"field 'attempt': {part.attempt!r:.80} is not an attempt id")
        return part


class CorruptStep(UserError):
    """A step's file is missing or differs from its marker: that copy of the step cannot be restored."""


def part_dir(attempt: str, process: int) -> str:
    return f"{attempt}/process_{process:05d}"


def marker_name(process: int) -> str:
    return f"process_{process:05d}.json"


def marker(attempt: str, process: int) -> str:
    return f"{attempt}/{marker_name(process)}"


def upload_part(root: Storage, step: int, attempt: str, process: int, num_processes: int,
                local: Path) -> CheckpointPart:
    """Upload every file under `local` as this process's part of `step`, then its marker."""
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    part_root = root.child(f"{step}/{part_dir(attempt, process)}")

    def put(name: str) -> dict:
        with open(local / name, "rb") as src:
            first = src.read(CHUNK)
        if len(first) < CHUNK:  # the whole file: one request, retried by Storage
            part_root.write_bytes(name, first)
            return {"name": name, "bytes": len(first), "sha256": hashlib.sha256(first).hexdigest()}
        tries = 1
        while True:  # a stream cannot be replayed: after a transient failure the file starts over
            try:
                return _stream_up(local / name, part_root, name)
            except StorageError as e:
                if tries == root.attempts or not is_transient(e):
                    raise
            time.sleep(min(root.backoff * 2 ** (tries - 1), root.backoff_cap))
            tries += 1

    with ThreadPoolExecutor(THREADS) as pool:
        files = list(pool.map(put, names))
    part = CheckpointPart(step=step, attempt=attempt, process=process, num_processes=num_processes, files=files)
    root.write_bytes(f"{step}/{marker(attempt, process)}", part.to_bytes())
    return part


def _stream_up(path: Path, part_root: Storage, name: str) -> dict:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as src, part_root.open_write(name) as dst:
        while chunk := src.read(CHUNK):
            digest.update(chunk)
            dst.write(chunk)
            size += len(chunk)
    return {"name": name, "bytes": size, "sha256": digest.hexdigest()}


def steps_present(root: Storage) -> list[int]:
    """Every step with anything in storage, complete or not."""
    return sorted(int(name) for name in root.listdir() if name.isdigit())


def attempts(root: Storage, step: int) -> list[str]:
    """The attempts with anything in `step`, newest first."""
    return sorted((name for name in root.listdir(str(step)) if not name.endswith(".json")), reverse=True)


def read_parts(root: Storage, step: int, attempt: str) -> list[CheckpointPart] | None:
    """The markers of `attempt` in `step`, in process order, when all of them are there; None while any is
    missing. CorruptStep when one is unreadable or they disagree."""
    names = set(root.listdir(f"{step}/{attempt}"))
    if marker_name(0) not in names:
        return None
    first = _read_marker(root, step, attempt, 0)
    if not all(marker_name(p) in names for p in range(first.num_processes)):
        return None
    parts = [first] + [_read_marker(root, step, attempt, p) for p in range(1, first.num_processes)]
    if any((p.step, p.attempt, p.num_processes) != (step, attempt, first.num_processes) for p in parts):
        raise CorruptStep(f"{root.url_of(f'{step}/{attempt}')}: its markers disagree on the step, the attempt or "
                          "the process count")
    return parts


def complete(root: Storage) -> list[tuple[int, str]]:
    """(step, attempt) of every complete copy, newest first (a copy whose markers are unreadable counts: its
    damage shows when it is fetched)."""
    found = []
    for step in reversed(steps_present(root)):
        if marker_name(0) in root.listdir(str(step)):  # <step>/process_00000.json: no attempt level
            log.warning("%s: a checkpoint written by a harvest before attempt ids, which this one does not read; "
                        "resume with that harvest, or delete it to start over", root.url_of(str(step)))
            continue
        for attempt in attempts(root, step):
            try:
                whole = read_parts(root, step, attempt) is not None
            except CorruptStep:
                whole = True
            if whole:
                found.append((step, attempt))
    return found


def complete_steps(root: Storage) -> list[int]:
    return sorted({step for step, _ in complete(root)})


def fetch_step(root: Storage, step: int, attempt: str, local: Path) -> None:
    """Download `attempt`'s copy of `step` into `local`, every file hashed as it streams in and checked against
    its marker. CorruptStep (naming the file) if any differs or is missing; `local` is then removed."""
    parts = read_parts(root, step, attempt)
    if parts is None:
        raise CorruptStep(f"{root.url_of(f'{step}/{attempt}')}: not a complete checkpoint (a process's marker is "
                          "missing)")
    chosen: dict[str, tuple[int, dict]] = {}
    for part in reversed(parts):  # process 0 last: its copy of a shared name wins
        for entry in part.files:
            chosen[entry["name"]] = (part.process, entry)

    def get(item: tuple[str, tuple[int, dict]]) -> None:
        name, (process, entry) = item
        rel, path = f"{step}/{part_dir(attempt, process)}/{name}", local / name
        bad_name = CorruptStep(f"{root.url_of(f'{step}/{marker(attempt, process)}')}: lists {name!r}, not a plain "
                               "relative path; the marker is corrupt")
        if not path.resolve().is_relative_to(local.resolve()):
            raise bad_name
        digest, size = hashlib.sha256(), 0
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            if entry["bytes"] < CHUNK:  # one request, for a byte more than listed (a longer file shows)
                data = root.read_range(rel, 0, entry["bytes"] + 1) if entry["bytes"] else root.read_bytes(rel)
                path.write_bytes(data)
                digest.update(data)
                size = len(data)
            else:
                with root.open_binary(rel) as src, open(path, "wb") as dst:
                    while chunk := src.read(CHUNK):
                        digest.update(chunk)
                        dst.write(chunk)
                        size += len(chunk)
        except ValueError:
            raise bad_name from None
        except StorageNotFoundError:
            raise CorruptStep(f"{root.url_of(rel)}: missing, though {marker_name(process)} lists it") from None
        if size != entry["bytes"] or digest.hexdigest() != entry["sha256"]:
            raise CorruptStep(f"{root.url_of(rel)}: {size} bytes that differ from what {marker_name(process)} recorded "
                              f"({entry['bytes']} bytes, sha256 {entry['sha256'][:12]}...)")

    try:
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(get, sorted(chosen.items())))
    except BaseException:
        shutil.rmtree(local, ignore_errors=True)
        raise


def prune(root: Storage, keep: int) -> list[int]:
    """Delete all but the newest `keep` complete steps, and the incomplete leftovers older than the newest
    complete one (a process killed mid-upload); markers go first, so a step half deleted is not complete.
    Returns the steps deleted."""
    present = steps_present(root)
    whole = complete_steps(root)
    if not whole:
        return []
    kept = set(whole[-keep:])
    doomed = [s for s in present if s not in kept and s < whole[-1]]
    for step in doomed:
        root.delete_many(f"{step}/{attempt}/{name}" for attempt in attempts(root, step)
                         for name in root.listdir(f"{step}/{attempt}") if name.endswith(".json"))
        root.delete_tree(str(step))
    return doomed


def _read_marker(root: Storage, step: int, attempt: str, process: int) -> CheckpointPart:
    rel = f"{step}/{marker(attempt, process)}"
    try:
        return CheckpointPart.from_bytes(root.read_bytes(rel))
    except ValueError as e:
        raise CorruptStep(f"{root.url_of(rel)}: not a valid checkpoint marker ({e})") from None
