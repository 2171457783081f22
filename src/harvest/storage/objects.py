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
        """Twice the cores, 4 to 32: an upload waits on the wire and the server more than on a core. Each holds
        its shard in memory until its reply: 32 shards of 256 MB are 8 GB, and 32 streams (S3: times 8 parts)
        fill a 100 Gbps NIC at 0.4 GB/s each."""
        return min(32, max(4, 2 * len(os.sched_getaffinity(0))))

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


class PartsBody:
    """A request body read straight from the caller's parts, never joined nor copied: aiohttp streams it (async
    iteration, CHUNK bytes at a time, the request giving its Content-Length), botocore reads it once for its
    checksum (read, seek, tell, len). aiohttp's own payloads for one buffer copy it once or twice on the way to
    the socket (a BytesIO unshared, a transport buffer), which was most of the client's cost per byte."""

    CHUNK = 2**20  # bytes handed to the socket at a time: the event loop copies only what the socket refuses

    def __init__(self, parts: list[Buffer], start: int = 0, end: int | None = None):
        """Bytes [start, end) of the parts laid end to end (all of them by default)."""
        self._views: list[memoryview] = []
        at = 0
        for view in (memoryview(p).cast("B") for p in parts):
            lo, hi = max(start, at), view.nbytes + at if end is None else min(end, at + view.nbytes)
            if lo < hi:
                self._views.append(view[lo - at:hi - at])
            at += view.nbytes
        self._size = sum(v.nbytes for v in self._views)
        self._pos = 0
        self.seek(0)

    def __len__(self) -> int:
        return self._size

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = min(max(0, (0, self._pos, self._size)[whence] + offset), self._size)
        self._index, self._at = 0, 0  # the view the position falls in, and where that view starts
        while self._index < len(self._views) and self._at + self._views[self._index].nbytes <= self._pos:
            self._at += self._views[self._index].nbytes
            self._index += 1
        return self._pos

    def read(self, n: int = -1) -> memoryview | bytes:
        """Up to `n` bytes from the position (fewer at the end of a part), as a view: b'' at the end. A shard
        may come in a thousand parts: each read starts where the last one ended, no scan from the first."""
        if self._index >= len(self._views):
            return b""
        view = self._views[self._index]
        lo = self._pos - self._at
        hi = view.nbytes if n is None or n < 0 else min(view.nbytes, lo + n)
        self._pos += hi - lo
        if hi == view.nbytes:
            self._index, self._at = self._index + 1, self._at + view.nbytes
        return view[lo:hi]

    def __aiter__(self):
        return self._chunks()

    async def _chunks(self):
        self.seek(0)
        while chunk := self.read(self.CHUNK):
            yield chunk


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
