"""The small records harvest keeps on storage, as typed dataclasses read and written here only.

Each has `to_json()` (a plain dict) and `from_json(obj)`, which checks every field's type and raises
ValueError naming the field: these files come from storage and are not trusted. `to_bytes`/`from_bytes`
add the canonical JSON encoding (sorted keys, UTF-8), so equal records are equal bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from datetime import datetime, timezone
from typing import Any, TypeVar

from harvest.storage import json_bytes
from harvest.store import encoding, format as fmt

R = TypeVar("R", bound="Record")


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


class Record:
    """Base of the typed records: JSON in and out, with the fields' types checked on the way in."""

    def to_json(self) -> dict[str, Any]:
        # The fields as they are (no record nests another): dataclasses.asdict deep-copies every value, ~20 ms for
        # a sidecar's stats. Callers change only the top-level dict.
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_json(cls: type[R], obj: Any) -> R:
        if not isinstance(obj, dict):
            raise ValueError(f"expected an object, got {type(obj).__name__}")
        hints = _type_hints(cls)
        values = {}
        for field in dataclasses.fields(cls):  # type: ignore[arg-type]
            if field.name not in obj:
                if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                    raise ValueError(f"missing field {field.name!r}")
                continue
            values[field.name] = _checked(field.name, obj[field.name], hints[field.name])
        return cls(**values)

    def to_bytes(self) -> bytes:
        return json_bytes(self.to_json())

    @classmethod
    def from_bytes(cls: type[R], data: bytes) -> R:
        try:
            obj = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"not valid JSON ({e})") from None
        return cls.from_json(obj)


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    """A record class's field types, resolved once (typing resolves string annotations on every call)."""
    return typing.get_type_hints(cls)


def _checked(name: str, value: Any, hint: Any) -> Any:
    """`value` if it has the type `hint` names (int, float, str, bool, list, dict, tuples of ints, unions
    with None); ValueError otherwise. JSON lists stand for tuples."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    for option in options:
        if option is type(None) and value is None:
            return None
        base = typing.get_origin(option) or option
        if base is bool and isinstance(value, bool):
            return value
        if base is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if base is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if base in (str, dict) and isinstance(value, base):
            return value
        if base is list and isinstance(value, list):
            return value
        if base is tuple and isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                                              for v in value):
            return tuple(value)
    raise ValueError(f"field {name!r}: expected {hint}, got {value!r:.80}")


@dataclasses.dataclass(frozen=True)
class LeaseRecord(Record):
    """`stream_NNNNN/lease.json`: who writes the stream, and the version that every rewrite swaps.

    `holder` is random per process: the only identity compared when a write whose reply was lost is read
    back (worker ids, hosts and pids repeat across containers). `ttl_s` is the holder's: a taker waits that
    long, on its own monotonic clock, for the version to move before it judges the lease stale.
    `process` says where the holder runs (harvest.store.lease.process_key), to prove it gone on this host.
    `heartbeat_at` is for people (`harvest status`); no decision reads it. `generation`: the stream's current
    generation, where its readers and writers find its shards (harvest.store.format.shard_dir); `ended`: the
    generations wipes ended, whose objects the next wipe deletes again (a stalled writer may still land some).
    Every rewrite of the lease carries both on; only a wipe changes them (harvest.store.commit).
    """

    worker: str
    version: int
    heartbeat_at: str  # ISO 8601, UTC, the writer's own wall clock
    holder: str = ""
    ttl_s: float = 300.0
    host: str = ""
    pid: int = 0
    process: str = ""
    released: bool = False
    generation: str = ""
    ended: list = dataclasses.field(default_factory=list)

    @classmethod
    def from_json(cls, obj: Any) -> LeaseRecord:
        return _generations_checked(super().from_json(obj))

    def describe(self) -> str:
        return f"worker {self.worker!r} on {self.host} (pid {self.pid})"


@dataclasses.dataclass(frozen=True)
class GenerationRecord(Record):
    """`stream_NNNNN/generation.json`: the stream's committed generation, the one its readers read, and the
    generations wipes ended (harvest.store.generation). Readers never read it from the lease, which a person may
    delete; a stream without one (never wiped, or written before it existed) reads its lease's, else ""."""

    generation: str = ""
    ended: list = dataclasses.field(default_factory=list)

    @classmethod
    def from_json(cls, obj: Any) -> GenerationRecord:
        return _generations_checked(super().from_json(obj))


def _generations_checked(record: R) -> R:
    """A lease or generation record whose `generation` and `ended` name generations; else ValueError."""
    if not all(isinstance(g, str) and fmt.is_generation(g) for g in [record.generation, *record.ended]):
        raise ValueError(f"field 'generation' or 'ended': not a generation ({record.generation!r}, {record.ended!r})")
    return record




class NewerFormat(ValueError):
    """A record written by a newer harvest, in a format this one does not read: upgrade harvest."""


def check_format(version: int) -> None:
    """Formats 1 up to this harvest's (fmt.FORMAT_VERSION) are read, older ones as they were written; a newer
    one is refused (NewerFormat), and one below 1 was never written by harvest."""
    if version > fmt.FORMAT_VERSION:
        raise NewerFormat(f"format_version {version} was written by a newer harvest (this one reads formats up to "
                          f"{fmt.FORMAT_VERSION}); upgrade harvest to read it")
    if version < 1:
        raise ValueError(f"format_version {version} is no harvest format (1 to {fmt.FORMAT_VERSION})")


@dataclasses.dataclass(frozen=True)
class Sidecar(Record):
    """`stream_NNNNN/shard_NNNNNN.json`: the commit marker and manifest of one shard, written after its data: the
    range it covers, its counts, stats and skipped records, its data object and checksums, its generation and
    source pin. Older sidecars read into the same fields (and write back under their own keys). Each key:
    docs/storage.md."""

    format_version: int
    stream: int
    shard: int
    file: str
    bytes: int
    digest: str
    start: fmt.Position
    next: fmt.Position
    row_start: fmt.Position
    samples: int
    tokens: int
    stats: dict
    skipped: list
    long: dict
    final: bool
    records: int
    tensor_digests: dict | None = None
    quantization: dict | None = None
    source_digest: str | None = None
    first_stats: dict | None = None
    checksum: str | None = None  # None: an older sidecar (the whole file's sha256, per-tensor sha256)
    generation: str = ""
    chunk_bytes: int | None = None
    chunk_digests: dict | None = None

    @classmethod
    def of_shard(cls, data: bytes | list, *, stream: int, shard: int, stats: dict[str, Any], attempt: str = "",
                 checksum: str | None = None, digests: tuple[str, dict[str, str]] | None = None,
                 **fields: Any) -> Sidecar:
        """The sidecar of shard bytes `data` (or its parts, as encoding.shard_parts gives them), written by
        `attempt`: names, size and checksums by `checksum` (default: encoding.default_checksum()) from them,
        or `digests` (encoding.shard_digests) when already computed (chunk digests then come in `fields`, or
        not at all); `stats` as RunningStats."""
        checksum = checksum or encoding.default_checksum()
        if digests is None:
            parts = data if isinstance(data, list) else encoding.file_parts(data)
            chunk_bytes = fields.pop("chunk_bytes", None) or encoding.CHUNK_BYTES
            digest, tensors, chunks = encoding.shard_checksums(parts, checksum, chunk_bytes)
            fields.update(chunk_bytes=chunk_bytes, chunk_digests=chunks)
        else:
            digest, tensors = digests
        return cls(format_version=fmt.FORMAT_VERSION, stream=stream, shard=shard,
                   file=fmt.shard_file(shard, attempt),
                   bytes=sum(memoryview(part).nbytes for part in data) if isinstance(data, list) else len(data),
                   digest=digest, tensor_digests=tensors, checksum=checksum,
                   stats={name: s.to_json() for name, s in stats.items()}, **fields)

    def tensor_digest(self, data) -> str:
        """A tensor's digest from its bytes, by this sidecar's rule (encoding.tensor_digest): compare it with
        `tensor_digests[name]`."""
        return encoding.tensor_digest(data, self.algorithm, None if self.chunk_digests is None else self.chunk_bytes)

    @property
    def algorithm(self) -> str:
        """The algorithm of `digest` and `tensor_digests` (sha256 in older sidecars)."""
        return self.checksum or "sha256"

    def mismatch(self, data) -> str | None:
        """What in a whole data object's bytes differs from this sidecar (size, a tensor's digest, the file's),
        None when nothing does. An older sidecar's file digest is the plain sha256 of the bytes."""
        if len(data) != self.bytes:
            return f"the file is {len(data)} bytes, its sidecar says {self.bytes} (cut short or replaced)"
        parts, chunks = encoding.file_parts(data), {}
        if self.checksum is None:
            tensors = encoding.tensor_digests(parts, "sha256") if self.tensor_digests else {}
            whole = encoding.digest(data, "sha256")
        elif self.chunk_digests is not None:
            whole, tensors, chunks = encoding.shard_checksums(parts, self.checksum, self.chunk_bytes)
        else:
            whole, tensors = encoding.shard_digests(parts, self.checksum)
        for name, want in (self.tensor_digests or {}).items():
            if tensors.get(name) != want:
                return f"checksum mismatch in tensor {name} ({self.algorithm} {str(want)[:12]}... in the sidecar)"
        for name, want in (self.chunk_digests or {}).items():
            if chunks.get(name) != want:
                return (f"checksum mismatch in a chunk of tensor {name} ({self.algorithm} of each {self.chunk_bytes} "
                        "bytes in the sidecar)")
        if whole != self.digest:
            return (f"checksum mismatch: {self.algorithm} {whole[:16]}..., sidecar says {self.digest[:16]}... "
                    f"(corrupted or overwritten)")
        return None

    def to_json(self) -> dict[str, Any]:
        obj = super().to_json()
        if self.source_digest is None:  # as sidecars were before content pins
            del obj["source_digest"]
        if not self.generation:  # as sidecars were before generations: a stream never wiped reads the same
            del obj["generation"]
        if self.chunk_digests is None:  # as sidecars were before chunk digests
            del obj["chunk_bytes"], obj["chunk_digests"]
        if self.checksum is None:  # an older sidecar keeps its own keys
            obj["sha256"] = obj.pop("digest")
            obj.pop("checksum")
            obj["tensor_sha256"] = obj.pop("tensor_digests")
        return obj

    def to_bytes(self) -> bytes:
        # On one line: an indented sidecar's ~30k stats floats took json's pure-Python encoder ~25 ms a shard, a
        # fifth of the host stage's own work (bench/host.py); its C encoder takes a quarter of that.
        return json_bytes(self.to_json(), compact=True)

    @classmethod
    def from_json(cls, obj: Any) -> Sidecar:
        if isinstance(obj, dict) and "checksum" not in obj:  # older: the sha256 keys (see the class doc)
            obj = {("digest" if k == "sha256" else "tensor_digests" if k == "tensor_sha256" else k): v
                   for k, v in obj.items()}
        sidecar = super().from_json(obj)
        check_format(sidecar.format_version)
        for name in ("start", "next", "row_start"):
            if len(getattr(sidecar, name)) != 2:
                raise ValueError(f"field {name!r}: expected [index, variant], got {list(getattr(sidecar, name))}")
        if sidecar.start > sidecar.next:
            raise ValueError(f"start {list(sidecar.start)} after next {list(sidecar.next)}")
        if fmt.data_file_shard(sidecar.file) != sidecar.shard:  # a name from storage: never a path elsewhere
            raise ValueError(f"field 'file': {sidecar.file!r} is not a data object of shard {sidecar.shard}")
        if not fmt.is_generation(sidecar.generation):
            raise ValueError(f"field 'generation': {sidecar.generation!r} is not a generation")
        _check_chunks(sidecar)
        return sidecar


def _check_chunks(sidecar: Sidecar) -> None:
    """Chunk digests come with their size, as lists of strings, for tensors the sidecar has a digest of."""
    chunks, size = sidecar.chunk_digests, sidecar.chunk_bytes
    if chunks is None and size is None:
        return
    if chunks is None or size is None or size <= 0 or sidecar.checksum is None:
        raise ValueError(f"fields 'chunk_bytes' and 'chunk_digests' go together, with a checksum (got {size!r})")
    for name, digests in chunks.items():
        if name not in (sidecar.tensor_digests or {}) or not isinstance(digests, list) or not all(
                isinstance(d, str) for d in digests):
            raise ValueError(f"field 'chunk_digests': {name!r} is not a tensor's list of digests")


@dataclasses.dataclass(frozen=True)
class Progress(Record):
    """`stream_NNNNN/progress.json`, rewritten after each commit, for `harvest status`; never read for
    correctness. `total` is None while a plain source's length is unknown. `bound`: the stage that bounded the
    worker's pipeline so far (chip, host, storage or feeder: harvest.store.bounds), `bound_share` its share of
    the time; "" in records written before them, or before the first batch. `slots`: (data slots without a
    stream to take, data slots) of the worker's process: idle slots compute padding ((0, 0) in older records)."""

    stream: int
    records_done: int
    total: int | None
    shards: int
    tokens_per_s: float
    worker: str
    updated_at: str  # ISO 8601, UTC
    done: bool
    packing: tuple[int, ...] = (0, 0)  # (real tokens, row tokens computed) of this session's rows: packing efficiency
    bound: str = ""
    bound_share: float = 0.0
    slots: tuple[int, ...] = (0, 0)


@dataclasses.dataclass(frozen=True)
class RunInfo(Record):
    """`run.json`: what a run is, written once (create-if-absent) by the first worker; every later command
    into the same output must agree on the settings that decide the bytes.

    model: {source, model_type, config_sha256, num_layers, hidden_size, intermediate_size};
    points: [[point, [layers]]]; tensors: {name: width}; data: {source, num_streams, counts (null when
    unknown), mapping, sha256 (per stream file, for a stream set)}; config: every setting.
    """

    format_version: int
    harvest_version: str
    model: dict
    tokenizer_sha256: str
    points: list
    tensors: dict
    dtype: str
    compute_dtype: str
    max_seq_len: int
    long: str
    format: str
    data: dict
    config: dict
    config_sha256: str
    special_token_ids: list | None = None  # the tokenizer's special tokens, left out of SAE batches (None: older run)
    quantization: dict | None = None  # {scheme, scale_dtype} where dtype is an 8-bit code (harvest.store.quant)

    @classmethod
    def from_json(cls, obj: Any) -> RunInfo:
        info = super().from_json(obj)
        check_format(info.format_version)
        return info
