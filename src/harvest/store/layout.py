"""Where each tensor of a shard lies, from its safetensors header, so a reader fetches only the bytes it uses.

A safetensors file is `u64 n | n bytes of JSON header | data`; the header gives each tensor's dtype, shape
and [begin, end) within the data. Tensors are row-major, so rows [lo, hi) of a [n_tokens, d] tensor are
one contiguous byte range: a piece of a shard costs one ranged read per tensor asked for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import mmap
import struct

import numpy as np

from harvest.store import format as fmt
from harvest.storage import Storage

HEAD_GUESS = 16 * 1024  # first read: the header of a shard with dozens of tensors fits; else a second read


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
            dtype = fmt.ST_DTYPES.get(entry["dtype"])
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


def read_rows(storage: Storage, rel: str, span: TensorSpan, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) of one tensor, fetched as one ranged read. ValueError if the file is cut short."""
    start, end = span.rows(lo, hi)
    data = storage.read_range(rel, start, end) if end > start else b""
    if len(data) != end - start:
        raise ValueError(f"the file ends {end - start - len(data)} bytes short of what its header describes")
    return np.frombuffer(data, span.dtype).reshape((hi - lo, *span.shape[1:]))


def rows_of(buf, span: TensorSpan, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) of one tensor of a whole file held in `buf` (bytes or a memory map), without a copy."""
    start, end = span.rows(lo, hi)
    if end > len(buf):
        raise ValueError(f"the file ends {end - len(buf)} bytes short of what its header describes")
    count = (hi - lo) * (span.row_bytes // span.dtype.itemsize)
    return np.frombuffer(buf, span.dtype, count=count, offset=start).reshape((hi - lo, *span.shape[1:]))


def map_file(path: str) -> mmap.mmap:
    """A local file mapped read-only: its pages come from the page cache, copied once, where they are used.
    Committed shards are never rewritten in place (writes are temp file + rename), so a map stays valid."""
    with open(path, "rb") as f:
        if f.seek(0, 2) == 0:
            raise ValueError("the file is empty")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def prefault(arr: np.ndarray) -> None:
    """Touch one byte per page of a mapped array, so the reading thread, not the consumer, waits for the disk."""
    if arr.size:
        int(arr.reshape(-1).view(np.uint8)[::mmap.PAGESIZE].sum())


def file_sha256(storage: Storage, rel: str) -> str:
    """A whole file's sha256, streamed (locally from a memory map, with no copy)."""
    if storage.is_local:
        return hashlib.sha256(map_file(storage.path(rel))).hexdigest()
    digest = hashlib.sha256()
    with storage.open_binary(rel) as f:
        while chunk := f.read(8 * 2**20):
            digest.update(chunk)
    return digest.hexdigest()
