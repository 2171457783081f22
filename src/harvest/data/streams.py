"""Split a source into N disjoint streams (`harvest streams create`), and read streams back: stream_NNNNN.jsonl
files and streams.json, written last as the commit marker. Source record i (its `sample_id`) is line i // N of
stream i % N; streams.json counts the records of each source file (so a stream names a record's original
location) and indexes line offsets (so a resumed worker seeks to its cursor). Format: docs/storage.md."""

from __future__ import annotations

import bisect
import contextlib
import datetime
import hashlib
import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

from harvest.data import source_files, sources
from harvest.data.pin import SourcePin
from harvest.data.sources import Record
from harvest.data.stream_lines import StreamWriter, carry, read_line
from harvest.errors import UserError
from harvest.storage import Storage, StorageNotFoundError

STREAMS_FILE = "streams.json"
FORMAT_VERSION = 1
INDEX_EVERY = 4096
_STREAM_RE = re.compile(r"stream_(\d{5,})\.jsonl$")


def stream_name(stream: int) -> str:
    return f"stream_{stream:05d}.jsonl"


def _join(url: str, name: str) -> str:
    return url.rstrip("/") + "/" + name


# --- writing -----------------------------------------------------------------------------------------------

def _raise_fd_limit(needed: int) -> None:
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))
    except (ImportError, ValueError, OSError):
        pass


def create_streams(data: str, num_streams: int, out: str, *, overwrite: bool = False,
                   buffer_bytes: int | None = None) -> StreamSet:
    """Read `data` once and write it as `num_streams` round-robin streams + streams.json under `out`.

    Refuses to replace an existing streams.json unless `overwrite`. Stream files are written
    incrementally (memory about min(1 MiB, 256 MiB / N) per stream plus the filesystem's own write
    buffer); streams.json goes last, so a crash leaves no half-made stream set that looks complete.
    """
    if isinstance(num_streams, bool) or not isinstance(num_streams, int) or num_streams < 1:
        raise UserError(f"--num-streams: must be a positive integer, got {num_streams!r}")
    files = source_files.resolve(data)
    described = source_files.describe(data, files)
    store = Storage(out)
    if store.exists(STREAMS_FILE):
        if not overwrite:
            raise UserError(f"{out}: already holds {STREAMS_FILE}; pass --overwrite to replace it")
        store.delete(STREAMS_FILE)  # first, so an interrupted rewrite is never mistaken for a complete one
    for name in store.listdir():
        if (m := _STREAM_RE.match(name)) and int(m.group(1)) >= num_streams:
            store.delete(name)

    n = num_streams
    if store.is_local:
        _raise_fd_limit(n + 64)
    buffer_bytes = buffer_bytes or max(64 << 10, min(1 << 20, (256 << 20) // n))
    per_file = [0] * len(files)
    with contextlib.ExitStack() as opened:  # every stream file lands at the end, or none does
        writers = [StreamWriter(opened.enter_context(store.open_write(stream_name(s))), buffer_bytes, INDEX_EVERY)
                   for s in range(n)]
        for sample_id, k, i, kind, value in sources.iter_items(files, 0, per_file):
            f = files[k]
            writers[sample_id % n].write(carry(kind, value, lambda: sources.location(f.path, f.format, i)))
        for w in writers:
            w.flush()

    for entry, count in zip(described["files"], per_file):
        entry["records"] = count
    meta = {
        "format_version": FORMAT_VERSION,
        "source": data,
        "files": described,
        "num_streams": n,
        "mapping": "round_robin",
        "counts": [w.count for w in writers],
        "total": sum(w.count for w in writers),
        "sha256": [w.sha.hexdigest() for w in writers],
        "index_every": INDEX_EVERY,
        "line_offsets": [w.offsets for w in writers],
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    text = "{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items()) + "\n}\n"
    store.write_bytes(STREAMS_FILE, text.encode())
    return StreamSet.open(out)


# --- reading -----------------------------------------------------------------------------------------------

class _PinnedReads:
    """A stream's next read may feed its content pin (harvest.data.pin): `pin_reads(stream, pin)` before it."""

    _pins: dict[int, SourcePin]

    def _check_stream(self, stream: int) -> None:
        raise NotImplementedError

    def where(self, stream: int) -> str:
        """Where the stream's records come from, for a message."""
        raise NotImplementedError

    def pin_reads(self, stream: int, pin: SourcePin) -> None:
        self._check_stream(stream)
        self._pins[stream] = pin

    def _pin_of(self, stream: int, start: int) -> SourcePin | None:
        pin = self._pins.pop(stream, None)
        if pin is not None and pin.count != start:
            raise ValueError(f"stream {stream}: a read from record {start} cannot go on from a pin at {pin.count}")
        return pin


class StreamSet(_PinnedReads):
    """A directory holding streams.json and its stream files (see the module doc)."""

    def __init__(self, url: str, meta: dict):
        self._pins = {}
        self.url = url
        self.storage = Storage(url)
        self.meta = meta
        self.num_streams: int = meta["num_streams"]
        self.counts: list[int] = list(meta["counts"])
        self.total: int = meta["total"]
        self.source: str = meta.get("source", "")
        self.sha256: list[str] = list(meta["sha256"])
        self._files, self._starts = self._file_table(meta)

    @classmethod
    def open(cls, url: str) -> StreamSet:
        url = url.rstrip("/") or url
        if url.endswith("/" + STREAMS_FILE) or url == STREAMS_FILE:
            url = url[: -len(STREAMS_FILE)].rstrip("/") or "."
        try:
            raw = Storage(url).read_bytes(STREAMS_FILE)
        except StorageNotFoundError:
            raise UserError(f"{url}: no {STREAMS_FILE} here; create streams with "
                            f"`harvest streams create --data SRC --num-streams N --out {url}`") from None
        where = _join(url, STREAMS_FILE)
        try:
            meta = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise UserError(f"{where}: not valid JSON ({e}); recreate it with `harvest streams create`") from None
        problem = _validate(meta)
        if problem:
            raise UserError(f"{where}: {problem}; recreate it with `harvest streams create --overwrite`")
        return cls(url, meta)

    @staticmethod
    def _file_table(meta: dict) -> tuple[list[dict], list[int]]:
        files = meta.get("files")
        files = files.get("files") if isinstance(files, dict) else None
        try:
            counts = [int(f["records"]) for f in files]
            if sum(counts) != meta["total"] or not all(isinstance(f["path"], str) for f in files):
                return [], []
        except (TypeError, KeyError, ValueError):
            return [], []
        return files, list(itertools.accumulate([0] + counts[:-1]))

    def stream_url(self, stream: int) -> str:
        return _join(self.url, stream_name(stream))

    def where(self, stream: int) -> str:
        return self.stream_url(stream)

    def sample_id(self, stream: int, index: int) -> int:
        return index * self.num_streams + stream

    def locate(self, sample_id: int) -> tuple[int, int]:
        """(stream, index in the stream) of a global sample id."""
        return sample_id % self.num_streams, sample_id // self.num_streams

    def location(self, sample_id: int) -> str | None:
        """The original source location of a sample, when streams.json lists the source files."""
        if not self._files or not 0 <= sample_id < self.total:
            return None
        k = bisect.bisect_right(self._starts, sample_id) - 1
        # (an empty file shares its start with the next file; bisect_right picks the later one)
        f = self._files[k]
        return sources.location(f["path"], f.get("format", ""), sample_id - self._starts[k])

    def _check_stream(self, stream: int) -> None:
        if isinstance(stream, bool) or not isinstance(stream, int) or not 0 <= stream < self.num_streams:
            raise UserError(f"stream {stream!r} out of range: {self.url} has {self.num_streams} streams "
                            f"(0-{self.num_streams - 1})")

    def records(self, stream: int, start: int = 0) -> Iterator[Record]:
        """The stream's records from its index `start` on; ids global, locations from the source."""
        self._check_stream(stream)
        count = self.counts[stream]
        if not 0 <= start <= count:
            raise ValueError(f"start {start} outside stream {stream} of {count} records")
        return self._records(stream, start, count, self._pin_of(stream, start))

    def raw_records(self, stream: int, start: int = 0) -> Iterator[bytes]:
        """The bytes of the stream's records from `start` on, as its content pin hashes them (no parsing)."""
        self._check_stream(stream)
        return (sources.raw_bytes(None, raw) for _, raw in self._lines(stream, start, self.counts[stream]))

    def _records(self, stream: int, start: int, count: int, pin: SourcePin | None) -> Iterator[Record]:
        url = self.stream_url(stream)
        for index, raw in self._lines(stream, start, count):
            if pin is not None:
                pin.add(sources.raw_bytes(None, raw))
            sample_id = index * self.num_streams + stream
            yield read_line(raw, sample_id, self.location(sample_id) or f"{url}:{index + 1}")

    def _lines(self, stream: int, start: int, count: int) -> Iterator[tuple[int, bytes]]:
        """(index, line as stored, newline included) of the stream's records `start`..count-1."""
        if start >= count:
            return
        url = self.stream_url(stream)
        offsets = (self.meta.get("line_offsets") or [None] * self.num_streams)[stream]
        every = self.meta.get("index_every") or 0
        with self.storage.open_binary(stream_name(stream)) as fh:
            line = 0
            if offsets and every and start >= every:
                j = min(start // every, len(offsets) - 1)
                fh.seek(offsets[j])
                line = j * every
            line += sum(1 for _ in itertools.islice(fh, start - line))
            if line != start:
                raise UserError(f"{url}: has {line} lines, {STREAMS_FILE} says {count}; the stream set is damaged")
            for index in range(start, count):
                raw = fh.readline()
                if not raw:
                    raise UserError(f"{url}: has {index} lines, {STREAMS_FILE} says {count}; "
                                    "the stream set is damaged")
                yield index, raw

    def verify(self) -> list[str]:
        """Problems found re-reading every stream file (line count, sha256); empty when all is well."""
        problems = []
        for s in range(self.num_streams):
            url, sha, lines = self.stream_url(s), hashlib.sha256(), 0
            try:
                with self.storage.open_binary(stream_name(s)) as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        sha.update(chunk)
                        lines += chunk.count(b"\n")
            except UserError as e:
                problems.append(str(e))
                continue
            if lines != self.counts[s]:
                problems.append(f"{url}: {lines} lines, {STREAMS_FILE} says {self.counts[s]}")
            if sha.hexdigest() != self.sha256[s]:
                problems.append(f"{url}: sha256 {sha.hexdigest()} differs from {STREAMS_FILE}")
        return problems

    def info(self) -> dict:
        """What a run records about its data (run.json)."""
        return {"kind": "streams", "url": self.url, "source": self.source, "num_streams": self.num_streams,
                "total": self.total, "mapping": "round_robin", "sha256": self.sha256,
                "created_at": self.meta.get("created_at")}


def _validate(meta: Any) -> str | None:
    """Why a streams.json is unusable, or None."""
    if not isinstance(meta, dict):
        return "not a JSON object"
    if meta.get("format_version") != FORMAT_VERSION:
        return f"format_version {meta.get('format_version')!r} is not {FORMAT_VERSION}, the one this harvest reads"
    n = meta.get("num_streams")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return f"num_streams {n!r} is not a positive integer"
    if meta.get("mapping") != "round_robin":
        return f"mapping {meta.get('mapping')!r} is not 'round_robin'"
    total, counts, sha = meta.get("total"), meta.get("counts"), meta.get("sha256")
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        return f"total {total!r} is not a count"
    if not isinstance(counts, list) or len(counts) != n:
        return f"counts must list {n} stream sizes"
    expected = [len(range(s, total, n)) for s in range(n)]
    if counts != expected:
        return f"counts {counts[:8]}{'...' if n > 8 else ''} do not split {total} records round robin"
    if not isinstance(sha, list) or len(sha) != n or not all(
            isinstance(h, str) and re.fullmatch(r"[0-9a-f]{64}", h) for h in sha):
        return f"sha256 must list {n} hex digests"
    offsets = meta.get("line_offsets")
    if offsets is not None and not (isinstance(offsets, list) and len(offsets) == n and all(
            isinstance(o, list) and all(isinstance(x, int) and x >= 0 for x in o) for o in offsets)):
        return f"line_offsets must list {n} lists of byte offsets"
    every = meta.get("index_every")
    if offsets is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        return f"index_every {every!r} is not a positive integer"
    return None


class SourceStreams(_PinnedReads):
    """A plain source seen as one stream (stream 0) of unknown length; sample_id = record index."""

    num_streams = 1

    def __init__(self, spec: str):
        self._pins = {}
        self.spec = spec
        self.files = source_files.resolve(spec)  # a bad spec fails here, before any work starts
        self.counts: list[int | None] = [None]
        self.total: int | None = None

    def sample_id(self, stream: int, index: int) -> int:
        self._check_stream(stream)
        return index

    def where(self, stream: int) -> str:
        return self.spec

    def _check_stream(self, stream: int) -> None:
        if stream != 0:
            raise UserError(f"stream {stream!r} out of range: {self.spec} is a plain source, one stream (0); "
                            "split it with `harvest streams create` to use more")

    def records(self, stream: int, start: int = 0) -> Iterator[Record]:
        self._check_stream(stream)
        files, pin = self.files, self._pin_of(stream, start)
        return (sources.to_record(sid, sources.location(files[k].path, files[k].format, i), kind, data)
                for sid, k, i, kind, data in sources.iter_items(files, start, pin=pin and pin.add))

    def raw_records(self, stream: int, start: int = 0) -> Iterator[bytes]:
        """The bytes of the source's records from `start` on, as its content pin hashes them (no JSON parsing)."""
        self._check_stream(stream)
        got: list[bytes] = []
        for _ in sources.iter_items(self.files, start, pin=got.append):  # each item's bytes, handed on
            yield got.pop()

    def info(self) -> dict:
        return {"kind": "source", **source_files.describe(self.spec, self.files)}


def open_data(spec: str) -> StreamSet | SourceStreams:
    """A stream set (a directory or URL holding streams.json) or a plain source as a single stream."""
    if not isinstance(spec, str) or not spec:
        raise UserError("--data: give a file, glob, URL, hf://NAME[:CONFIG]:SPLIT or a streams directory")
    if spec.rstrip("/").endswith(STREAMS_FILE):
        return StreamSet.open(spec)
    if Storage.supports(spec) and not source_files.has_magic(spec) and Storage(spec).exists(STREAMS_FILE):
        return StreamSet.open(spec)
    return SourceStreams(spec)
