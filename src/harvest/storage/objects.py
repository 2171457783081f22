"""What GCS and S3 share: reads, listings and deletes through their fsspec filesystem (gcsfs, s3fs).
Writes, and the version token conditional writes compare, are each protocol's own (gcs.py, s3.py)."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from harvest.storage.backend import Backend, Buffer, Upload, Versioned


class ObjectBackend(Backend):
    """An object store behind an fsspec filesystem. Subclasses give `filesystem()`, `token_key` (the
    field of `fs.info` that names the version) and the writes."""

    token_key = ""

    @property
    def writes_in_flight(self) -> int:
        """Twice the cores, at least 4: an upload waits on the wire and the server more than on a core (each
        holds its shard in memory until its reply)."""
        return max(4, 2 * len(os.sched_getaffinity(0)))

    @property
    def fs(self) -> Any:
        """The filesystem, looked up on every use: one per process and endpoint (see filesystems.py)."""
        return self.filesystem()

    def filesystem(self) -> Any:
        raise NotImplementedError

    def read(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(path, start=start, end=end)

    def read_versioned(self, path: str) -> Versioned:
        fs = self.fs
        fs.invalidate_cache()
        token = str(fs.info(path)[self.token_key])
        return Versioned(fs.cat_file(path), token)

    def size(self, path: str) -> int:
        fs = self.fs
        fs.invalidate_cache()  # see other processes' writes
        return int(fs.info(path)["size"])

    def exists(self, path: str) -> bool:
        fs = self.fs
        fs.invalidate_cache()
        try:
            fs.info(path)
            return True
        except FileNotFoundError:
            return False

    def listdir(self, path: str) -> list[str]:
        fs = self.fs
        fs.invalidate_cache()
        here = path.rstrip("/")
        try:
            entries = fs.ls(here, detail=True)
        except FileNotFoundError:
            return []
        names = set()
        for entry in entries:
            name = entry["name"].rstrip("/")
            if name == here or not name.startswith(here + "/"):
                continue  # `here` is a file, or a placeholder object for the directory itself
            names.add(name[len(here) + 1:].split("/", 1)[0])
        return [n for n in names if n]

    def find(self, path: str) -> list[str]:
        fs = self.fs
        fs.invalidate_cache()
        here = path.rstrip("/")
        return [n for n in fs.find(here) if n == here or n.startswith(here + "/")]

    def open_read(self, path: str, pos: int) -> Any:
        f = self.fs.open(path, "rb", block_size=8 * 2**20, cache_type="readahead")
        if pos:
            f.seek(pos)
        return f

    def open_write(self, path: str) -> Upload:
        """A resumable (GCS) or multipart (S3) upload, finalised at commit."""
        return _FileUpload(self.fs.open(path, "wb"))

    def delete(self, paths: list[str]) -> None:
        """In batched requests (S3: 1,000 names a request; GCS: 100). fsspec's batched `rm` expands glob
        patterns, and names come from storage: one with a glob character (`*?[`) is deleted on its own, as
        the literal name it is."""
        # imported here, with the filesystem: a local run never imports fsspec
        from fsspec.asyn import has_magic

        fs = self.fs
        fs.invalidate_cache()
        singles: list[str] = []
        batched: list[str] = []
        for name in paths:
            (singles if len(paths) == 1 or has_magic(name) else batched).append(name)
        for name in singles:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(name)
        if batched:
            with contextlib.suppress(FileNotFoundError):  # gcsfs, when none of them was there
                fs.rm(batched)
        fs.invalidate_cache()


def byte_views(parts: list[Buffer]) -> list[memoryview]:
    """The parts as flat byte views (no copy): what a streamed request body is cut from."""
    return [memoryview(p).cast("B") for p in parts]


def joined(parts: list[Buffer]) -> bytes:
    """The parts as one bytes object for one request (no copy when that is what was given)."""
    return parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)


class _FileUpload(Upload):
    def __init__(self, f: Any):
        self._f = f

    def write(self, data: Buffer) -> int:
        return self._f.write(data)

    def commit(self) -> None:
        self._f.close()  # the upload is finalised here

    def discard(self) -> None:
        if hasattr(self._f, "discard"):
            self._f.discard()  # an unfinished upload never becomes an object
