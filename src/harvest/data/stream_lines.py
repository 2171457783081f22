"""A stream file's lines: how a source item becomes one line (verbatim, as JSON, or an error line that keeps
the item's original location), the writer that hashes and indexes a stream's lines, and a line read back as a
record."""

from __future__ import annotations

import datetime
import decimal
import hashlib
import json
from typing import Any

from harvest.data import sources
from harvest.data.sources import Record

ERROR_KEY = "__harvest_error__"
LOCATION_KEY = "__harvest_location__"


def _json_default(value: Any) -> Any:
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return value.decode("utf-8")  # UnicodeDecodeError: carried as an error line
    if hasattr(value, "tolist"):  # numpy scalars / arrays
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def carry(kind: str, data: Any, where) -> bytes:
    """The stream line (without newline) for one source item; `where()` gives its location if needed."""
    if kind == "line":
        return data.encode("utf-8")
    if kind == "value":
        try:
            text = json.dumps(data, ensure_ascii=False, default=_json_default)
            try:
                return text.encode("utf-8")
            except UnicodeEncodeError:  # lone surrogates from \ud800-style escapes: keep them escaped
                return json.dumps(data, default=_json_default).encode("ascii")
        except (TypeError, ValueError, UnicodeDecodeError) as e:
            data = f"value not JSON-serializable: {e}"
    return json.dumps({ERROR_KEY: data, LOCATION_KEY: where()}, ensure_ascii=False).encode("utf-8")


class StreamWriter:
    """Buffered, hashed, line-indexed writer of one stream file (`file`: from Storage.open_write)."""

    def __init__(self, file, buffer_bytes: int, index_every: int):
        self.buffer_bytes, self.index_every = buffer_bytes, index_every
        self.file = file
        self.sha = hashlib.sha256()
        self.buffer: list[bytes] = []
        self.buffered = self.written = self.count = 0
        self.offsets: list[int] = []

    def write(self, line: bytes) -> None:
        if self.count % self.index_every == 0:
            self.offsets.append(self.written + self.buffered)
        self.buffer.append(line + b"\n")
        self.buffered += len(line) + 1
        self.count += 1
        if self.buffered >= self.buffer_bytes:
            self.flush()

    def flush(self) -> None:
        if self.buffer:
            data = b"".join(self.buffer)
            self.file.write(data)
            self.sha.update(data)
            self.written += len(data)
            self.buffer, self.buffered = [], 0


def read_line(raw: bytes, sample_id: int, where: str) -> Record:
    text, reason = sources.decode_line(raw, False)
    if reason is not None:
        return Record(sample_id, where, None, reason)
    value, error = sources.parse_line(text)
    if _is_carried_error(value):
        return Record(sample_id, value[LOCATION_KEY] or where, None, value[ERROR_KEY])
    return Record(sample_id, where, value, error)


def _is_carried_error(value: dict | None) -> bool:
    """Whether a stream line is one that carry wrote for a bad source item (and not a record that merely
    has a field of that name): exactly the two keys, both strings."""
    return (value is not None and value.keys() == {ERROR_KEY, LOCATION_KEY}
            and all(isinstance(v, str) for v in value.values()))
