"""Reading back what is committed: where each stream resumes."""

from __future__ import annotations

import re

from harvest.errors import UserError
from harvest.store import format as fmt
from harvest.store.fs import Storage
from harvest.store.records import Sidecar
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
        rel = f"{directory}/{fmt.shard_stem(number)}.json"
        try:
            manifest = Sidecar.from_bytes(storage.read_bytes(rel))
        except ValueError as e:
            raise UserError(f"{storage.url_of(rel)}: not a harvest sidecar ({e}); `harvest verify` shows what "
                            "else is wrong, and deleting it makes the shard be rewritten") from None
        point = ResumePoint(shard=number + 1, next=manifest.next, row_start=manifest.row_start,
                            samples=point.samples + manifest.samples, tokens=point.tokens + manifest.tokens,
                            done=manifest.final)
    return point

