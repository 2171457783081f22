"""A shard's data object as bytes on storage: where each tensor lies (its safetensors header), and its digests.

A safetensors file is `u64 n | n bytes of JSON header | data`; the header gives each tensor's dtype, shape
and [begin, end) within the data. Tensors are row-major, so rows [lo, hi) of a [n_tokens, d] tensor are
one contiguous byte range, and a tensor's bytes can be hashed without reading the rest of the file.
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import struct

import numpy as np

from harvest.storage import Storage
from harvest.store import encoding

HEAD_GUESS = 16 * 1024  # first read: the header of a shard with dozens of tensors fits; else a second read
HASH_CHUNK = 8 * 2**20  # bytes fetched at a time when hashing a remote range: memory stays bounded


@dataclasses.dataclass(frozen=True)
class TensorSpan:
    """One tensor of a shard: its dtype, shape and absolute byte range in the file."""

    dtype: np.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize

    def rows(self, lo: int, hi: int) -> tuple[int, int]:
        """The byte range of rows [lo, hi)."""
        return self.start + lo * self.row_bytes, self.start + hi * self.row_bytes


@dataclasses.dataclass(frozen=True)
class ShardLayout:
    """A shard's tensors and the fields harvest put in its header (stream, shard, format_version)."""

    tensors: dict[str, TensorSpan]
    fields: dict[str, str]
    size: int  # the file's length as the header describes it


def parse_header(head: bytes) -> int | ShardLayout:
    """The layout from the first bytes of a file, or how many bytes are needed when `head` is too short.
    Raises ValueError when the bytes are not a safetensors header."""
    if len(head) < 8:
        raise ValueError("not a readable safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", head[:8])
    if n > 100 * 2**20:
        raise ValueError(f"not a readable safetensors file (header length {n})")
    if len(head) < 8 + n:
        return 8 + n
    try:
        header = json.loads(bytes(head[8:8 + n]))
        meta = header.pop("__metadata__", None) or {}
        fields = json.loads(meta.get("harvest", "{}"))
        tensors = {}
        for name, entry in header.items():
            dtype = encoding.ST_DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"tensor {name!r} has unsupported dtype {entry['dtype']}")
            begin, end = (int(x) for x in entry["data_offsets"])
            span = TensorSpan(np.dtype(dtype), tuple(int(s) for s in entry["shape"]), 8 + n + begin, 8 + n + end)
            if span.end - span.start != int(np.prod(span.shape, dtype=np.int64)) * span.dtype.itemsize:
                raise ValueError(f"tensor {name!r}: its byte range does not fit its shape {list(span.shape)}")
            tensors[name] = span
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"not a readable safetensors header ({e})") from None
    size = max((s.end for s in tensors.values()), default=8 + n)
    return ShardLayout(tensors, fields if isinstance(fields, dict) else {}, size)


def read_layout(storage: Storage, rel: str) -> ShardLayout:
    """The header of one shard: one ranged read (two when the header is longer than HEAD_GUESS)."""
    head = storage.read_range(rel, 0, HEAD_GUESS)
    parsed = parse_header(head)
    if isinstance(parsed, int):
        parsed = parse_header(storage.read_range(rel, 0, parsed))
    if isinstance(parsed, int):
        raise ValueError("not a readable safetensors file (shorter than its header)")
    return parsed


def map_file(path: str) -> mmap.mmap:
    """A local file mapped read-only: its pages come from the page cache, copied once, where they are used.
    Committed data objects are never rewritten (each writer has its own names), so a map stays valid."""
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            raise ValueError("the file is empty")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def file_digest(storage: Storage, rel: str, checksum: str) -> str:
    """A whole file's plain digest (an older sidecar's sha256), streamed (locally from a memory map, no copy)."""
    if storage.is_local:
        return encoding.digest(map_file(storage.path(rel)), checksum)
    digest = encoding.hasher(checksum)
    with storage.open_binary(rel) as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def range_digest(storage: Storage, rel: str, start: int, end: int, checksum: str) -> str:
    """The digest of bytes [start, end) of a file: ranged reads of HASH_CHUNK (locally a memory map).
    ValueError if the file ends before `end`."""
    if storage.is_local:
        buf = map_file(storage.path(rel))
        if end > len(buf):
            raise ValueError(f"the file ends {end - len(buf)} bytes short of what its header describes")
        return encoding.digest(memoryview(buf)[start:end], checksum)
    digest = encoding.hasher(checksum)
    for at in range(start, end, HASH_CHUNK):
        want = min(at + HASH_CHUNK, end) - at
        chunk = storage.read_range(rel, at, at + want)
        if len(chunk) != want:
            raise ValueError(f"the file ends {end - at - len(chunk)} bytes short of what its header describes")
        digest.update(chunk)
    return digest.hexdigest()
