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
import errno
import io
import json
import logging
import os
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from harvest.errors import UserError

log = logging.getLogger(__name__)

T = TypeVar("T")

_TMP_MARK = ".harvest-tmp-"  # local temp files carry this; listdir hides them


class StorageError(UserError):
    """A storage operation failed for good: the message is one line naming the URL and what happened."""

    def __init__(self, message: str, url: str | None = None):
        super().__init__(message)
        self.url = url


class StorageNotFoundError(StorageError, FileNotFoundError):
    """The file (or the bucket) does not exist."""


# ------------------------------------------------------------------------------------------------------
# which errors are transient


_TRANSIENT_ERRNOS = {
    errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT,
    errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.ENETRESET, errno.EAGAIN,
    getattr(errno, "EREMOTEIO", -1),  # s3fs's translation of HTTP 500 InternalError
}
_TRANSIENT_S3_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                       "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests"}
# Raised for reasons a retry cannot fix (also when caused by a transient error somewhere below).
_NEVER_RETRY = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError,
                ValueError, TypeError, AttributeError, KeyError, NotImplementedError)


def _transient_status(status: Any) -> bool:
    try:
        status = int(status)
    except (TypeError, ValueError):
        return False
    return status in (408, 429) or 500 <= status <= 599


_LIB_TRANSIENT: tuple[type, ...] | None = None


def _library_transient_types() -> tuple[type, ...]:
    """Exception types of the optional libraries that always mean 'the network failed' (imported lazily)."""
    global _LIB_TRANSIENT
    if _LIB_TRANSIENT is None:
        found: list[type] = []
        with contextlib.suppress(ImportError):
            import fsspec.exceptions
            found.append(fsspec.exceptions.FSTimeoutError)
        with contextlib.suppress(ImportError):
            import aiohttp
            found += [aiohttp.ClientConnectionError, aiohttp.ClientPayloadError]
        with contextlib.suppress(ImportError):
            import requests.exceptions as rq
            found += [rq.ConnectionError, rq.Timeout, rq.ChunkedEncodingError]
        with contextlib.suppress(ImportError):
            import google.auth.exceptions as ga
            found += [ga.TransportError]
        with contextlib.suppress(ImportError):
            import gcsfs.retry as gr
            found += [gr.ChecksumError]
        with contextlib.suppress(ImportError):
            import botocore.exceptions as bc
            found += [bc.ConnectionError, bc.HTTPClientError]
            for name in ("ResponseStreamingError", "IncompleteReadError"):
                if hasattr(bc, name):
                    found.append(getattr(bc, name))
        _LIB_TRANSIENT = tuple(found)
    return _LIB_TRANSIENT


def _transient_one(e: BaseException) -> bool:
    if isinstance(e, (ConnectionError, TimeoutError)):  # builtins: reset, refused, aborted, broken pipe
        return True
    if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
        return True
    if isinstance(e, _library_transient_types()):
        return True
    status = getattr(e, "status", None)  # aiohttp.ClientResponseError
    if status is None and type(e).__name__ == "HttpError":  # gcsfs.retry.HttpError
        status = getattr(e, "code", None)
    if status is not None and _transient_status(status):
        return True
    response = getattr(e, "response", None)  # botocore ClientError
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata") or {}
        code = (response.get("Error") or {}).get("Code")
        if _transient_status(meta.get("HTTPStatusCode")) or code in _TRANSIENT_S3_CODES:
            return True
    return False


def is_transient(exc: BaseException) -> bool:
    """True when `exc` (or what caused it) is a network failure or an HTTP 408/429/5xx: worth a retry."""
    if isinstance(exc, _NEVER_RETRY):
        return False
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if _transient_one(e):
            return True
        e = e.__cause__ or e.__context__
    return False


# ------------------------------------------------------------------------------------------------------
# messages


def _redact(text: str) -> str:
    """Drop `user:secret@` from any URL in `text`."""
    return re.sub(r"(//)[^/@\s]*@", r"\1", text)


def _describe(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        what = "connection refused"
    elif isinstance(e, ConnectionResetError):
        what = "connection reset"
    else:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        what = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    what = _redact(what)
    return what if len(what) <= 300 else what[:297] + "..."


# ------------------------------------------------------------------------------------------------------
# filesystems (one per protocol + endpoint + process, shared by every Storage on it)


_FS_CACHE: dict[tuple, Any] = {}
_FS_LOCK = threading.Lock()


def _gcs_filesystem() -> Any:
    env = os.environ
    emulator = _custom_endpoint("gs")
    zonal = env.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
    key = ("gs", env.get("STORAGE_EMULATOR_HOST"), zonal, env.get("GOOGLE_APPLICATION_CREDENTIALS"), os.getpid())
    with _FS_LOCK:
        if key in _FS_CACHE:
            return _FS_CACHE[key]
        try:
            import aiohttp
            import gcsfs
            import gcsfs.core
        except ImportError as e:
            raise StorageError(f"gs:// needs gcsfs ({e}); pip install 'harvest[gcs]'") from None
        # gcsfs's zonal/HNS support (the default) probes each bucket over gRPC, which an emulator does not
        # serve (a minute per bucket): there, unless the user asked for it, use the plain JSON-API class.
        if (zonal is not None and zonal.lower() not in ("true", "1")) or (emulator and zonal is None):
            base = gcsfs.core.GCSFileSystem
        else:
            base = gcsfs.GCSFileSystem
        # gcsfs retries inside every HTTP request (6 tries, up to ~30 s of sleeps, a logged traceback each
        # time it gives up) with no knob per instance; retries are done once, here, instead.
        raw_request = getattr(gcsfs.core.GCSFileSystem._request, "__wrapped__", None)
        attrs: dict[str, Any] = {}
        if raw_request is not None:
            async def _request(self, *args, **kwargs):
                return await raw_request(self, *args, **kwargs)
            attrs["_request"] = _request
        else:  # another gcsfs: its retries then add to ours
            log.debug("gcsfs has no unwrapped _request; its own retries stay on")
        cls = type("HarvestGCSFileSystem", (base,), attrs)
        options: dict[str, Any] = {
            "skip_instance_cache": True,
            "use_listings_cache": False,
            "requests_timeout": aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=120),
        }
        if emulator:
            options["token"] = "anon"  # emulators take no credentials; skips the metadata-server probe
        fs = cls(**options)
        _FS_CACHE[key] = fs
        return fs


def _s3_filesystem() -> Any:
    env = os.environ
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None
    key = ("s3", endpoint, region, env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_PROFILE"), os.getpid())
    with _FS_LOCK:
        if key in _FS_CACHE:
            return _FS_CACHE[key]
        try:
            import s3fs
        except ImportError as e:
            raise StorageError(f"s3:// needs s3fs ({e}); pip install 'harvest[s3]'") from None
        client_kwargs: dict[str, Any] = {}
        if endpoint:  # botocore reads AWS_ENDPOINT_URL itself too; explicit here so the cache key is honest
            client_kwargs["endpoint_url"] = endpoint
        if region:  # botocore reads only AWS_DEFAULT_REGION
            client_kwargs["region_name"] = region
        fs = s3fs.S3FileSystem(
            skip_instance_cache=True,
            use_listings_cache=False,
            client_kwargs=client_kwargs,
            # botocore's own retry loop off: retries are done here (see Storage.attempts).
            config_kwargs={"connect_timeout": 10, "read_timeout": 120,
                           "retries": {"total_max_attempts": 1, "mode": "standard"}},
        )
        fs.retries = 1  # s3fs's retry loop off, likewise
        _FS_CACHE[key] = fs
        return fs


def _custom_endpoint(protocol: str) -> bool:
    """True when the environment points `protocol` at an emulator or an S3-compatible store."""
    env = os.environ
    if protocol == "gs":
        return env.get("STORAGE_EMULATOR_HOST", "") not in ("", "default")
    if protocol == "s3":
        return bool(env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL"))
    return False


# ------------------------------------------------------------------------------------------------------


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
        m = re.match(r"^([a-zA-Z][a-zA-Z0-9+.-]*)://(.*)$", url)
        scheme = m.group(1).lower() if m else ""
        if scheme in ("", "file", "local"):
            path = m.group(2) if m else url
            self.protocol = "file"
            self._root = os.path.abspath(os.path.expanduser(path))
            if len(self._root) > 1:
                self._root = self._root.rstrip(os.sep)
            self.url = self._root
        elif scheme in ("gs", "gcs", "s3", "s3a"):
            self.protocol = "gs" if scheme in ("gs", "gcs") else "s3"
            rest = m.group(2).strip("/")
            rest = rest.split("@", 1)[1] if "@" in rest.split("/", 1)[0] else rest  # no credentials in URLs
            if not rest:
                raise StorageError(f"{_redact(url)}: no bucket in the URL; use {scheme}://bucket/prefix")
            self._root = rest
            self.bucket = rest.split("/", 1)[0]
            self.url = f"{self.protocol}://{rest}"
        else:
            raise StorageError(f"{_redact(url)}: unsupported URL scheme {scheme!r}; use a local path, gs:// or s3://")

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
            return _gcs_filesystem()
        if self.protocol == "s3":
            return _s3_filesystem()
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
                log.warning("storage: %s %s failed (%s); retry %d/%d in %.1fs", op, _redact(self.url_of(rel)),
                            _describe(e), attempt, self.attempts - 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _error(self, op: str, rel: str, e: BaseException, attempts: int, elapsed: float) -> StorageError:
        url = _redact(self.url_of(rel))
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
            return StorageError(f"cannot {op} {url}: permission denied ({_describe(e)})", url)
        if isinstance(e, OSError) and e.errno == errno.EROFS:
            return StorageError(f"cannot {op} {url}: read-only file system", url)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return StorageError(f"cannot {op} {url}: no space left on device", url)
        tail = f" (gave up after {attempts} attempts over {elapsed:.1f}s)" if attempts else ""
        return StorageError(f"cannot {op} {url}: {_describe(e)}{tail}", url)

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
            raise StorageError(f"{_redact(self.url_of(rel))}: not valid JSON ({e})", self.url_of(rel)) from None

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

    def write_bytes(self, rel: str, data: bytes | bytearray | memoryview) -> None:
        """Write `rel` whole: a reader sees the old content, or the new, never a part (retried as needed)."""
        self._check_rel(rel)
        if self.is_local:
            self._retry("write", rel, lambda: self._local_write(self.path(rel), data))
            return
        fs, path = self.fs, self.path(rel)
        payload = data if isinstance(data, bytes) else bytes(data)
        # One object PUT (or a resumable/multipart upload, finalised at the end): atomic by itself.
        self._retry("write", rel, lambda: self._put(fs, path, payload, create=False))

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, _json_bytes(obj))

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
            precheck = _custom_endpoint(self.protocol)
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

    _GCS_MEDIA_MAX = 50 * 2**20  # gcsfs's own switch to resumable uploads

    def _put(self, fs: Any, path: str, payload: bytes, *, create: bool) -> None:
        """One object, whole. `create`: only if absent (FileExistsError otherwise)."""
        if self.protocol == "gs" and 0 < len(payload) < self._GCS_MEDIA_MAX:
            # gcsfs sends small objects as multipart/related with bare-LF delimiters, so an object whose
            # last byte is CR is ambiguous to a CRLF-tolerant parser: the emulator drops that byte (1 in 256
            # binary shards). A media upload sends the bytes as the body, nothing around them.
            from urllib.parse import quote

            bucket, key, _ = fs.split_path(path)
            params: dict[str, Any] = {"uploadType": "media", "name": key}
            if create:
                params["ifGenerationMatch"] = "0"  # create only if absent: HTTP 412 -> FileExistsError
            fs.call("POST", f"{fs._location}/upload/storage/v1/b/{quote(bucket, safe='')}/o", data=payload,
                    headers={"Content-Type": "application/octet-stream"}, json_out=True, **params)
            return
        # gs:// resumable upload (raw chunks, finalised at the end; ifGenerationMatch=0 with mode="create"),
        # s3:// PUT or multipart upload (If-None-Match: * with mode="create").
        fs.pipe_file(path, payload, mode="create" if create else "overwrite")

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
        fs = self.fs

        def rm() -> None:
            try:
                fs.rm_file(path)
            except FileNotFoundError:
                pass
            fs.invalidate_cache()
        self._retry("delete", rel, rm)

    # --- local helpers ----------------------------------------------------------------------------------

    @staticmethod
    def _tmp_name(path: str) -> str:
        d, base = os.path.split(path)
        return os.path.join(d, f".{base}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:12]}")

    @staticmethod
    def _write_synced(path: str, data: bytes | bytearray | memoryview, mode: str) -> None:
        with open(path, mode) as f:
            f.write(data)
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

    def _local_write(self, path: str, data: bytes | bytearray | memoryview) -> None:
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        tmp = self._tmp_name(path)
        try:
            self._write_synced(tmp, data, "xb")
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        self._fsync_dir(d)

    def _local_create(self, path: str, data: bytes) -> bool:
        d = os.path.dirname(path)
        os.makedirs(d, exist_ok=True)
        if os.path.lexists(path):
            return False
        tmp = self._tmp_name(path)
        try:
            self._write_synced(tmp, data, "xb")
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
                    self._write_synced(path, data, "xb")
                except FileExistsError:
                    return False
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        self._fsync_dir(d)
        return True


def _json_bytes(obj: Any) -> bytes:
    return (json.dumps(obj, sort_keys=True, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


class _ReopeningReader(io.RawIOBase):
    """A raw reader over an object-store file that reopens at the current offset after a transient error."""

    def __init__(self, storage: Storage, rel: str, opener: Callable[[int], Any]):
        self._storage, self._rel, self._opener = storage, rel, opener
        self._pos = 0
        self._f: Any = None
        self._f = storage._retry("open", rel, lambda: opener(0))

    def readable(self) -> bool:
        return True

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
