"""bench/host.py's floor: the work no host stage can skip, one checksum pass and one write (+ fsync) of every
byte, done as a plain program would, on the same shards' bytes in the same run (a thread per core hashing,
one per core writing the hashed shards, so that hashing goes on while a write waits on storage)."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
import zlib
from pathlib import Path

from harvest.store import encoding


def write_file(path: Path, parts: list) -> None:
    """One write of every byte and an fsync (what the floor counts; the job's local backend does the same)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def floor(shards_parts: list, directory: Path, hasher, threads: int, keep: bool) -> float:
    """Seconds to checksum (one pass) and write (+ fsync) every shard's bytes: `threads` threads hashing shards
    and `threads` writing the hashed ones. `keep`: leave the files (else each is deleted once written)."""
    todo: queue.Queue = queue.Queue()
    hashed: queue.Queue = queue.Queue()
    for k, parts in enumerate(shards_parts):
        todo.put((k, parts))

    def hash_all():
        while True:
            try:
                k, parts = todo.get_nowait()
            except queue.Empty:
                return
            digest = hasher()
            for part in parts:
                digest.update(part)
            hashed.put((k, parts))

    def write_all():
        while (item := hashed.get()) is not None:
            path = directory / f"floor_{item[0]}.bin"
            write_file(path, item[1])
            if not keep:
                path.unlink()

    t = time.perf_counter()
    hashers = [threading.Thread(target=hash_all) for _ in range(threads)]
    writers = [threading.Thread(target=write_all) for _ in range(threads)]
    for w in hashers + writers:
        w.start()
    for w in hashers:
        w.join()
    for _ in writers:
        hashed.put(None)
    for w in writers:
        w.join()
    return time.perf_counter() - t


class NoHash:
    """The write-only floor's checksum: none."""

    def update(self, data) -> None:
        pass


class Crc32:
    """zlib's crc32 (a different polynomial from crc32c, about as fast in software), for comparison."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)


class WithChunks:
    """xxh3_128 of each 1 MiB of the bytes and the tensor's digest derived from them, as a sidecar holds them
    (encoding.tensor_checksums): one hash a byte, in chunks. The format's own floor, beside the plain one pass."""

    def update(self, data) -> None:
        encoding.tensor_checksums([data], "xxh3_128", encoding.CHUNK_BYTES)


def checksums() -> dict:
    """The checksums a sidecar may name (encoding.CHECKSUMS), and zlib's crc32 and blake3 (where installed) for
    comparison."""
    out = {"sha256": hashlib.sha256, "xxh3_128": lambda: encoding.hasher("xxh3_128"), "crc32 (zlib)": Crc32}
    try:
        import blake3
        out["blake3"] = blake3.blake3
    except ImportError:
        pass
    return out
