"""Which files a source spec names, and the one place that opens their bytes. A spec is a local file or
directory (its data files, sorted; `.`/`_` files ignored), a glob, an fsspec URL with or without a glob
(gs://, s3://, hf://datasets/...), or `hf://NAME[:CONFIG]:SPLIT`, a hub dataset streamed by `datasets`. Files
are .jsonl/.ndjson, .json, .parquet, .txt/.text by extension, optionally .gz/.bz2/.xz/.zst compressed."""

from __future__ import annotations

import contextlib
import dataclasses
import glob as globlib
import io
import os
from typing import Any

from harvest.errors import UserError
from harvest.storage import Storage

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet",
           ".txt": "text", ".text": "text"}
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}


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

def is_url(spec: str) -> bool:
    return "://" in spec


def has_magic(spec: str) -> bool:
    return any(c in spec for c in "*?[")


def hub_spec(spec: str) -> tuple[str, str | None, str] | None:
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
    if is_url(spec):
        import fsspec

        try:
            fs, path = fsspec.core.url_to_fs(spec)
        except (ImportError, ValueError) as e:
            raise UserError(f"{spec}: cannot open this URL ({e})") from None
        if has_magic(path):
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
        if has_magic(spec):
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
    if hub_spec(spec):
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
    hub = hub_spec(spec)
    if hub:
        out["hub"] = {"name": hub[0], "config": hub[1], "split": hub[2]}
    return out
