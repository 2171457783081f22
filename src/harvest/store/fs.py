"""Storage: one root URL (a local path, gs://bucket/prefix, s3://bucket/prefix) and the few operations
harvest needs on it, with retries on transient errors and atomic writes.

Paths given to the methods are relative, '/'-separated, under the root (`stream_00003/shard_000012.json`).

- A write either lands whole or not at all: locally a temp file in the same directory, fsync, rename;
  on GCS/S3 a single-object upload (GCS: a media upload below 50 MB, resumable above; S3: a PUT, multipart
  above 100 MB) becomes visible only when complete.
- `create_exclusive` creates an object only if absent: O_EXCL (via link(2)) locally, `ifGenerationMatch=0`
  on GCS, `If-None-Match: *` on S3.
- Transient errors (connection refused/reset, timeouts, HTTP 408/429/5xx) are retried here, in one place,
  with exponential backoff and jitter; gcsfs's, s3fs's and botocore's own retry loops are turned off so the
  budget is the one set on the class. Anything else (not found, permission, 4xx) is not retried.
- Every failure surfaces as `StorageError` (a `UserError`: one line naming the URL and what happened);
  a missing file as `StorageNotFoundError`, which is also a `FileNotFoundError`.

Endpoints and credentials come from the environment, as for any gcsfs/s3fs user: `STORAGE_EMULATOR_HOST`
(GCS emulator), `AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_DEFAULT_REGION` /
`AWS_REGION`, Google application-default credentials.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from harvest.store.backends import custom_endpoint, gcs_filesystem, s3_filesystem
from harvest.store.errors import (
    StorageError,
    StorageNotFoundError,
    StorageUnreachable,
    describe,
    is_transient,
    redact,
)
from harvest.store.records import json_bytes

__all__ = ["Storage", "StorageError", "StorageNotFoundError", "Versioned", "is_transient"]

log = logging.getLogger(__name__)

T = TypeVar("T")
Buffer = Any  # anything with the buffer protocol: bytes, memoryview, a contiguous numpy array

_URL = re.compile(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$")
_LOCAL_SCHEMES = ("", "file", "local")
_OBJECT_SCHEMES = ("gs", "gcs", "s3", "s3a")
_TMP_MARK = ".harvest-tmp-"  # local temp files carry this; listdir hides them

class Storage:
    """Files under one root URL. See the module docstring."""

    attempts = 6  # tries per operation (1 = no retry)
    backoff = 0.2  # seconds before the first retry; doubles each time
    backoff_cap = 10.0  # longest single wait

    def __init__(self, url: str, *, attempts: int | None = None, backoff: float | None = None,
                 backoff_cap: float | None = None, exclusive_precheck: bool | None = None):
        """`attempts`, `backoff`, `backoff_cap`: the retry budget (see the class attributes).
        `exclusive_precheck`: before a conditional create, also check that the object is absent. None
        (default): only against a custom endpoint, STORAGE_EMULATOR_HOST or AWS_ENDPOINT_URL, where the
        server may ignore the precondition (see create_exclusive)."""
        if not isinstance(url, str) or not url.strip():
            raise StorageError(f"{url!r}: not a storage URL; give a local path, gs://bucket/prefix or s3://bucket/prefix")
        url = url.strip()
        if attempts is not None:
            self.attempts = max(1, int(attempts))
        if backoff is not None:
            self.backoff = float(backoff)
        if backoff_cap is not None:
            self.backoff_cap = float(backoff_cap)
        self._exclusive_precheck = exclusive_precheck
        m = _URL.match(url)
        scheme = m.group(1).lower() if m else ""
        if scheme in _LOCAL_SCHEMES:
            path = m.group(2) if m else url
            self.protocol = "file"
            self._root = os.path.abspath(os.path.expanduser(path))
            if len(self._root) > 1:
                self._root = self._root.rstrip(os.sep)
            self.url = self._root
        elif scheme in _OBJECT_SCHEMES:
            self.protocol = "gs" if scheme in ("gs", "gcs") else "s3"
            rest = m.group(2).strip("/")
            rest = rest.split("@", 1)[1] if "@" in rest.split("/", 1)[0] else rest  # no credentials in URLs
            if not rest:
                raise StorageError(f"{redact(url)}: no bucket in the URL; use {scheme}://bucket/prefix")
            self._root = rest
            self.bucket = rest.split("/", 1)[0]
            self.url = f"{self.protocol}://{rest}"
        else:
            raise StorageError(f"{redact(url)}: unsupported URL scheme {scheme!r}; use a local path, gs:// or s3://")

    @staticmethod
    def supports(url: str) -> bool:
        """Whether `url` is one Storage takes: a local path (or file://), gs:// or s3://."""
        m = _URL.match(url.strip())
        return (m.group(1).lower() if m else "") in _LOCAL_SCHEMES + _OBJECT_SCHEMES

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
    def fs(self) -> Any:
        """The fsspec filesystem behind an object-store root (None for local)."""
        if self.protocol == "gs":
            return gcs_filesystem()
        if self.protocol == "s3":
            return s3_filesystem()
        return None

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
        """The Storage rooted at `rel` under this one (same retry settings)."""
        parts = self._check_rel(rel)
        new = object.__new__(Storage)
        new.__dict__.update(self.__dict__)
        if parts:
            if self.is_local:
                new._root = os.path.join(self._root, *parts)
                new.url = new._root
            else:
                new._root = f"{self._root}/{'/'.join(parts)}"
                new.url = f"{self.protocol}://{new._root}"
        return new

    def path(self, rel: str = "") -> str:
        """The backend path of `rel`: a local path, or `bucket/key` for the fsspec filesystem."""
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
        start = time.monotonic()
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except StorageError:
                raise
            except Exception as e:
                transient = is_transient(e)
                if not transient or attempt >= self.attempts:
                    raise self._error(op, rel, e, attempt if transient else 0, time.monotonic() - start) from e
                delay = min(self.backoff_cap, self.backoff * (2 ** (attempt - 1)))
                delay = delay / 2 + random.uniform(0, delay / 2)  # jitter: workers don't retry in lockstep
                log.warning("storage: %s %s failed (%s); retry %d/%d in %.1fs", op, redact(self.url_of(rel)),
                            describe(e), attempt, self.attempts - 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _error(self, op: str, rel: str, e: BaseException, attempts: int, elapsed: float) -> StorageError:
        url = redact(self.url_of(rel))
        writing = op in ("write", "create", "delete")
        if isinstance(e, (TypeError, AttributeError, NameError, AssertionError, RecursionError)):
            raise e  # a bug, not a storage problem: keep the traceback
        if isinstance(e, FileNotFoundError):
            if writing and not self.is_local:
                return StorageNotFoundError(
                    f"cannot {op} {url}: bucket {self.bucket!r} does not exist or is not accessible; "
                    "create it or fix the URL", url)
            return StorageNotFoundError(f"{url}: not found", url)
        if isinstance(e, (NotADirectoryError, FileExistsError)) and self.is_local and writing:
            blocker = self._file_in_the_way(self.path(rel))
            if blocker:
                return StorageError(f"cannot {op} {url}: {blocker} is a file, not a directory", url)
        if isinstance(e, PermissionError) or (isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM)):
            return StorageError(f"cannot {op} {url}: permission denied ({describe(e)})", url)
        if isinstance(e, OSError) and e.errno == errno.EROFS:
            return StorageError(f"cannot {op} {url}: read-only file system", url)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return StorageError(f"cannot {op} {url}: no space left on device", url)
        if not attempts:
            return StorageError(f"cannot {op} {url}: {describe(e)}", url)
        return StorageUnreachable(f"cannot {op} {url}: {describe(e)} (gave up after {attempts} attempts over "
                                  f"{elapsed:.1f}s); rerun the same command to resume", url)

    def _file_in_the_way(self, path: str) -> str | None:
        p = os.path.dirname(path)
        while p and p != os.path.dirname(p):
            if os.path.exists(p):
                return p if not os.path.isdir(p) else None
            p = os.path.dirname(p)
        return None

    # --- reads ------------------------------------------------------------------------------------------

    def read_bytes(self, rel: str) -> bytes:
        path = self.path(rel)
        if self.is_local:
            def read() -> bytes:
                with open(path, "rb") as f:
                    return f.read()
            return self._retry("read", rel, read)
        fs = self.fs
        return self._retry("read", rel, lambda: fs.cat_file(path))

    def read_range(self, rel: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file: one ranged GET on GCS/S3, a seek and read locally (shorter at EOF)."""
        path = self.path(rel)
        if self.is_local:
            def read() -> bytes:
                with open(path, "rb") as f:
                    f.seek(start)
                    return f.read(end - start)
            return self._retry("read", rel, read)
        fs = self.fs
        return self._retry("read", rel, lambda: fs.cat_file(path, start=start, end=end))

    def read_json(self, rel: str) -> Any:
        data = self.read_bytes(rel)
        try:
            return json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise StorageError(f"{redact(self.url_of(rel))}: not valid JSON ({e})", self.url_of(rel)) from None

    def exists(self, rel: str = "") -> bool:
        path = self.path(rel)
        if self.is_local:
            return os.path.exists(path)
        fs = self.fs

        def probe() -> bool:
            fs.invalidate_cache()  # see other processes' writes
            try:
                fs.info(path)
                return True
            except FileNotFoundError:
                return False
        return self._retry("check", rel, probe)

    def size(self, rel: str) -> int:
        path = self.path(rel)
        if self.is_local:
            return self._retry("stat", rel, lambda: os.stat(path).st_size)
        fs = self.fs

        def size() -> int:
            fs.invalidate_cache()
            return int(fs.info(path)["size"])
        return self._retry("stat", rel, size)

    def listdir(self, rel: str = "") -> list[str]:
        """Names directly under `rel` (files and directories), sorted; [] if there is no such directory."""
        path = self.path(rel)
        if self.is_local:
            def ls() -> list[str]:
                try:
                    return sorted(n for n in os.listdir(path) if _TMP_MARK not in n)
                except (FileNotFoundError, NotADirectoryError):
                    return []
            return self._retry("list", rel, ls)
        fs = self.fs
        here = path.rstrip("/")

        def ls() -> list[str]:
            fs.invalidate_cache()
            try:
                entries = fs.ls(here, detail=True)
            except FileNotFoundError:
                return []
            names = set()
            for entry in entries:
                name = entry["name"].rstrip("/")
                if name == here or not name.startswith(here + "/"):
                    continue  # `here` is a file, or a placeholder object for the directory itself
                names.add(name[len(here) + 1:].split("/", 1)[0])
            return sorted(n for n in names if n)
        return self._retry("list", rel, ls)

    @contextlib.contextmanager
    def open_binary(self, rel: str) -> Iterator[io.BufferedReader]:
        """A buffered binary reader for streaming a big file. On object stores a transient failure, at
        the open or mid-stream, reopens the object at the current offset (with the usual retries)."""
        path = self.path(rel)
        if self.is_local:
            f = self._retry("open", rel, lambda: open(path, "rb"))  # noqa: SIM115 - closed by the with below
            with f:
                yield f
            return
        fs = self.fs

        def opener(pos: int) -> Any:
            f = fs.open(path, "rb", block_size=8 * 2**20, cache_type="readahead")
            if pos:
                f.seek(pos)
            return f
        raw = _ReopeningReader(self, rel, opener)
        with io.BufferedReader(raw, buffer_size=2**20) as f:
            yield f

    @contextlib.contextmanager
    def open_text(self, rel: str, encoding: str = "utf-8") -> Iterator[io.TextIOBase]:
        """A text reader for streaming line by line (`for line in f`); see open_binary for retries."""
        if self.is_local:
            path = self.path(rel)
            f = self._retry("open", rel, lambda: open(path, encoding=encoding))  # noqa: SIM115 - as above
            with f:
                yield f
            return
        with self.open_binary(rel) as b, io.TextIOWrapper(b, encoding=encoding) as t:
            yield t

    # --- writes -----------------------------------------------------------------------------------------

    def write_bytes(self, rel: str, data: Buffer | list[Buffer]) -> None:
        """Write `rel` whole: a reader sees the old content, or the new, never a part (retried as needed).
        `data` may be a list of parts written one after another (a local file never joins them in memory)."""
        self._check_rel(rel)
        parts = data if isinstance(data, list) else [data]
        if self.is_local:
            self._retry("write", rel, lambda: self._local_write(self.path(rel), parts))
            return
        fs, path = self.fs, self.path(rel)
        payload = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        # One object PUT (or a resumable/multipart upload, finalised at the end): atomic by itself.
        self._retry("write", rel, lambda: self._put(fs, path, payload, create=False))

    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[Any]:
        """A binary file to stream a large object into: it lands whole when the block exits without an
        error, and not at all otherwise. Local: a temp file, synced, then renamed; GCS/S3: a resumable or
        multipart upload, finalised at close. Not retried midway (a stream cannot be replayed): a failure
        is a StorageError and the caller starts over."""
        self._check_rel(rel)
        path = self.path(rel)
        try:
            if self.is_local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = self._tmp_name(path)
                f = open(tmp, "xb")  # noqa: SIM115 - closed below, on both paths
            else:
                f = self.fs.open(path, "wb")
        except Exception as e:
            raise self._error("write", rel, e, 0, 0.0) from e
        try:
            yield f
            if self.is_local:
                f.flush()
                os.fsync(f.fileno())
                f.close()
                os.replace(tmp, path)
                self._fsync_dir(os.path.dirname(path))
            else:
                f.close()  # the upload is finalised here
        except BaseException as e:
            if self.is_local:
                f.close()
                with contextlib.suppress(OSError):
                    os.remove(tmp)
            elif hasattr(f, "discard"):
                with contextlib.suppress(Exception):
                    f.discard()  # an unfinished upload never becomes an object
            if isinstance(e, Exception) and not isinstance(e, StorageError):
                raise self._error("write", rel, e, 0, 0.0) from e
            raise

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, json_bytes(obj))

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create `rel` with `data` only if it does not exist. True: we created it (content complete when
        visible); False: it already existed (left untouched).

        Local: the data goes to a temp file first, then link(2) to the final name, which fails if it exists.
        GCS: an upload with `ifGenerationMatch=0`; S3: a PUT with `If-None-Match: *`; both atomic on the
        real services. A retried attempt whose earlier try may have landed unseen (connection cut after
        the server committed) reads the object back: same bytes means it was ours. So `data` should be
        unique to the caller (a lease carries worker, host, pid, time).
        """
        self._check_rel(rel)
        payload = data if isinstance(data, bytes) else bytes(data)
        if self.is_local:
            return self._retry("create", rel, lambda: self._local_create(self.path(rel), payload))
        fs, path = self.fs, self.path(rel)
        precheck = self._exclusive_precheck
        if precheck is None:
            precheck = custom_endpoint(self.protocol)
        failed_before = False

        def create() -> bool:
            nonlocal failed_before
            try:
                if precheck:
                    # FALLBACK FOR EMULATORS AND S3-COMPATIBLE STORES, explicitly racy: gcp-storage-emulator
                    # (2026.7.19) ignores ifGenerationMatch, and some S3-compatible stores ignore
                    # If-None-Match, so against a custom endpoint we also check before writing. Two writers
                    # can both pass this check; on real GCS / AWS S3 no check is made: the precondition
                    # below decides, atomically.
                    fs.invalidate_cache()
                    try:
                        fs.info(path)
                    except FileNotFoundError:
                        pass
                    else:
                        raise FileExistsError(path)
                self._put(fs, path, payload, create=True)
                return True
            except FileExistsError:  # HTTP 412: the precondition failed, an object is there
                # Ours if an earlier try of this call landed but its reply was lost; else someone else's.
                return failed_before and fs.cat_file(path) == payload
            except Exception:
                failed_before = True
                raise
        return self._retry("create", rel, create)

    def read_versioned(self, rel: str) -> Versioned | None:
        """`rel`'s bytes and the token that `replace_if` compares against; None if it does not exist.

        The token is read before the bytes: when the object changes in between, the bytes are newer than
        the token and a `replace_if` with it fails, which is the safe side.
        """
        path = self.path(rel)
        if self.is_local:
            def read() -> Versioned | None:
                try:
                    with open(path, "rb") as f:
                        data = f.read()
                except FileNotFoundError:
                    return None
                return Versioned(data, hashlib.sha256(data).hexdigest())
            return self._retry("read", rel, read)
        fs = self.fs
        key = "generation" if self.protocol == "gs" else "ETag"

        def read_remote() -> Versioned | None:
            fs.invalidate_cache()
            try:
                token = str(fs.info(path)[key])
                return Versioned(fs.cat_file(path), token)
            except FileNotFoundError:
                return None
        return self._retry("read", rel, read_remote)

    def replace_if(self, rel: str, data: bytes, token: str) -> bool:
        """Compare-and-swap: write `data` to `rel` only if it still is the version `token` names
        (from `read_versioned`). True: replaced; False: it changed or vanished since (left untouched).

        Local: the directory is locked (flock) while the bytes are compared and the file atomically
        replaced. GCS: an upload with `ifGenerationMatch=<generation>`. S3: a PUT with `If-Match: <ETag>`.
        Small objects only (leases, markers): one request, no multipart.
        """
        self._check_rel(rel)
        payload = bytes(data)
        if self.is_local:
            return self._retry("replace", rel, lambda: self._local_replace_if(self.path(rel), payload, token))
        fs, path = self.fs, self.path(rel)

        def swap() -> bool:
            try:
                if self.protocol == "gs":
                    self._gcs_media_upload(fs, path, payload, ifGenerationMatch=token)
                else:
                    bucket, key, _ = fs.split_path(path)
                    fs.call_s3("put_object", Bucket=bucket, Key=key, Body=payload, IfMatch=token)
                return True
            except (FileExistsError, FileNotFoundError):  # 412 precondition failed / 404 gone
                return False
            except Exception as e:
                if _precondition_failed(e):
                    return False
                raise
            finally:
                fs.invalidate_cache()
        return self._retry("replace", rel, swap)

    _GCS_MEDIA_MAX = 50 * 2**20  # gcsfs's own switch to resumable uploads

    def _put(self, fs: Any, path: str, payload: bytes, *, create: bool) -> None:
        """One object, whole. `create`: only if absent (FileExistsError otherwise)."""
        if self.protocol == "gs" and 0 < len(payload) < self._GCS_MEDIA_MAX:
            # gcsfs sends small objects as multipart/related with bare-LF delimiters, so an object whose
            # last byte is CR is ambiguous to a CRLF-tolerant parser: the emulator drops that byte (1 in 256
            # binary shards). A media upload sends the bytes as the body, nothing around them.
            self._gcs_media_upload(fs, path, payload, **({"ifGenerationMatch": "0"} if create else {}))
            return
        # gs:// resumable upload (raw chunks, finalised at the end; ifGenerationMatch=0 with mode="create"),
        # s3:// PUT or multipart upload (If-None-Match: * with mode="create").
        fs.pipe_file(path, payload, mode="create" if create else "overwrite")

    @staticmethod
    def _gcs_media_upload(fs: Any, path: str, payload: bytes, **params: str) -> None:
        """One GCS media upload; `ifGenerationMatch` in params makes it conditional (HTTP 412 if not met)."""
        from urllib.parse import quote

        bucket, key, _ = fs.split_path(path)
        fs.call("POST", f"{fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o", data=payload,
                headers={"Content-Type": "application/octet-stream"}, json_out=True,
                uploadType="media", name=key, **params)

    def remove_stale_temps(self, rel: str = "") -> list[str]:
        """Delete the temp files that writes cut short (a killed process) left directly under `rel`.

        Local storage only: an object-store write is one atomic PUT and leaves nothing behind. Call it only on
        a directory no other live process writes into (a stream directory under this worker's lease); this
        process's own writes in flight are spared. Returns the names removed.
        """
        if not self.is_local:
            return []
        path = self.path(rel)
        ours = f"{_TMP_MARK}{os.getpid()}-"

        def sweep() -> list[str]:
            try:
                names = [n for n in os.listdir(path) if _TMP_MARK in n and ours not in n]
            except (FileNotFoundError, NotADirectoryError):
                return []
            for name in names:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(path, name))
            return names
        return self._retry("delete", rel, sweep)

    def delete(self, rel: str) -> None:
        """Delete the file `rel`; a missing file is fine."""
        path = self.path(rel)
        if self.is_local:
            def rm() -> None:
                with contextlib.suppress(FileNotFoundError):
                    os.remove(path)
            self._retry("delete", rel, rm)
            return
        self._delete_paths(rel, lambda: [path])

    def delete_many(self, rels: Iterable[str]) -> None:
        """Delete these files; missing ones are fine. On an object store in batched requests (S3: 1,000 names
        a request; GCS: 100), not a round trip per file."""
        rels = list(rels)
        if self.is_local:
            for rel in rels:
                self.delete(rel)
        elif rels:
            self._delete_paths(rels[0] if len(rels) == 1 else f"{rels[0]} and {len(rels) - 1} more",
                               lambda: [self.path(rel) for rel in rels])

    def delete_tree(self, rel: str) -> None:
        """Delete `rel` and everything under it; what is missing is fine. On an object store: one listing and
        batched deletes, which is what keeps a checkpoint's prune from stalling the next save."""
        path = self.path(rel)
        if self.is_local:
            def rm() -> None:
                if os.path.isdir(path) and not os.path.islink(path):
                    shutil.rmtree(path)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)
            self._retry("delete", rel, rm)
            return
        here = path.rstrip("/")
        self._delete_paths(rel, lambda: [n for n in self.fs.find(here) if n == here or n.startswith(here + "/")])

    def _delete_paths(self, rel: str, paths: Callable[[], list[str]]) -> None:
        """Delete the object-store paths `paths()` lists (listed again on a retry). fsspec's batched `rm`
        expands glob patterns, and names come from storage: one with a glob character (`*?[`) is deleted
        on its own, as the literal name it is."""
        # imported here, with the filesystem: a local run never imports fsspec
        from fsspec.asyn import has_magic

        fs = self.fs

        def rm() -> None:
            fs.invalidate_cache()
            names = paths()
            singles: list[str] = []
            batched: list[str] = []
            for name in names:
                (singles if len(names) == 1 or has_magic(name) else batched).append(name)
            for name in singles:
                with contextlib.suppress(FileNotFoundError):
                    fs.rm_file(name)
            if batched:
                with contextlib.suppress(FileNotFoundError):  # gcsfs, when none of them was there
                    fs.rm(batched)
            fs.invalidate_cache()
        self._retry("delete", rel, rm)

    # --- local helpers ----------------------------------------------------------------------------------

    @staticmethod
    def _tmp_name(path: str) -> str:
        d, base = os.path.split(path)
        return os.path.join(d, f".{base}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:12]}")

    @staticmethod
    def _write_synced(path: str, parts: list[Buffer], mode: str) -> None:
        with open(path, mode) as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def _fsync_dir(d: str) -> None:
        with contextlib.suppress(OSError):
            fd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def _local_write(self, path: str, parts: list[Buffer]) -> None:
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        tmp = self._tmp_name(path)
        try:
            self._write_synced(tmp, parts, "xb")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        self._fsync_dir(d)

    def _local_replace_if(self, path: str, data: bytes, token: str) -> bool:
        """The new bytes are written and synced first; the lock covers only the compare and the rename, so a
        process stopped at a random moment (SIGSTOP, a suspended VM) almost never stops holding it."""
        d = os.path.dirname(path)
        if not os.path.isdir(d):
            return False
        tmp: str | None = self._tmp_name(path)
        try:
            self._write_synced(tmp, [data], "xb")
            fd = os.open(d, os.O_RDONLY)
            try:
                _flock(fd)
                try:
                    with open(path, "rb") as f:
                        current = f.read()
                except FileNotFoundError:
                    return False
                if hashlib.sha256(current).hexdigest() != token:
                    return False
                os.replace(tmp, path)
                tmp = None
            finally:
                os.close(fd)  # releases the lock
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
        self._fsync_dir(d)
        return True

    def _local_create(self, path: str, data: bytes) -> bool:
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        if os.path.lexists(path):
            return False
        tmp = self._tmp_name(path)
        try:
            self._write_synced(tmp, [data], "xb")
            try:
                os.link(tmp, path)  # atomic, and fails if `path` exists: O_EXCL with complete content
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                    raise
                # A filesystem without hard links (some FUSE/SMB mounts): plain O_EXCL. The name is then
                # visible a moment before its content is complete.
                try:
                    self._write_synced(path, [data], "xb")
                except FileExistsError:
                    return False
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        self._fsync_dir(d)
        return True


class _ReopeningReader(io.RawIOBase):
    """A raw reader over an object-store file that reopens at the current offset after a transient error."""

    def __init__(self, storage: Storage, rel: str, opener: Callable[[int], Any]):
        self._storage, self._rel, self._opener = storage, rel, opener
        self._pos = 0
        self._f: Any = None
        self._f = storage._retry("open", rel, lambda: opener(0))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move to `offset` (from the start, here or the end): the next read reopens there."""
        if whence == io.SEEK_CUR:
            offset += self._pos
        elif whence == io.SEEK_END:
            offset += self._storage.size(self._rel)
        if offset != self._pos:
            self._drop()
            self._pos = offset
        return self._pos

    def _drop(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(Exception):
                f.close()

    def readinto(self, b: Any) -> int:
        want = len(b)

        def attempt() -> bytes:
            if self._f is None:
                self._f = self._opener(self._pos)
            try:
                return self._f.read(want)
            except BaseException:
                self._drop()
                raise
        data = self._storage._retry("read", self._rel, attempt)
        n = len(data)
        b[:n] = data
        self._pos += n
        return n

    def close(self) -> None:
        self._drop()
        super().close()


@dataclasses.dataclass(frozen=True)
class Versioned:
    """An object's bytes and its version token (local: sha256; GCS: generation; S3: ETag)."""

    data: bytes
    token: str


def _flock(fd: int, wait_s: float = 5.0) -> None:
    """An exclusive flock on `fd`, waiting at most `wait_s`: the holder's critical section is a read and a
    rename, so a longer wait means a stopped process holds it (a transient error, retried by the caller)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError("the directory lock is held by another process") from None
            time.sleep(0.002)


def _precondition_failed(exc: BaseException) -> bool:
    """HTTP 412 from any layer (s3fs wraps botocore's error in an OSError): the condition did not hold.
    S3's 409 ConditionalRequestConflict, two conditional writes racing, is transient instead: retried."""
    e: BaseException | None = exc
    while e is not None:
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = (response.get("Error") or {}).get("Code")
            if code == "PreconditionFailed" or (response.get("ResponseMetadata") or {}).get("HTTPStatusCode") == 412:
                return True
        if getattr(e, "code", None) == 412 or getattr(e, "status", None) == 412:
            return True
        e = e.__cause__ or e.__context__
    return False
