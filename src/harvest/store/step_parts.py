"""Numbered steps of a directory tree kept in storage by several processes that share no filesystem.

Layout under a root (a run's `checkpoints/`): `<step>/process_NNNNN/<files>` holds what process N wrote
for the step, and `<step>/process_NNNNN.json` (a CheckpointPart: each file's size and sha256) is written
after them, last: a part without its marker does not exist, and a step exists only when the markers of
all its `num_processes` processes do. No process waits for another to commit its part.

A fetch joins the parts of a step into one local directory (where several parts hold the same name,
process 0's copy is taken), checking every file against its marker.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from harvest.errors import UserError
from harvest.storage import Storage, StorageNotFoundError
from harvest.store.records import CheckpointPart

THREADS = 8  # files moved at once per process


class CorruptStep(UserError):
    """A step's file is missing or differs from its marker: the step cannot be restored as it is."""


def part_dir(process: int) -> str:
    return f"process_{process:05d}"


def marker(process: int) -> str:
    return f"{part_dir(process)}.json"


def upload_part(root: Storage, step: int, process: int, num_processes: int, local: Path) -> CheckpointPart:
    """Upload every file under `local` as this process's part of `step`, then its marker."""
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    part_root = root.child(f"{step}/{part_dir(process)}")

    def put(name: str) -> dict:
        data = (local / name).read_bytes()
        part_root.write_bytes(name, data)
        return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}

    with ThreadPoolExecutor(THREADS) as pool:
        files = list(pool.map(put, names))
    part = CheckpointPart(step=step, process=process, num_processes=num_processes, files=files)
    root.write_bytes(f"{step}/{marker(process)}", part.to_bytes())
    return part


def steps_present(root: Storage) -> list[int]:
    """Every step with anything in storage, complete or not."""
    return sorted(int(name) for name in root.listdir() if name.isdigit())


def read_parts(root: Storage, step: int) -> list[CheckpointPart] | None:
    """The markers of `step`, in process order, when all of them are there; None while any is missing."""
    names = set(root.listdir(str(step)))
    if marker(0) not in names:
        return None
    first = _read_marker(root, step, 0)
    if not all(marker(p) in names for p in range(first.num_processes)):
        return None
    parts = [first] + [_read_marker(root, step, p) for p in range(1, first.num_processes)]
    if any(p.num_processes != first.num_processes or p.step != step for p in parts):
        raise CorruptStep(f"{root.url_of(str(step))}: its markers disagree on the step or the process count; "
                          f"delete {root.url_of(str(step))} to resume from an earlier checkpoint")
    return parts


def complete_steps(root: Storage) -> list[int]:
    return [step for step in steps_present(root) if read_parts(root, step) is not None]


def fetch_step(root: Storage, step: int, local: Path) -> None:
    """Download the complete `step` into `local`, every file checked against its marker (CorruptStep if not)."""
    parts = read_parts(root, step)
    if parts is None:
        raise CorruptStep(f"{root.url_of(str(step))}: not a complete checkpoint (a process's marker is missing)")
    chosen: dict[str, tuple[int, dict]] = {}
    for part in reversed(parts):  # process 0 last: its copy of a shared name wins
        for entry in part.files:
            chosen[entry["name"]] = (part.process, entry)

    def get(item: tuple[str, tuple[int, dict]]) -> None:
        name, (process, entry) = item
        url = root.url_of(f"{step}/{part_dir(process)}/{name}")
        try:
            data = root.read_bytes(f"{step}/{part_dir(process)}/{name}")
        except ValueError:
            raise CorruptStep(f"{root.url_of(f'{step}/{marker(process)}')}: lists {name!r}, not a plain relative "
                              "path; the marker is corrupt") from None
        except StorageNotFoundError:
            raise CorruptStep(f"{url}: missing, though {marker(process)} lists it; checkpoint step {step} is "
                              f"damaged: delete {root.url_of(str(step))} to resume from an earlier one") from None
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise CorruptStep(f"{url}: {len(data)} bytes that differ from what {marker(process)} recorded "
                              f"({entry['bytes']} bytes, sha256 {entry['sha256'][:12]}...); checkpoint step {step} "
                              f"is damaged: delete {root.url_of(str(step))} to resume from an earlier one")
        path = local / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    with ThreadPoolExecutor(THREADS) as pool:
        list(pool.map(get, sorted(chosen.items())))


def prune(root: Storage, keep: int) -> list[int]:
    """Delete all but the newest `keep` complete steps, and the incomplete leftovers older than the newest
    complete one (a process killed mid-upload); markers go first, so a step half deleted is not complete.
    Returns the steps deleted."""
    present = steps_present(root)
    complete = [s for s in present if read_parts(root, s) is not None]
    if not complete:
        return []
    kept = set(complete[-keep:])
    doomed = [s for s in present if s not in kept and s < complete[-1]]
    for step in doomed:
        root.delete_many(f"{step}/{name}" for name in root.listdir(str(step)) if name.endswith(".json"))
        root.delete_tree(str(step))
    return doomed


def _read_marker(root: Storage, step: int, process: int) -> CheckpointPart:
    rel = f"{step}/{marker(process)}"
    try:
        return CheckpointPart.from_bytes(root.read_bytes(rel))
    except ValueError as e:
        raise CorruptStep(f"{root.url_of(rel)}: not a valid checkpoint marker ({e}); delete "
                          f"{root.url_of(str(step))} to resume from an earlier checkpoint") from None
