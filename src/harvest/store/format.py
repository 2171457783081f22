"""The output format: every name and pattern of a run's files (made and parsed here only), shard tensors,
run.json, and exactly mergeable stats. The sidecar, progress and lease records are typed in harvest.store.records.

```
OUT/run.json                                       what the run is (model, points, dtypes, config, hash)
OUT/stream_00003/shard_000012-ATTEMPT.safetensors  {point}.{layer} [n_tokens, d] (and {point}.{layer}.scale
                                                   [n_tokens] float32 when stored as 8-bit codes), tokens
                                                   [n_tokens] int32, offsets [n+1] int64, sample_ids [n] int64,
                                                   variants [n] int32
OUT/stream_00003/shard_000012.json                 the commit marker: written after the data; without it the
                                                   shard does not exist
OUT/stream_00003/progress.json                     for `harvest status`; never read for correctness
OUT/stream_00003/lease.json                        who writes this stream, and its generation
OUT/stream_00003/gen_GENERATION/shard_...          a stream's shards after an --overwrite: each wipe starts a
                                                   generation of its own (named in lease.json), whose sidecars
                                                   and data objects lie in their own directory
```
A stream is a sequence of *pieces*: (index, variant), index = the record's line in the stream,
variant = which of the pieces a record gave (ARC augmentations, chunks of a long text). A shard
holds a contiguous run of one stream's pieces; its sidecar records `start`/`next` (positions) and
`row_start`, the position where the packed row holding `next` begins, from which a resume re-packs.

Checksums, in the sidecar: `checksum` names the algorithm (xxh3_128 by default, ~20x faster than sha256, so
writing the bytes costs one write and no more; or sha256), `tensor_digests` each tensor's bytes (a ranged read
checks what it fetched), `digest` the file's: the digest of the header's digest followed by each tensor's in
file order, so one pass over the bytes gives them all (`shard_digests`). Sidecars written before `checksum`
existed hold the whole file's sha256 (`sha256`) and each tensor's (`tensor_sha256`): they read, verify and
resume as before (harvest.store.records.Sidecar).

run.json: {format_version, harvest_version, model: {source, model_type, config_sha256, num_layers,
hidden_size, intermediate_size}, tokenizer_sha256, points: [[point, [layers]]], tensors: {name: width},
special_token_ids (left out of SAE batches), dtype, compute_dtype, quantization (int8 and
float8_e4m3fn: {scheme, scale_dtype}; harvest.store.quant), max_seq_len, long, format, data: {source,
num_streams, counts (null when unknown)}, config (every setting), config_sha256}.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import struct
from typing import Any

import ml_dtypes  # noqa: F401  (numpy learns bfloat16)
import numpy as np
import safetensors

from harvest.store import quant

FORMAT_VERSION = 1
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}  # values as they are
STORED_DTYPES = {**DTYPES, **quant.CODES}  # what a run may store: values, or 8-bit codes with per-token scales


RUN_JSON = "run.json"
PROGRESS = "progress.json"
LEASE = "lease.json"
STREAM_FILES = {PROGRESS, LEASE}  # in a stream directory besides data objects and sidecars

_STREAM_DIR = re.compile(r"^stream_(\d{5})$")
_SIDECAR = re.compile(r"^shard_(\d{6})\.json$")
_DATA_FILE = re.compile(r"^shard_(\d{6})(?:-([0-9a-f]{8,32}))?\.safetensors$")
_GENERATION = re.compile(r"^[0-9a-f]{16}$")
_GENERATION_DIR = re.compile(r"^gen_([0-9a-f]{16})$")


def stream_dir(stream: int) -> str:
    return f"stream_{stream:05d}"


def dir_stream(name: str) -> int | None:
    """The stream number of a stream directory's name (as `stream_dir` makes them), None for any other name."""
    m = _STREAM_DIR.match(name)
    return int(m.group(1)) if m else None


def shard_stem(shard: int) -> str:
    return f"shard_{shard:06d}"


def sidecar_name(shard: int) -> str:
    return f"{shard_stem(shard)}.json"


def sidecar_shard(name: str) -> int | None:
    """The shard number of a sidecar's name (as `sidecar_name` makes them), None for any other name."""
    m = _SIDECAR.match(name)
    return int(m.group(1)) if m else None


def is_generation(generation: str) -> bool:
    """Whether `generation` names a stream's generation: "" (the stream directory itself: never wiped, or
    written before generations existed) or 16 hex digits (harvest.store.commit.wipe)."""
    return generation == "" or bool(_GENERATION.match(generation))


def shard_dir(stream: int, generation: str = "") -> str:
    """Where a stream's sidecars and data objects of `generation` lie, relative to the run."""
    return f"{stream_dir(stream)}/gen_{generation}" if generation else stream_dir(stream)


def dir_generation(name: str) -> str | None:
    """The generation of a generation directory's name (as `shard_dir` makes them), None for any other name."""
    m = _GENERATION_DIR.match(name)
    return m.group(1) if m else None


def sidecar_path(stream: int, shard: int, generation: str = "") -> str:
    """A shard's sidecar, relative to the run."""
    return f"{shard_dir(stream, generation)}/{sidecar_name(shard)}"


def data_path(stream: int, file: str, generation: str = "") -> str:
    """A data object of a stream (`file` as a sidecar names it), relative to the run."""
    return f"{shard_dir(stream, generation)}/{file}"


def progress_path(stream: int) -> str:
    return f"{stream_dir(stream)}/{PROGRESS}"


def shard_file(shard: int, attempt: str) -> str:
    """The data object of `shard` as the attempt `attempt` writes it: no two writers ever write the same object
    (shards of runs before attempts existed are named without one)."""
    return f"{shard_stem(shard)}-{attempt}.safetensors" if attempt else f"{shard_stem(shard)}.safetensors"


def data_file_shard(name: str) -> int | None:
    """The shard number of a data object's name (as `shard_file` makes them), None for any other name."""
    m = _DATA_FILE.match(name)
    return int(m.group(1)) if m else None


def tensor_name(point: str, layer: int) -> str:
    return f"{point}.{layer}"


Position = tuple[int, int]  # a piece's place in its stream: (index of its record, variant); the one meaning of Position


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
        **{name: [np.ascontiguousarray(b) for b in (a if isinstance(a, list) else [a])] for name, a in activations.items()},
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
    if len(data) < 8:
        raise ValueError("not a readable safetensors file (shorter than its header length)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError("not a readable safetensors file (header length past the end)")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except ValueError as e:
        raise ValueError(f"not a readable safetensors file (header: {e})") from None
    try:
        fields = json.loads((header.get("__metadata__") or {}).get("harvest", "{}"))
    except ValueError as e:
        raise ValueError(f"not a harvest shard (metadata: {e})") from None
    return fields if isinstance(fields, dict) else {}


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
    shard_metadata(data)  # the header parses, within the file
    view = memoryview(data).cast("B")
    (n,) = struct.unpack("<Q", view[:8])
    try:
        header = json.loads(bytes(view[8:8 + n]))
        header.pop("__metadata__", None)
        spans = sorted((int(e["data_offsets"][0]), int(e["data_offsets"][1])) for e in header.values())
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
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


@dataclasses.dataclass
class RunningStats:
    """Per-dimension count, mean and M2 in float64 (Welford/Chan): shards merge exactly, in any order."""

    count: int
    mean: np.ndarray
    m2: np.ndarray

    CHUNK_BYTES = 2 << 20  # float64 rows converted at a time: cache-sized, measured fastest for widths 256-4096

    @classmethod
    def of(cls, values: np.ndarray) -> RunningStats:
        """Exact float64 stats of [n, d] values (the mean, then M2 around it), a chunk of rows at a time.

        Equal, bit for bit, to converting the whole tensor to float64 at once: numpy reduces over the rows of
        a C-contiguous array one row after another, and each chunk's sum starts from the running total (the
        chunk's first row of its buffer). bf16 widens to float32 by a shift of its bits (exact and cheap).
        """
        n, d = values.shape
        if n == 0:
            return cls(0, np.zeros(d), np.zeros(d))
        rows = max(1, cls.CHUNK_BYTES // (8 * d))
        total = _row_sum(values, rows, lambda chunk: None)
        mean = total / n
        return cls(n, mean, _row_sum(values, rows, lambda chunk: np.square(
            np.subtract(chunk, mean, out=chunk), out=chunk)))

    @classmethod
    def of_pieces(cls, pieces: list[np.ndarray], means: list, m2s: list) -> RunningStats:
        """Stats of the rows of `pieces` (each [n_i, d]) from each piece's own mean and M2 (float32, from the
        device: harvest.model.moments), merged in float64 in one step (Chan's formula over all pieces); a piece
        whose mean is None gets its own here, exact, from its rows. `pieces` has at least one (maybe empty) block."""
        counts = np.asarray([len(piece) for piece in pieces], np.float64)[:, None]
        n, d = int(counts.sum()), pieces[0].shape[1]
        if n == 0:
            return cls(0, np.zeros(d), np.zeros(d))
        own = [cls.of(piece) if mean is None else None for piece, mean in zip(pieces, means)]
        piece_means = np.stack([s.mean if s else mean for s, mean in zip(own, means)]).astype(np.float64)
        piece_m2s = np.stack([s.m2 if s else m2 for s, m2 in zip(own, m2s)]).astype(np.float64)
        mean = (counts * piece_means).sum(axis=0) / n
        return cls(n, mean, piece_m2s.sum(axis=0) + (counts * np.square(piece_means - mean)).sum(axis=0))

    def merge(self, other: RunningStats) -> RunningStats:
        n = self.count + other.count
        if n == 0:
            return self
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / n)
        m2 = self.m2 + other.m2 + delta**2 * (self.count * other.count / n)
        return RunningStats(n, mean, m2)

    @property
    def var(self) -> np.ndarray:
        return self.m2 / max(self.count - 1, 1)

    def share_of(self, whole: RunningStats) -> float:
        """The share of `whole`'s variance (summed over dimensions) that these rows, a subset of its rows,
        hold: their squared distance from its mean over its total."""
        total = float(np.sum(whole.m2))
        return float(np.sum(self.m2 + self.count * np.square(self.mean - whole.mean))) / total if total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"count": self.count, "mean": self.mean.tolist(), "m2": self.m2.tolist()}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> RunningStats:
        return cls(int(obj["count"]), np.asarray(obj["mean"], np.float64), np.asarray(obj["m2"], np.float64))


def _row_sum(values: np.ndarray, rows: int, transform) -> np.ndarray:
    """The float64 sum over the rows of transform(values as float64), `rows` at a time, in the order one
    reduction over the whole tensor adds them; `transform` changes a chunk in place."""
    values = np.ascontiguousarray(values)
    n, d = values.shape
    bits = values.view(np.uint16) if values.dtype == DTYPES["bfloat16"] else None
    widened = np.empty((min(rows, n), d), np.float32) if bits is not None else None
    buffer = np.empty((min(rows, n) + 1, d), np.float64)  # row 0: the running total
    total = None
    for start in range(0, n, rows):
        chunk = buffer[1 : 1 + min(rows, n - start)]
        if bits is not None:
            part = widened[: len(chunk)]
            np.left_shift(bits[start : start + len(chunk)], 16, out=part.view(np.uint32), dtype=np.uint32)
            chunk[...] = part
        else:
            chunk[...] = values[start : start + len(chunk)]
        transform(chunk)
        if total is None:
            total = chunk.sum(axis=0)
        else:
            buffer[0] = total
            total = buffer[: 1 + len(chunk)].sum(axis=0)
    return total
