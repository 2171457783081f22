"""The backend protocol: the raw operations one kind of store (local disk, GCS, S3, a test's in-memory store)
gives `Storage`, which adds URLs, retries, one-line errors and the lost-reply logic on top. Subclassing `Backend`
gives the optional methods, built on the eight required ones. A backend never retries and never caches; its
exceptions say what happened: FileNotFoundError, PreconditionFailed (a conditional write refused, nothing
written), a transient error (outcome unknown: Storage retries and reads back), or anything else (permanent)."""

from __future__ import annotations

import dataclasses
import io
import os
from typing import Any

Buffer = Any  # anything with the buffer protocol: bytes, memoryview, a contiguous numpy array


@dataclasses.dataclass(frozen=True)
class Versioned:
    """An object's bytes and its version token (local: sha256; GCS: generation; S3: ETag)."""

    data: bytes
    token: str


class Backend:
    """The operations Storage needs from a store. The first eight are required."""

    def read(self, path: str) -> bytes:
        raise NotImplementedError

    def read_versioned(self, path: str) -> Versioned:
        """The bytes and the token `replace` compares against. The token is read first: when the object
        changes in between, the token is the older one and a replace with it fails, the safe side."""
        raise NotImplementedError

    def write(self, path: str, parts: list[Buffer]) -> None:
        """Write the object whole (the parts one after another): readers see the old bytes or the new."""
        raise NotImplementedError

    def create(self, path: str, data: bytes) -> None:
        """Write the object only if absent, atomically; PreconditionFailed if it exists."""
        raise NotImplementedError

    def replace(self, path: str, data: bytes, token: str) -> None:
        """Write the object only if it is still the version `token` names, atomically; PreconditionFailed
        if it changed or is gone."""
        raise NotImplementedError

    def listdir(self, path: str) -> list[str]:
        """Names directly under `path` (files and directories), any order; [] if there are none."""
        raise NotImplementedError

    def find(self, path: str) -> list[str]:
        """Every object at `path` or under `path/` (full paths); [] if none."""
        raise NotImplementedError

    def delete(self, paths: list[str]) -> None:
        """Delete these objects; missing ones are fine."""
        raise NotImplementedError

    # --- optional: defaults over the operations above ------------------------------------------------

    @property
    def writes_in_flight(self) -> int:
        """How many objects a writer should keep in flight: a disk gains nothing past one per core, and two
        overlap one write's fsync with the next (an object store says more: its requests wait on the wire)."""
        return max(2, len(os.sched_getaffinity(0)))

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes [start, end) (shorter at the end of the object)."""
        return self.read(path)[start:end]

    def size(self, path: str) -> int:
        return len(self.read(path))

    def exists(self, path: str) -> bool:
        """An object at `path`, or a directory (objects under `path/`)."""
        return bool(self.find(path))

    def open_read(self, path: str, pos: int) -> Any:
        """A binary file positioned at `pos`, for streaming (Storage reopens it after a transient error)."""
        f = io.BytesIO(self.read(path))
        f.seek(pos)
        return f

    def open_write(self, path: str) -> Upload:
        """An upload to stream an object into; it lands whole at `commit()`, and never after `discard()`."""
        return _BufferedUpload(self, path)

    def delete_tree(self, path: str) -> None:
        """Delete `path` and everything under it; what is missing is fine."""
        self.delete(self.find(path))

    def remove_stale_temps(self, path: str, of: str | None = None) -> list[str]:
        """Delete what writes cut short left directly under `path` (only local files leave anything); `of`: see
        Storage.remove_stale_temps."""
        return []


class Upload:
    """A write in progress (from `Backend.open_write`): `write` parts, then `commit` or `discard`."""

    def write(self, data: Buffer) -> int:
        raise NotImplementedError

    def commit(self) -> None:
        raise NotImplementedError

    def discard(self) -> None:
        raise NotImplementedError


class _BufferedUpload(Upload):
    """Parts kept in memory and written with one `Backend.write` at commit."""

    def __init__(self, backend: Backend, path: str):
        self._backend, self._path, self._parts = backend, path, []

    def write(self, data: Buffer) -> int:
        self._parts.append(bytes(data))
        return len(self._parts[-1])

    def commit(self) -> None:
        self._backend.write(self._path, self._parts)

    def discard(self) -> None:
        self._parts = []
