"""Records from a data source, read lazily (a source can hold billions of tokens; nothing loads it whole).
Every record gets a global `sample_id` (its position over the files, in order) and a location (`path:LINE`,
`path#row N`, `path[N]`); a bad record is a `Record` with `error` set, never an exception and never dropped,
so it keeps its id. Which files a spec names: harvest.data.source_files; the file kinds: docs/extracting.md."""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from collections.abc import Callable, Iterator
from typing import Any

from harvest.data.source_files import SourceFile, hub_spec, open_read, resolve
from harvest.errors import UserError
from harvest.version import install_extra

PARQUET_BATCH_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class Record:
    """One source row: `value` the JSON object, or `error` (why it is unusable) with `value=None`."""

    sample_id: int
    location: str
    value: dict | None
    error: str | None = None


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

def decode_line(line: bytes, first: bool) -> tuple[str | None, str | None]:
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
            text, reason = decode_line(raw, i == 0)
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
    name, config, split = hub_spec(f.path)
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
