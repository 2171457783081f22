"""A shard's bytes as token batches fetch them: rows of a tensor as one ranged read (or a view of the mapped
local file), the header checked against the sidecar and run.json, and the bytes checked against checksums:
with the sidecar's chunk digests, the chunks holding the rows served (`checked_rows`: the range fetched is
widened to whole chunks, at most two chunks more per tensor and piece); without them, whole tensors or the
whole file (`verify_bytes`, `verify_fetched`). `checked_offsets` reads a shard's offsets, sample ids and
variants whole, each checked against its digest and the sidecar's counts.

Where tensors lie, and whole-file or range hashing, are harvest.read.shardfile's.
"""

from __future__ import annotations

import mmap

import numpy as np

from harvest.storage import Storage
from harvest.store import encoding, quant
from harvest.store.listing import SHARD_ARRAYS
from harvest.store.records import Sidecar
from harvest.read.shardfile import ShardLayout, TensorSpan, file_digest, range_digest, read_layout


def fetch(storage: Storage, rel: str, start: int, end: int, buf=None):
    """Bytes [start, end) of a shard file, as one ranged read (or a view of `buf`, the mapped local file, when
    given). ValueError if the file is cut short."""
    data = b"" if end <= start else storage.read_range(rel, start, end) if buf is None else memoryview(buf)[start:end]
    if len(data) != end - start:
        raise ValueError(f"the file ends {end - start - len(data)} bytes short of what its header describes")
    return data


def read_rows(storage: Storage, rel: str, span: TensorSpan, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) of one tensor, fetched as one ranged read. ValueError if the file is cut short."""
    return np.frombuffer(fetch(storage, rel, *span.rows(lo, hi)), span.dtype).reshape((hi - lo, *span.shape[1:]))


def checked_rows(storage: Storage, rel: str, span: TensorSpan, lo: int, hi: int, sidecar: Sidecar, name: str,
                 buf=None) -> tuple[np.ndarray, int]:
    """(rows [lo, hi) of tensor `name`, bytes hashed): the whole chunks holding them fetched (from `buf`, a
    mapped local file, when given) and checked against the sidecar's chunk digests. ValueError naming the
    chunk that does not match, or when the file is cut short."""
    size, want = sidecar.chunk_bytes, sidecar.chunk_digests.get(name)
    start, end = span.rows(lo, hi)
    first, last = (start - span.start) // size, -(-(end - span.start) // size)
    at, until = span.start + first * size, min(span.start + last * size, span.end)
    if want is None or len(want) != -(-(span.end - span.start) // size):
        raise ValueError(f"its sidecar has no {sidecar.algorithm} for each {size} bytes of tensor {name!r}")
    data = fetch(storage, rel, at, until, buf)
    got = encoding.chunk_digests(data, sidecar.algorithm, size)
    for k, (mine, theirs) in enumerate(zip(got, want[first:last])):
        if mine != theirs:
            raise ValueError(f"bytes {at + k * size}-{min(at + (k + 1) * size, until)} (chunk {first + k} of tensor "
                             f"{name!r}) do not match their {sidecar.algorithm} in the sidecar ({theirs[:12]}...)")
    count = (hi - lo) * (span.row_bytes // span.dtype.itemsize)
    rows = np.frombuffer(data, span.dtype, count=count, offset=start - at).reshape((hi - lo, *span.shape[1:]))
    return rows, until - at


def checked_offsets(storage: Storage, rel: str, layout: ShardLayout, sidecar: Sidecar, check: bool) -> np.ndarray:
    """The shard's offsets, after its offsets, sample ids and variants are read whole and checked: their shapes
    against the sidecar's counts, their bytes against its digests (`check`), and the offsets cutting its tokens
    into samples. ValueError naming what does not match."""
    small = {}
    for name in SHARD_ARRAYS[1:]:
        span, want = layout.tensors.get(name), (sidecar.samples + (name == "offsets"),)
        if span is None or span.shape != want:
            raise ValueError(f"tensor {name!r} is {'missing' if span is None else list(span.shape)}, "
                             f"the sidecar says {list(want)}")
        small[name] = small_tensor(storage, rel, span, sidecar, name, check)
    offsets = small["offsets"]
    if offsets[0] != 0 or offsets[-1] != sidecar.tokens or np.any(np.diff(offsets) < 0):
        raise ValueError(f"its offsets do not cut its {sidecar.tokens} tokens into samples")
    return offsets


def small_tensor(storage: Storage, rel: str, span: TensorSpan, sidecar: Sidecar, name: str, check: bool) -> np.ndarray:
    """A small tensor (offsets, sample ids, variants) read whole, checked against its digest in the sidecar
    when `check` and the sidecar has one (an older one may hold the whole file's only)."""
    data = fetch(storage, rel, span.start, span.end)
    if check and sidecar.tensor_digests is not None and sidecar.tensor_digest(data) != (
            want := _wanted(sidecar, name)):
        raise ValueError(f"the bytes of tensor {name!r} do not match their {sidecar.algorithm} in the sidecar "
                         f"({want[:12]}...)")
    return np.frombuffer(data, span.dtype).reshape(span.shape)


def rows_of(buf, span: TensorSpan, lo: int, hi: int) -> np.ndarray:
    """Rows [lo, hi) of one tensor of a whole file held in `buf` (bytes or a memory map), without a copy."""
    start, end = span.rows(lo, hi)
    if end > len(buf):
        raise ValueError(f"the file ends {end - len(buf)} bytes short of what its header describes")
    count = (hi - lo) * (span.row_bytes // span.dtype.itemsize)
    return np.frombuffer(buf, span.dtype, count=count, offset=start).reshape((hi - lo, *span.shape[1:]))


def prefault(arr: np.ndarray) -> None:
    """Touch one byte per page of a mapped array, so the reading thread, not the consumer, waits for the disk."""
    if arr.size:
        int(arr.reshape(-1).view(np.uint8)[::mmap.PAGESIZE].sum())


def checked_layout(storage: Storage, rel: str, sidecar: Sidecar, widths: dict[str, int], stored: np.dtype,
                   dtype_name: str) -> ShardLayout:
    """The shard's header, checked: it names this shard, describes the sidecar's byte count, and holds
    `tokens` and each tensor of `widths` with the sidecar's token count, run.json's width and dtype; the
    file has the sidecar's length. Raises ValueError naming what does not match."""
    layout = read_layout(storage, rel)
    fields, tokens = layout.fields, sidecar.tokens
    if (fields.get("stream"), fields.get("shard")) != (str(sidecar.stream), str(sidecar.shard)):
        raise ValueError(f"its header names stream {fields.get('stream')} shard {fields.get('shard')}")
    if layout.size != sidecar.bytes:
        raise ValueError(f"its header describes {layout.size} bytes, its sidecar {sidecar.bytes}")
    for k in ("tokens", *widths):
        span = layout.tensors.get(k)
        want = (tokens,) if k == "tokens" else (tokens, widths[k])
        if span is None or span.shape != want:
            raise ValueError(f"tensor {k!r} is {'missing' if span is None else list(span.shape)}, "
                             f"the sidecar and run.json say {list(want)}")
        if k != "tokens" and span.dtype != stored:
            raise ValueError(f"tensor {k!r} is {span.dtype}, run.json says {dtype_name}")
        if k != "tokens" and quant.is_quantized(dtype_name):
            scale = layout.tensors.get(quant.scale_name(k))
            if scale is None or scale.shape != (tokens,) or scale.dtype != np.float32:
                raise ValueError(f"tensor {quant.scale_name(k)!r} is "
                                 f"{'missing' if scale is None else f'{scale.dtype}{list(scale.shape)}'}, "
                                 f"its codes need float32[{tokens}]")
    size = storage.size(rel)
    if size != sidecar.bytes:
        raise ValueError(f"the file is {size} bytes, its sidecar says {sidecar.bytes} (cut short or replaced)")
    return layout


def verify_bytes(storage: Storage, rel: str, layout: ShardLayout, sidecar: Sidecar, names: list[str]) -> int:
    """Check the bytes of the tensors `names` against the sidecar's per-tensor digests, or, in a sidecar
    written before harvest recorded those, the whole file against its sha256. Returns the bytes hashed;
    raises ValueError naming what does not match."""
    algorithm = sidecar.algorithm
    if sidecar.tensor_digests is None:
        if file_digest(storage, rel, algorithm) != sidecar.digest:
            raise ValueError(f"its {algorithm} does not match its sidecar's ({sidecar.digest[:12]}...)")
        return sidecar.bytes
    hashed = 0
    for name in names:
        want = _wanted(sidecar, name)
        span = layout.tensors[name]
        if range_digest(storage, rel, span.start, span.end, algorithm) != want:
            raise ValueError(f"the bytes of tensor {name!r} do not match their {algorithm} in the sidecar "
                             f"({want[:12]}...)")
        hashed += span.end - span.start
    return hashed


def verify_fetched(cols: dict[str, np.ndarray], sidecar: Sidecar) -> int:
    """Check whole tensors as fetched (a piece that is a whole shard) against the sidecar's per-tensor digests.
    Returns the bytes hashed; raises ValueError naming a tensor that does not match."""
    hashed = 0
    for name, arr in cols.items():
        want = _wanted(sidecar, name)
        data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)  # bf16 has no buffer format: hash its bytes
        if sidecar.tensor_digest(data) != want:
            raise ValueError(f"the bytes of tensor {name!r} do not match their {sidecar.algorithm} in the sidecar "
                             f"({want[:12]}...)")
        hashed += data.nbytes
    return hashed


def _wanted(sidecar: Sidecar, name: str) -> str:
    want = (sidecar.tensor_digests or {}).get(name)
    if not isinstance(want, str):
        raise ValueError(f"its sidecar has no {sidecar.algorithm} for tensor {name!r}")
    return want
