"""Storage failures: which errors are transient (worth a retry), and the one-line errors users see.

Transient: connection refused/reset/aborted, timeouts, HTTP 408/429/5xx and the network exceptions of
gcsfs, s3fs, aiohttp, requests and botocore (found through `__cause__`/`__context__` too). Every failure
reaches callers as `StorageError` (a `UserError`: one line naming the URL), a missing file as
`StorageNotFoundError`, which is also a `FileNotFoundError`. `PreconditionFailed` and `BlockedPath` are what
backends raise (see backend.py); Storage turns them into answers and messages.
"""

from __future__ import annotations

import contextlib
import errno
import re
from typing import Any

from harvest.errors import UserError


class StorageError(UserError):
    """A storage operation failed for good: the message is one line naming the URL and what happened; `reason`
    is what happened alone (e.g. "read-only file system"), for a caller that names the input itself."""

    def __init__(self, message: str, url: str | None = None, reason: str | None = None):
        super().__init__(message)
        self.url = url
        self.reason = reason or message


class StorageUnreachable(StorageError):
    """Transient failures outlasted the retries: rerunning later resumes (exit 75, like RetryLater)."""

    exit_code = 75


class StorageFull(StorageError):
    """No space left on the device (or the quota is spent): nothing half-written stays (every write lands whole
    or not at all), and rerunning the same command once there is room resumes (exit 75, like RetryLater: a job
    manager retries it, on another machine or later)."""

    exit_code = 75


class StorageNotFoundError(StorageError, FileNotFoundError):
    """The file (or the bucket) does not exist."""


class PreconditionFailed(Exception):
    """A conditional write's condition did not hold (the object exists, or is not the version named):
    nothing was written."""


class BlockedPath(NotADirectoryError):
    """A local write cannot make its directory because a file sits on the path; the message names it."""


_TRANSIENT_ERRNOS = {
    errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.EPIPE, errno.ETIMEDOUT,
    errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.ENETRESET, errno.EAGAIN,
    getattr(errno, "EREMOTEIO", -1),  # s3fs's translation of HTTP 500 InternalError
}
_TRANSIENT_S3_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "InternalError",
                       "ServiceUnavailable", "RequestLimitExceeded", "TooManyRequests",
                       "ConditionalRequestConflict"}
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


def redact(text: str) -> str:
    """Drop `user:secret@` from any URL in `text`."""
    return re.sub(r"(//)[^/@\s]*@", r"\1", text)


def describe(e: BaseException) -> str:
    if isinstance(e, ConnectionRefusedError):
        what = "connection refused"
    elif isinstance(e, ConnectionResetError):
        what = "connection reset"
    else:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        what = f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__
    what = redact(what)
    return what if len(what) <= 300 else what[:297] + "..."

