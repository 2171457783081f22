"""Reading back what is committed: where each stream resumes."""

from __future__ import annotations

import re

from harvest.store import format as fmt
from harvest.store.fs import Storage
from harvest.store.writer import ResumePoint

_SIDECAR = re.compile(r"^shard_(\d{6})\.json$")


def resume_point(storage: Storage, stream: int) -> ResumePoint:
    """The stream's state after its contiguous run of committed shards from shard 0.

    A shard without its sidecar does not exist: it is rewritten, under the same name, with the same bytes.
    """
    directory = fmt.stream_dir(stream)
    numbers = sorted(int(m.group(1)) for name in storage.listdir(directory) if (m := _SIDECAR.match(name)))
    point = ResumePoint()
    for expected, number in enumerate(numbers):
        if number != expected:
            break
        manifest = storage.read_json(f"{directory}/{fmt.shard_stem(number)}.json")
        point = ResumePoint(
            shard=number + 1,
            next=tuple(manifest["next"]),
            row_start=tuple(manifest["row_start"]),
            samples=point.samples + manifest["samples"],
            tokens=point.tokens + manifest["tokens"],
            done=bool(manifest["final"]),
        )
    return point

