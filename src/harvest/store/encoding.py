"""A shard's data object as bytes: written as parts (the safetensors header, then each tensor's data straight
from its buffers), decoded, its header's harvest fields read, and its checksums taken in one pass.

Checksums, in the sidecar: `checksum` names the algorithm (xxh3_128 by default, ~20x faster than sha256, so
writing the bytes costs one write and no more; or sha256), `chunk_digests` each CHUNK_BYTES of each
tensor's bytes (the last chunk shorter), so that a reader of any rows of a tensor checks exactly the chunks it
fetched; `tensor_digests` each tensor's, the digest of its chunks' digests one after another (`of_chunks`);
`digest` the file's: the digest of the header's digest followed by each tensor's in file order. So every byte
is hashed once, and one pass gives them all (`shard_checksums`). Sidecars written before chunk digests hold
each tensor's plain digest (`shard_digests`), and those written before `checksum` existed the whole file's
sha256 (`sha256`) and each tensor's (`tensor_sha256`): they read, verify and resume as before
(harvest.store.records.Sidecar).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any

import ml_dtypes
import numpy as np
import safetensors

from harvest.store.format import FORMAT_VERSION


def shard_parts(
    activations: dict[str, np.ndarray | list[np.ndarray]],
    tokens: np.ndarray,
    lengths: np.ndarray,
    sample_ids: np.ndarray,
    variants: np.ndarray,
    metadata: dict[str, str],
) -> list[bytes | np.ndarray]:
    """A shard's bytes as parts to write one after another: the safetensors header, then each tensor's data,
    straight from the buffers it is in (no copy into one blob): an activation tensor may be given as its
    blocks of rows in order (the pieces, as views into the batches they were captured in). Byte for byte what
    `safetensors.numpy.save` writes of the whole tensors (tests hold them equal): tensors by dtype, widest first,
    then by name; the header JSON compact and space-padded to 8 bytes."""
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    blocks = {
        **{name: [np.ascontiguousarray(b) for b in (a if isinstance(a, list) else [a])]
           for name, a in activations.items()},
        "tokens": [np.ascontiguousarray(tokens, np.int32)],
        "offsets": [offsets],
        "sample_ids": [np.ascontiguousarray(sample_ids, np.int64)],
        "variants": [np.ascontiguousarray(variants, np.int32)],
    }
    # safetensors keeps metadata in a hash map whose order varies run to run: one key keeps the bytes stable.
    fields = {"format": "harvest", "format_version": str(FORMAT_VERSION), **metadata}
    header: dict[str, Any] = {"__metadata__": {"harvest": json.dumps(fields, sort_keys=True)}}
    ordered = sorted(blocks.items(), key=lambda item: (_WRITE_ORDER[_tag(item[1][0])], item[0]))
    at = 0
    for name, parts in ordered:
        nbytes = sum(b.nbytes for b in parts)
        shape = [sum(len(b) for b in parts), *parts[0].shape[1:]]
        header[name] = {"dtype": _tag(parts[0]), "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return [struct.pack("<Q", len(text)) + text, *(b.reshape(-1).view(np.uint8) for _, parts in ordered for b in parts
                                                   if b.nbytes)]


def encode_shard(*args: Any, **kwargs: Any) -> bytes:
    """`shard_parts` joined into one bytes object (for small shards and tests)."""
    return b"".join(shard_parts(*args, **kwargs))


# safetensors dtype tags -> numpy: safetensors.numpy.load has no BF16 entry, so shards are decoded here.
ST_DTYPES = {
    "BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
    "U8": np.uint8, "U16": np.uint16, "U32": np.uint32, "U64": np.uint64, "BOOL": np.bool_,
}


_ST_TAGS = {np.dtype(v): k for k, v in ST_DTYPES.items()}
# The order safetensors lays tensors out in: its dtype enum, descending (only the dtypes shards hold).
_WRITE_ORDER = {"I64": 0, "F32": 1, "I32": 2, "BF16": 3, "F16": 4, "F8_E4M3": 5, "I8": 6}


def _tag(array: np.ndarray) -> str:
    return _ST_TAGS[array.dtype]


def decode_shard(data: bytes) -> dict[str, np.ndarray]:
    """Shard bytes -> {name: array}, bf16 included (as ml_dtypes.bfloat16). Raises ValueError if unreadable."""
    try:
        views = safetensors.deserialize(data)
    except Exception as e:  # safetensors raises its own SafetensorError for malformed headers
        raise ValueError(f"not a readable safetensors file ({e})") from None
    out = {}
    for name, view in views:
        dtype = ST_DTYPES.get(view["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} has unsupported dtype {view['dtype']}")
        out[name] = np.frombuffer(view["data"], dtype).reshape(view["shape"])
    return out


def shard_metadata(data: bytes) -> dict[str, str]:
    """The shard's own fields (format, format_version, stream, shard) from the safetensors header, as JSON."""
    _, header = _header(data)
    try:
        fields = json.loads((header.get("__metadata__") or {}).get("harvest", "{}"))
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"not a harvest shard (metadata: {e})") from None
    return fields if isinstance(fields, dict) else {}


def _header(data) -> tuple[int, dict]:
    """A whole file's safetensors header: its length and its JSON object. ValueError when it cannot be read
    within the file."""
    if len(data) < 8:
        raise ValueError("not a readable safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError("not a readable safetensors file (header length past the end)")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except ValueError as e:
        raise ValueError(f"not a readable safetensors file (header: {e})") from None
    if not isinstance(header, dict):
        raise ValueError("not a readable safetensors file (its header is not a JSON object)")
    return n, header


def tensor_parts(parts: list) -> dict[str, list]:
    """The parts of `shard_parts` grouped by the tensor they hold, from the header in the first part."""
    header = json.loads(bytes(parts[0][8:]))
    header.pop("__metadata__", None)
    spans = sorted((entry["data_offsets"], name) for name, entry in header.items())
    grouped: dict[str, list] = {name: [] for _, name in spans}
    at, k = 0, 0
    for part in parts[1:]:
        while at >= spans[k][0][1]:
            k += 1
        grouped[spans[k][1]].append(part)
        at += memoryview(part).nbytes
    return grouped


try:
    import xxhash
except ImportError:  # a host without it writes sha256 shards, and says how to read xxh3_128 ones
    xxhash = None

CHECKSUMS = ("xxh3_128", "sha256")  # what a sidecar's `checksum` may name


def default_checksum() -> str:
    """What new shards carry: xxh3_128 (~20x sha256's speed here, so the host's bytes cost one write, not a
    hash), sha256 where the xxhash package is missing."""
    return "xxh3_128" if xxhash is not None else "sha256"


def hasher(checksum: str):
    """A fresh hash object of the algorithm a sidecar names. ValueError for one this harvest cannot compute."""
    if checksum == "sha256":
        return hashlib.sha256()
    if checksum == "xxh3_128":
        if xxhash is None:
            raise ValueError("its checksum is xxh3_128, which needs the xxhash package: pip install xxhash==4.1.0")
        return xxhash.xxh3_128()
    raise ValueError(f"unknown checksum {checksum!r} (this harvest knows {', '.join(CHECKSUMS)}); upgrade harvest")


def digest(data: bytes | np.ndarray | list, checksum: str) -> str:
    """Hex digest of bytes (or one array's), or of parts written one after another."""
    h = hasher(checksum)
    for part in [data] if isinstance(data, (bytes, bytearray, memoryview, np.ndarray)) else data:
        h.update(part)
    return h.hexdigest()


def file_parts(data) -> list:
    """A whole shard file's bytes as `shard_parts` gives them: its header, then each tensor's non-empty bytes in
    file order (views, no copy). ValueError when the header cannot be read."""
    view = memoryview(data).cast("B")
    n, header = _header(view)
    header.pop("__metadata__", None)
    try:
        spans = sorted((int(e["data_offsets"][0]), int(e["data_offsets"][1])) for e in header.values())
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"not a readable safetensors header ({e})") from None
    if any(not 0 <= a <= b <= len(view) - 8 - n for a, b in spans):
        raise ValueError("not a readable safetensors file (a tensor lies past the end)")
    return [view[:8 + n], *(view[8 + n + a : 8 + n + b] for a, b in spans if b > a)]


def tensor_digests(parts: list, checksum: str) -> dict[str, str]:
    """Each tensor's digest from a shard's parts (`shard_parts`, or `file_parts` of a whole file), in file order."""
    return {name: digest(blocks, checksum) for name, blocks in tensor_parts(parts).items()}


def file_digest(parts: list, tensors: dict[str, str], checksum: str) -> str:
    """The file's checksum without a second pass over its data: the digest of the header's digest followed by
    each tensor's (`tensors`, in file order). It covers every byte: the data is the tensors back to back, as the
    header says (safetensors refuses a file with gaps, and a sidecar records the file's size)."""
    h = hasher(checksum)
    for d in [digest(parts[0], checksum), *tensors.values()]:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def shard_digests(parts: list, checksum: str) -> tuple[str, dict[str, str]]:
    """(the file's digest, {tensor: digest}) in one pass over a shard's bytes (`shard_parts` or `file_parts`)."""
    tensors = tensor_digests(parts, checksum)
    return file_digest(parts, tensors, checksum), tensors


CHUNK_BYTES = 2**20  # a tensor's bytes are checksummed per chunk of this size too (a reader fetches whole chunks)


def tensor_checksums(blocks: list, checksum: str, chunk_bytes: int) -> tuple[str, list[str]]:
    """A tensor's digest and its chunks' (each `chunk_bytes` of its bytes, the last one shorter), hashing each
    byte once: the tensor's is derived from its chunks' (`of_chunks`)."""
    chunk, filled, chunks = hasher(checksum), 0, []
    for block in blocks:
        view = memoryview(block).cast("B")
        at = 0
        while at < len(view):
            part = view[at:at + chunk_bytes - filled]
            chunk.update(part)
            at, filled = at + len(part), filled + len(part)
            if filled == chunk_bytes:
                chunks.append(chunk.hexdigest())
                chunk, filled = hasher(checksum), 0
    if filled:
        chunks.append(chunk.hexdigest())
    return of_chunks(chunks, checksum), chunks


def of_chunks(chunks: list[str], checksum: str) -> str:
    """A tensor's digest from its chunks' (in a sidecar that has chunk digests): the digest of their bytes one
    after another, as the file's is of its tensors'. A tensor without bytes has no chunk: the empty digest."""
    h = hasher(checksum)
    for d in chunks:
        h.update(bytes.fromhex(d))
    return h.hexdigest()


def tensor_digest(data, checksum: str, chunk_bytes: int | None) -> str:
    """A tensor's digest from its bytes, by the rule of its sidecar: of its chunks' digests where the sidecar has
    chunk digests of `chunk_bytes`, else (an older sidecar; None) the plain digest of the bytes."""
    if chunk_bytes is None:
        return digest(data, checksum)
    return tensor_checksums([data], checksum, chunk_bytes)[0]


def chunk_digests(data, checksum: str, chunk_bytes: int) -> list[str]:
    """The digests of consecutive `chunk_bytes` of `data` (bytes, a memoryview or an array's), the last shorter."""
    view = memoryview(data).cast("B")
    return [digest(view[at:at + chunk_bytes], checksum) for at in range(0, len(view), chunk_bytes)]


def shard_checksums(parts: list, checksum: str, chunk_bytes: int
                    ) -> tuple[str, dict[str, str], dict[str, list[str]]]:
    """(the file's digest, {tensor: digest}, {tensor: [chunk digests]}) in one pass over a shard's bytes."""
    sums = {name: tensor_checksums(blocks, checksum, chunk_bytes) for name, blocks in tensor_parts(parts).items()}
    tensors = {name: whole for name, (whole, _) in sums.items()}
    return file_digest(parts, tensors, checksum), tensors, {name: chunks for name, (_, chunks) in sums.items()}
