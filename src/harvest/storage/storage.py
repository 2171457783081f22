"""Storage: one root URL (a local path, gs://bucket/prefix, s3://bucket/prefix) and the few operations
harvest needs on it, over one backend per protocol (local.py, gcs.py, s3.py; the protocol in backend.py), with
paths relative to the root. A write lands whole or not at all; `create_exclusive` and `replace_if` are decided
by the store atomically; transient errors are retried here, in one place (the clients' own retries are off);
every failure is one `StorageError` line (StorageFull and StorageUnreachable: exit 75, the command resumes).
Endpoints and credentials come from the environment, as for any gcsfs/s3fs user (docs/storage.md)."""

from __future__ import annotations

import contextlib
import errno
import io
import json
import logging
import os
import random
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from harvest.clock import SYSTEM, Clock
from harvest.storage.backend import Backend, Buffer, Versioned
from harvest.storage.errors import (
    BlockedPath,
    PreconditionFailed,
    StorageError,
    StorageFull,
    StorageNotFoundError,
    StorageUnreachable,
    describe,
    is_transient,
    redact,
)
from harvest.storage.local import LocalBackend
from harvest.storage.reading import ReopeningReader

log = logging.getLogger(__name__)

T = TypeVar("T")

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$")
_LOCAL_SCHEMES = ("", "file", "local")
_OBJECT_SCHEMES = {"gs": "gs", "gcs": "gs", "s3": "s3", "s3a": "s3"}


def json_bytes(obj: Any, compact: bool = False) -> bytes:
    """How harvest writes JSON: sorted keys, one key a line (`compact`: all on one line, by json's C encoder, for
    records of thousands of numbers), UTF-8, a final newline."""
    layout = {"separators": (",", ":")} if compact else {"indent": 1}
    return (json.dumps(obj, sort_keys=True, ensure_ascii=False, **layout) + "\n").encode("utf-8")


class Storage:
    """Files under one root URL. See the module docstring."""

    attempts = 6  # tries per operation (1 = no retry)
    backoff = 0.2  # seconds before the first retry; doubles each time
    backoff_cap = 10.0  # longest single wait

    def __init__(self, url: str, *, attempts: int | None = None, backoff: float | None = None,
                 backoff_cap: float | None = None, clock: Clock | None = None, backend: Backend | None = None):
        """`attempts`, `backoff`, `backoff_cap`: the retry budget (see the class attributes). `clock`: what
        every wait and elapsed time here is measured on (harvest.clock.SYSTEM). `backend`: the store behind
        the URL, instead of the one its scheme names; any scheme goes then (`sim://bucket/run`)."""
        if not isinstance(url, str) or not url.strip():
            raise StorageError(f"{url!r}: not a storage URL; give a local path, gs://bucket/prefix or s3://bucket/prefix")
        url = url.strip()
        if attempts is not None:
            self.attempts = max(1, int(attempts))
        if backoff is not None:
            self.backoff = float(backoff)
        if backoff_cap is not None:
            self.backoff_cap = float(backoff_cap)
        self.clock = clock or SYSTEM
        m = _URL.match(url)
        scheme = m.group(1).lower() if m else ""
        if scheme in _LOCAL_SCHEMES:
            path = m.group(2) if m else url
            self.protocol = "file"
            self._root = os.path.abspath(os.path.expanduser(path))
            if len(self._root) > 1:
                self._root = self._root.rstrip(os.sep)
            self.url = self._root
        elif scheme in _OBJECT_SCHEMES or backend is not None:
            self.protocol = _OBJECT_SCHEMES.get(scheme, scheme)
            rest = m.group(2).strip("/")
            rest = rest.split("@", 1)[1] if "@" in rest.split("/", 1)[0] else rest  # no credentials in URLs
            if not rest:
                raise StorageError(f"{redact(url)}: no bucket in the URL; use {scheme}://bucket/prefix")
            self._root = rest
            self.bucket = rest.split("/", 1)[0]
            self.url = f"{self.protocol}://{rest}"
        else:
            raise StorageError(f"{redact(url)}: unsupported URL scheme {scheme!r}; use a local path, gs:// or s3://")
        self.backend = backend if backend is not None else self._backend_for(self.protocol)

    def _backend_for(self, protocol: str) -> Backend:
        if protocol == "gs":
            from harvest.storage.gcs import GCSBackend  # imported on use: a local run never imports fsspec
            return GCSBackend()
        if protocol == "s3":
            from harvest.storage.s3 import S3Backend
            return S3Backend()
        return LocalBackend(self.clock)

    @staticmethod
    def supports(url: str) -> bool:
        """Whether `url` is one Storage takes: a local path (or file://), gs:// or s3://."""
        m = _URL.match(url.strip())
        scheme = m.group(1).lower() if m else ""
        return scheme in _LOCAL_SCHEMES or scheme in _OBJECT_SCHEMES

    # --- plumbing ---------------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Storage) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def is_local(self) -> bool:
        return self.protocol == "file"

    @property
    def writes_in_flight(self) -> int:
        """How many objects a writer keeps in flight here: a disk's cores, more for a bucket (the backend's)."""
        return self.backend.writes_in_flight

    @staticmethod
    def _check_rel(rel: str) -> list[str]:
        if not isinstance(rel, str):
            raise TypeError(f"relative path must be a str, not {type(rel).__name__}")
        if rel == "":
            return []
        parts = rel.split("/")
        if rel.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in rel:
            raise ValueError(f"{rel!r}: not a plain relative path ('a/b/c', no '..', no leading or double '/')")
        return parts

    def child(self, rel: str) -> Storage:
        """The Storage rooted at `rel` under this one (same backend, clock and retry settings)."""
        parts = self._check_rel(rel)
        new = object.__new__(Storage)
        new.__dict__.update(self.__dict__)
        if parts:
            new._root = self.path(rel)
            new.url = new._root if self.is_local else f"{self.protocol}://{new._root}"
        return new

    def path(self, rel: str = "") -> str:
        """The backend path of `rel`: a local path, or `bucket/key` for an object store."""
        parts = self._check_rel(rel)
        if not parts:
            return self._root
        if self.is_local:
            return os.path.join(self._root, *parts)
        return f"{self._root}/{'/'.join(parts)}"

    def url_of(self, rel: str = "") -> str:
        parts = self._check_rel(rel)
        return self.url if not parts else f"{self.url}/{'/'.join(parts)}"

    def _retry(self, op: str, rel: str, fn: Callable[[], T]) -> T:
        """Run fn, retrying transient errors; anything else, or the last failure, as a StorageError."""
        start = self.clock.monotonic()
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except StorageError:
                raise
            except Exception as e:
                transient = is_transient(e)
                if not transient or attempt >= self.attempts:
                    elapsed = self.clock.monotonic() - start
                    raise self._error(op, rel, e, attempt if transient else 0, elapsed) from e
                delay = min(self.backoff_cap, self.backoff * (2 ** (attempt - 1)))
                delay = delay / 2 + random.uniform(0, delay / 2)  # jitter: workers don't retry in lockstep
                log.warning("storage: %s %s failed (%s); retry %d/%d in %.1fs", op, redact(self.url_of(rel)),
                            describe(e), attempt, self.attempts - 1, delay)
                self.clock.sleep(delay)
        raise AssertionError("unreachable")

    def _error(self, op: str, rel: str, e: BaseException, attempts: int, elapsed: float) -> StorageError:
        url = redact(self.url_of(rel))
        writing = op in ("write", "create", "delete")
        if isinstance(e, (TypeError, AttributeError, NameError, AssertionError, RecursionError)):
            raise e  # a bug, not a storage problem: keep the traceback
        if isinstance(e, FileNotFoundError):
            if writing and not self.is_local:
                reason = f"bucket {self.bucket!r} does not exist or is not accessible; create it or fix the URL"
                return StorageNotFoundError(f"cannot {op} {url}: {reason}", url, reason)
            if writing:  # a local write's directory vanished under it (made just before)
                return StorageError(f"cannot {op} {url}: {describe(e)}", url, describe(e))
            return StorageNotFoundError(f"{url}: not found", url, "not found")
        if isinstance(e, BlockedPath):
            return StorageError(f"cannot {op} {url}: {e}", url, str(e))
        if isinstance(e, PermissionError) or (isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM)):
            reason = f"permission denied ({describe(e)})"
            return StorageError(f"cannot {op} {url}: {reason}", url, reason)
        if isinstance(e, OSError) and e.errno == errno.EROFS:
            return StorageError(f"cannot {op} {url}: read-only file system", url, "read-only file system")
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            reason = "no space left on device" if e.errno == errno.ENOSPC else "disk quota exceeded"
            return StorageFull(f"cannot {op} {url}: {reason}; nothing half-written was kept: make room (or give "
                               "another --out) and rerun the same command to resume", url, reason)
        if not attempts:
            return StorageError(f"cannot {op} {url}: {describe(e)}", url, describe(e))
        return StorageUnreachable(f"cannot {op} {url}: {describe(e)} (gave up after {attempts} attempts over "
                                  f"{elapsed:.1f}s); rerun the same command to resume", url, describe(e))

    # --- reads ------------------------------------------------------------------------------------------

    def read_bytes(self, rel: str) -> bytes:
        path = self.path(rel)
        return self._retry("read", rel, lambda: self.backend.read(path))

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file: one ranged GET on GCS/S3, a seek and read locally (shorter at EOF)."""
        path = self.path(rel)
        return self._retry("read", rel, lambda: self.backend.read_range(path, start, end))

    def read_json(self, rel: str) -> Any:
        data = self.read_bytes(rel)
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StorageError(f"{redact(self.url_of(rel))}: not valid JSON ({e})", self.url_of(rel)) from None

    def read_versioned(self, rel: str) -> Versioned | None:
        """`rel`'s bytes and the token that `replace_if` compares against; None if it does not exist."""
        path = self.path(rel)

        def read() -> Versioned | None:
            try:
                return self.backend.read_versioned(path)
            except FileNotFoundError:
                return None
        return self._retry("read", rel, read)

    def exists(self, rel: str = "") -> bool:
        """A file, or a directory (something under it)."""
        path = self.path(rel)
        return self._retry("check", rel, lambda: self.backend.exists(path))

    def size(self, rel: str) -> int:
        path = self.path(rel)
        return self._retry("stat", rel, lambda: self.backend.size(path))

    def listdir(self, rel: str = "") -> list[str]:
        """Names directly under `rel` (files and directories), sorted; [] if there is no such directory."""
        path = self.path(rel)
        return self._retry("list", rel, lambda: sorted(self.backend.listdir(path)))

    @contextlib.contextmanager
    def open_binary(self, rel: str) -> Iterator[io.BufferedReader]:
        """A buffered binary reader for streaming a big file. A transient failure, at the open or
        mid-stream, reopens the file at the current offset (with the usual retries)."""
        path = self.path(rel)
        raw = ReopeningReader(lambda: self.size(rel), lambda op, fn: self._retry(op, rel, fn),
                              lambda pos: self.backend.open_read(path, pos))
        with io.BufferedReader(raw, buffer_size=2**20) as f:
            yield f

    @contextlib.contextmanager
    def open_text(self, rel: str, encoding: str = "utf-8") -> Iterator[io.TextIOBase]:
        """A text reader for streaming line by line (`for line in f`); see open_binary for retries."""
        with self.open_binary(rel) as b, io.TextIOWrapper(b, encoding=encoding) as t:
            yield t

    # --- writes -----------------------------------------------------------------------------------------

    def write_bytes(self, rel: str, data: Buffer | list[Buffer]) -> None:
        """Write `rel` whole: a reader sees the old content, or the new, never a part (retried as needed).
        `data` may be a list of parts written one after another (a local file never joins them in memory)."""
        path = self.path(rel)
        parts = data if isinstance(data, list) else [data]
        self._retry("write", rel, lambda: self.backend.write(path, parts))

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, json_bytes(obj))

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[Any]:
        """A binary file to stream a large object into: it lands whole when the block exits without an
        error, and not at all otherwise. Local: a temp file, synced, then renamed; GCS/S3: a resumable or
        multipart upload, finalised at close. Not retried midway (a stream cannot be replayed): a failure
        is a StorageError and the caller starts over."""
        path = self.path(rel)
        try:
            upload = self.backend.open_write(path)
        except Exception as e:
            raise self._error("write", rel, e, 0, 0.0) from e
        try:
            yield upload
            upload.commit()
        except BaseException as e:
            with contextlib.suppress(Exception):
                upload.discard()
            if isinstance(e, Exception) and not isinstance(e, StorageError):
                raise self._error("write", rel, e, 0, 0.0) from e
            raise

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create `rel` with `data` only if it does not exist. True: we created it (content complete when
        visible); False: it already existed (left untouched). The store decides, atomically.

        A retried attempt whose earlier try may have landed unseen (connection cut after the server committed)
        reads the object back: the same bytes mean it was ours, so `data` must be unique to the caller."""
        path, payload = self.path(rel), bytes(data)
        return self._conditional("create", rel, lambda: self.backend.create(path, payload), payload)

    def replace_if(self, rel: str, data: bytes, token: str) -> bool:
        """Compare-and-swap: write `data` to `rel` only if it still is the version `token` names
        (from `read_versioned`). True: replaced; False: it changed or vanished since (left untouched).

        Local: the directory is locked (flock) while the bytes are compared and the file atomically
        replaced. GCS: an upload with `ifGenerationMatch=<generation>`. S3: a PUT with `If-Match: <ETag>`.
        Small objects only (leases, markers). A lost reply is told as in create_exclusive."""
        path, payload = self.path(rel), bytes(data)
        return self._conditional("replace", rel, lambda: self.backend.replace(path, payload, token), payload)

    def _conditional(self, op: str, rel: str, write: Callable[[], None], payload: bytes) -> bool:
        """Run a conditional write with retries. When the condition fails after an earlier try of this call
        failed without an answer, that try may have landed: the object then holds our bytes."""
        unanswered = False

        def attempt() -> bool:
            nonlocal unanswered
            try:
                write()
                return True
            except PreconditionFailed:
                if not unanswered:
                    return False
                try:
                    return self.backend.read(self.path(rel)) == payload
                except FileNotFoundError:
                    return False
            except Exception:
                unanswered = True
                raise
        return self._retry(op, rel, attempt)

    # --- deletes ----------------------------------------------------------------------------------------

    def remove_stale_temps(self, rel: str = "", of: str | None = None) -> list[str]:
        """Delete the temp files that writes cut short (a killed process) left directly under `rel` (local storage
        only: an object store lists no unfinished upload). Call it only on a directory no other live process writes
        into (a stream directory under this worker's lease); this process's own writes are spared. `of` names a file
        of `rel` written only by `create_exclusive` (run.json): then only its temps go, and only once it exists,
        in any directory. No create of it can succeed any more, and one whose temp went answers False. Returns
        the names removed."""
        path = self.path(rel)
        return self._retry("delete", rel, lambda: self.backend.remove_stale_temps(path, of))

    def delete(self, rel: str) -> None:
        """Delete the file `rel`; a missing file is fine."""
        path = self.path(rel)
        self._retry("delete", rel, lambda: self.backend.delete([path]))

    def delete_many(self, rels: Iterable[str]) -> None:
        """Delete these files; missing ones are fine. On an object store in batched requests (S3: 1,000 names
        a request; GCS: 100), not a round trip per file."""
        rels = list(rels)
        if rels:
            paths = [self.path(rel) for rel in rels]
            what = rels[0] if len(rels) == 1 else f"{rels[0]} and {len(rels) - 1} more"
            self._retry("delete", what, lambda: self.backend.delete(paths))

    def remove_empty_dir(self, rel: str = "") -> bool:
        """Remove the local directory `rel` if it is empty (rmdir: never anything in it); whether it is gone. An
        object store has no directories: True there once nothing lies under `rel`."""
        path = self.path(rel)
        if not self.is_local:
            return not self.listdir(rel)
        try:
            os.rmdir(path)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return True

    def delete_tree(self, rel: str) -> None:
        """Delete `rel` and everything under it; what is missing is fine. On an object store: one listing and
        batched deletes, which is what keeps a checkpoint's prune from stalling the next save."""
        path = self.path(rel)
        self._retry("delete", rel, lambda: self.backend.delete_tree(path))
