"""Records from a data source, read lazily (a source can hold billions of tokens; nothing loads it whole).

A source spec is a local file or directory (its data files, sorted; `.`/`_` files ignored), a glob
(`data/**/*.parquet`, sorted), an fsspec URL with or without a glob (`gs://bucket/fw/*.parquet`, `s3://...`,
`hf://datasets/o/n/*.parquet`), or `hf://NAME[:CONFIG]:SPLIT`, a hub dataset streamed by `datasets`
(the hub extra: `pip install -e '.[hub]'` in harvest's checkout).

File kinds, by extension (optionally compressed `.gz` `.bz2` `.xz` `.zst`):
- `.jsonl` / `.ndjson`: one JSON object per line. EVERY line is a record, blank ones included (they come
  back as errors "empty line"), so a record's line number is always its index in the file + 1.
- `.json`: a JSON array of objects, an object of objects (`{task_id: task}`, as ARC task sets: each
  value becomes a record with "id" set to its key), or one object that is not that (an ARC task file:
  one record, "id" defaulting to the file stem). A `.json` file is parsed whole, so keep them small.
- `.parquet`: read in row-group batches with pyarrow.
- `.txt` / `.text`: one record `{"text": line}` per line (an empty line: an empty text, skipped later).

Every record gets a global `sample_id`: its 0-based position over the concatenation of the files. A bad
record (malformed JSON, not an object, not UTF-8) is a `Record` with `value=None` and `error` set: never
an exception, never dropped, it keeps its id. Locations: `path:LINE` (1-based) for line files,
`path#row N` (0-based) for parquet and hub datasets, `path[N]` (0-based entry) for `.json`. A source
that cannot be read at all (missing file, no file matching, unknown type) is a `UserError`."""

from __future__ import annotations

import contextlib
import dataclasses
import glob as globlib
import io
import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from harvest.errors import UserError
from harvest.storage import Storage
from harvest.version import install_extra

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet",
           ".txt": "text", ".text": "text"}
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}
PARQUET_BATCH_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class Record:
    """One source row: `value` the JSON object, or `error` (why it is unusable) with `value=None`."""

    sample_id: int
    location: str
    value: dict | None
    error: str | None = None


@dataclasses.dataclass(frozen=True)
class SourceFile:
    path: str  # as the user sees it: relative local path as globbed, or a full URL
    format: str  # jsonl | json | parquet | text | hf
    compression: str | None = None
    size: int | None = None  # bytes, as listed


# --- the one place that opens source bytes ----------------------------------------------------------------

@contextlib.contextmanager
def open_read(path: str, compression: str | None = None):
    """A binary file object over a source file, decompressing on the fly. Local, gs:// and s3:// files are
    read through harvest's Storage (retries, reopening mid-stream, one-line errors); other fsspec URLs
    (hf://, memory://, http://) through fsspec itself."""
    try:
        if Storage.supports(path):
            directory, _, name = path.rstrip("/").rpartition("/")
            with Storage(directory or ".").open_binary(name) as raw:
                yield _decompressed(raw, compression, path)
        else:
            import fsspec

            with fsspec.open(path, "rb").open() as raw:
                yield _decompressed(raw, compression, path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None


def _decompressed(raw, compression: str | None, path: str):
    if compression is None:
        return raw
    from fsspec.compression import compr

    try:
        opener = compr[compression]
    except KeyError:
        hint = " (pip install zstandard)" if compression == "zstd" else ""
        raise UserError(f"{path}: cannot read {compression}-compressed files here{hint}") from None
    fh = opener(raw, mode="rb")
    return io.BufferedReader(fh, 1 << 20) if compression == "zstd" else fh  # zstd cannot iterate lines alone


# --- resolving a spec into files -----------------------------------------------------------------------

def _is_url(spec: str) -> bool:
    return "://" in spec


def _has_magic(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def _hub_spec(spec: str) -> tuple[str, str | None, str] | None:
    """(name, config, split) for `hf://NAME[:CONFIG]:SPLIT`; None for other specs (incl. hf://datasets/...)."""
    if not spec.startswith("hf://") or spec.startswith("hf://datasets/"):
        return None
    parts = spec[len("hf://"):].split(":")
    if len(parts) not in (2, 3) or not all(parts):
        raise UserError(f"{spec}: a hub dataset is hf://NAME[:CONFIG]:SPLIT, "
                        "e.g. hf://HuggingFaceFW/fineweb-edu:sample-10BT:train")
    return (parts[0], parts[1] if len(parts) == 3 else None, parts[-1])


def _file_kind(path: str, size: int | None = None) -> SourceFile:
    name = path.rstrip("/").rsplit("/", 1)[-1].lower()
    stem, ext = os.path.splitext(name)
    compression = COMPRESSIONS.get(ext)
    if compression:
        ext = os.path.splitext(stem)[1]
    fmt = FORMATS.get(ext)
    if fmt is None:
        raise UserError(f"{path}: unknown file type (known: {', '.join(FORMATS)}, optionally compressed "
                        f"{', '.join(COMPRESSIONS)})")
    if fmt == "parquet" and compression:
        raise UserError(f"{path}: compressed parquet files are not supported (parquet compresses inside)")
    return SourceFile(path, fmt, compression, size)


def _listing(spec: str) -> list[tuple[str, int | None]]:
    """Sorted (path, size) of the data files a spec names (local or URL); UserError when none."""
    if _is_url(spec):
        import fsspec

        try:
            fs, path = fsspec.core.url_to_fs(spec)
        except (ImportError, ValueError) as e:
            raise UserError(f"{spec}: cannot open this URL ({e})") from None
        if _has_magic(path):
            infos = list(fs.glob(path, detail=True).values())
        elif fs.isdir(path):
            infos = _directory_files(spec, fs.ls(path, detail=True))
        else:
            try:
                infos = [fs.info(path)]
            except FileNotFoundError:
                raise UserError(f"{spec}: no such file") from None
        found = [(fs.unstrip_protocol(i["name"]), i.get("size")) for i in infos if i.get("type") != "directory"]
    else:
        if _has_magic(spec):
            paths = globlib.glob(spec, recursive=True)
        elif os.path.isdir(spec):
            paths = [os.path.join(spec, n) for n in os.listdir(spec)]
            paths = [i["name"] for i in _directory_files(spec, [{"name": p} for p in paths])]
        elif os.path.exists(spec):
            paths = [spec]
        else:
            raise UserError(f"{spec}: no such file")
        found = [(p, os.path.getsize(p)) for p in paths if not os.path.isdir(p)]
    if not found:
        raise UserError(f"{spec}: no file matches")
    return sorted(found)


def _directory_files(spec: str, infos: list[dict]) -> list[dict]:
    """A directory's entries minus hidden ones (`.x`, `_SUCCESS`); a streams directory is refused."""
    named = {i["name"].rstrip("/").rsplit("/", 1)[-1]: i for i in infos}
    if "streams.json" in named:
        raise UserError(f"{spec}: this is a streams directory; open it with harvest.data.streams.open_data "
                        "(or pass it to `harvest extract --data`)")
    kept = [i for n, i in named.items() if not n.startswith((".", "_"))]
    if not kept:
        raise UserError(f"{spec}: the directory holds no data files")
    return kept


def resolve(spec: str) -> list[SourceFile]:
    """The files a spec names, in reading order (a hub dataset is one pseudo-file: the spec itself)."""
    if not isinstance(spec, str) or not spec:
        raise UserError("--data: give a file, glob, URL or hf://NAME[:CONFIG]:SPLIT")
    if _hub_spec(spec):
        return [SourceFile(spec, "hf")]
    return [_file_kind(p, size) for p, size in _listing(spec)]


def describe(spec: str, files: list[SourceFile] | None = None) -> dict:
    """The resolved source, for reproducibility: the spec and each file with its format and size."""
    entries = []
    for f in files if files is not None else resolve(spec):
        entry: dict[str, Any] = {"path": f.path, "format": f.format}
        if f.compression:
            entry["compression"] = f.compression
        if f.size is not None:
            entry["size"] = f.size
        entries.append(entry)
    out: dict[str, Any] = {"spec": spec, "files": entries}
    hub = _hub_spec(spec)
    if hub:
        out["hub"] = {"name": hub[0], "config": hub[1], "split": hub[2]}
    return out


def location(path: str, fmt: str, index: int) -> str:
    """Where record `index` (0-based, within its file) of a file of format `fmt` lives."""
    if fmt in ("jsonl", "text"):
        return f"{path}:{index + 1}"
    if fmt == "json":
        return f"{path}[{index}]"
    return f"{path}#row {index}"


# --- reading -----------------------------------------------------------------------------------------
# Items are (index_in_file, kind, data, raw): kind "line" (a decoded jsonl line, not yet parsed), "value" (a
# parsed row, maybe not a dict) or "error" (a reason); raw: the line's bytes as read (line files), else None.
# Streams carry lines verbatim; records parse them. Each reader skips its first `skip` records as cheaply as
# its format allows and returns its record count.

def _decode(line: bytes, first: bool) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason) for one raw line, without its line ending (and BOM)."""
    if line.endswith(b"\n"):
        line = line[:-1]
    if line.endswith(b"\r"):
        line = line[:-1]
    if first and line.startswith(b"\xef\xbb\xbf"):
        line = line[3:]
    try:
        return line.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, f"not valid UTF-8 (byte 0x{line[e.start]:02x} at col {e.start + 1})"


def _read_lines(f: SourceFile, skip: int, as_text: bool):
    with open_read(f.path, f.compression) as fh:
        n = sum(1 for _ in itertools.islice(fh, skip))
        for i, raw in enumerate(fh, start=n):
            text, reason = _decode(raw, i == 0)
            if reason is not None:
                yield i, "error", reason, raw
            elif as_text:
                yield i, "value", {"text": text}, raw
            else:
                yield i, "line", text, raw
            n = i + 1
    return n


def _read_json(f: SourceFile, skip: int):
    with open_read(f.path, f.compression) as fh:
        data = fh.read()
    try:
        doc = json.loads(data.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        raise UserError(f"{f.path}: not valid UTF-8 (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{f.path}: malformed JSON: {e.msg} (line {e.lineno} col {e.colno})") from None
    except RecursionError:
        raise UserError(f"{f.path}: malformed JSON: nested too deeply") from None
    except ValueError:  # an integer longer than Python converts
        raise UserError(f"{f.path}: malformed JSON: an integer with more than "
                        f"{sys.get_int_max_str_digits()} digits") from None
    if isinstance(doc, list):
        rows = doc
    elif doc == {}:
        rows = []
    elif isinstance(doc, dict) and doc and all(isinstance(v, dict) for v in doc.values()):
        rows = [{"id": k, **{a: b for a, b in v.items() if a != "id"}} for k, v in doc.items()]
    elif isinstance(doc, dict):
        stem = f.path.rstrip("/").rsplit("/", 1)[-1].split(".")[0]
        rows = [doc if "id" in doc else {"id": stem, **doc}]
    else:
        raise UserError(f"{f.path}: a .json source must hold an array or an object, not {json_kind(doc)}")
    for i in range(skip, len(rows)):
        yield i, "value", rows[i], None
    return len(rows)


def _read_parquet(f: SourceFile, skip: int):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError(f"{f.path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    import pyarrow as pa

    with open_read(f.path) as fh:
        try:
            pf = pq.ParquetFile(fh)
        except (pa.ArrowInvalid, OSError) as e:
            raise UserError(f"{f.path}: not a readable parquet file ({e})") from None
        meta = pf.metadata
        total, offset, groups = meta.num_rows, 0, []
        for g in range(meta.num_row_groups):  # skip whole row groups by their metadata
            rows = meta.row_group(g).num_rows
            if offset + rows <= skip:
                offset += rows
                continue
            groups.append(g)
        if groups:
            index = offset
            for batch in pf.iter_batches(batch_size=PARQUET_BATCH_ROWS, row_groups=groups):
                rows = batch.to_pylist()
                lo = max(0, skip - index)
                for j in range(lo, len(rows)):
                    yield index + j, "value", rows[j], None
                index += len(rows)
    return total


def _read_hub(f: SourceFile, skip: int):
    name, config, split = _hub_spec(f.path)
    try:
        import datasets
    except ImportError:
        raise UserError(f"{f.path}: hub datasets need the `datasets` library: {install_extra('hub')} "
                        "(or pip install datasets)") from None
    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True)
    except Exception as e:  # the library raises many kinds; the user's input is what is wrong
        raise UserError(f"{f.path}: cannot open hub dataset ({type(e).__name__}: {e})") from None
    if skip:
        ds = ds.skip(skip)
    n = skip
    for i, row in enumerate(ds, start=skip):
        yield i, "value", row, None
        n = i + 1
    return n


_READERS = {
    "jsonl": lambda f, skip: _read_lines(f, skip, as_text=False),
    "text": lambda f, skip: _read_lines(f, skip, as_text=True),
    "json": _read_json,
    "parquet": _read_parquet,
    "hf": _read_hub,
}


def iter_items(files: list[SourceFile], start: int = 0, counts: list[int] | None = None,
               pin: Callable[[bytes], None] | None = None):
    """(sample_id, file_index, index_in_file, kind, data) over the files, from global record `start` on.

    Files whose records all come before `start` are skipped without parsing; `counts`, if given, is
    filled with each file's record count as it is learned (all of them once the iterator is exhausted).
    `pin`, if given, is called with each record's bytes (`raw_bytes`) before it is yielded.
    """
    if start < 0:
        raise ValueError("start must be >= 0")
    base = 0
    for k, f in enumerate(files):
        box = [0]
        for i, kind, data, raw in _counted(_READERS[f.format](f, max(0, start - base)), box):
            if pin is not None:
                pin(raw_bytes(data, raw))
            yield base + i, k, i, kind, data
        if counts is not None:
            counts[k] = box[0]
        base += box[0]


def raw_bytes(data: Any, raw: bytes | None) -> bytes:
    """A record's bytes as a stream's content pin hashes them (harvest.data.pin): a line as read, else (a
    parquet, .json or hub row) its repr; each ends with one newline and holds no other."""
    if raw is None:
        return repr(data).encode("utf-8", "backslashreplace") + b"\n"
    return raw if raw.endswith(b"\n") else raw + b"\n"


def _counted(reader, box: list):
    box[0] = yield from reader


def parse_line(text: str) -> tuple[dict | None, str | None]:
    """A jsonl line -> (object, None) or (None, reason)."""
    if not text.strip():
        return None, "empty line"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"malformed JSON: {e.msg} (col {e.colno})"
    except RecursionError:
        return None, "malformed JSON: nested too deeply"
    except ValueError:  # json's other refusal: an integer longer than Python converts
        return None, f"malformed JSON: an integer with more than {sys.get_int_max_str_digits()} digits"
    if not isinstance(value, dict):
        return None, f"not a JSON object (got {json_kind(value)})"
    return value, None


def json_kind(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number" if isinstance(value, (int, float)) else type(value).__name__)


def to_record(sample_id: int, where: str, kind: str, data: Any) -> Record:
    if kind == "line":
        value, error = parse_line(data)
        return Record(sample_id, where, value, error)
    if kind == "error":
        return Record(sample_id, where, None, data)
    if not isinstance(data, dict):
        return Record(sample_id, where, None, f"not a JSON object (got {json_kind(data)})")
    return Record(sample_id, where, data, None)


def iter_records(spec: str, start: int = 0) -> Iterator[Record]:
    """The source's records from global index `start` on, lazily, in order."""
    files = resolve(spec)
    for sample_id, k, i, kind, data in iter_items(files, start):
        f = files[k]
        yield to_record(sample_id, location(f.path, f.format, i), kind, data)
