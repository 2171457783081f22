"""The fsspec filesystems behind gs:// and s3:// roots: one per protocol, endpoint and process, with the
libraries' own retry loops off (retries happen once, in Storage), and the endpoint checks for emulators."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from harvest.storage.errors import StorageError
from harvest.version import install_extra

log = logging.getLogger(__name__)

_FS_CACHE: dict[tuple, Any] = {}
_FS_LOCK = threading.Lock()


def _cached(key: tuple, make) -> Any:
    """One filesystem per key (protocol, endpoint, credentials, process), made on first use."""
    with _FS_LOCK:
        if key not in _FS_CACHE:
            _FS_CACHE[key] = make()
            _quiet_orphaned_connection_errors()
        return _FS_CACHE[key]


def _quiet_orphaned_connection_errors() -> None:
    """An upload cut off mid-body leaves aiohttp's writer task failed with nobody awaiting it, and asyncio
    would print its traceback to stderr. The request that owned it fails too, and Storage retries or reports
    that in one line; so on fsspec's IO loop such connection errors go to the debug log. Anything else still
    reaches asyncio's own handler."""
    import fsspec.asyn

    def handle(loop, context: dict) -> None:
        if isinstance(context.get("exception"), ConnectionError):
            log.debug("storage: %s: %r", context.get("message"), context["exception"])
        else:
            loop.default_exception_handler(context)

    fsspec.asyn.get_loop().set_exception_handler(handle)


def gcs_filesystem() -> Any:
    env = os.environ
    emulator = env.get("STORAGE_EMULATOR_HOST", "") not in ("", "default")
    zonal = env.get("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
    key = ("gs", env.get("STORAGE_EMULATOR_HOST"), zonal, env.get("GOOGLE_APPLICATION_CREDENTIALS"), os.getpid())
    return _cached(key, lambda: _gcs(emulator, zonal))


def _gcs(emulator: bool, zonal: str | None) -> Any:
    try:
        import aiohttp
        import gcsfs
        import gcsfs.core
    except ImportError as e:
        raise StorageError(f"gs:// needs gcsfs ({e}); {install_extra('gcs')}") from None
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
    return cls(**options)


def s3_filesystem() -> Any:
    env = os.environ
    endpoint = env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or None
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or None
    key = ("s3", endpoint, region, env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_PROFILE"), os.getpid())
    return _cached(key, lambda: _s3(endpoint, region))


def _s3(endpoint: str | None, region: str | None) -> Any:
    try:
        import s3fs
        from aiobotocore.httpsession import AIOHTTPSession
    except ImportError as e:
        raise StorageError(f"s3:// needs s3fs ({e}); {install_extra('s3')}") from None

    class OneTryHTTPSession(AIOHTTPSession):
        """aiohttp resends a PUT whose connection dropped before its reply (PUT is idempotent to HTTP). A
        conditional PUT is not: its resend, when the first one landed, fails its own condition, and Storage
        would take our create for another writer's. The resend is turned off here; Storage retries, and knows
        the earlier try went unanswered."""

        async def _get_session(self, proxy_url):
            session = await super()._get_session(proxy_url)
            session._retry_connection = False  # aiohttp has no public knob for it
            return session
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
        # max_pool_connections: the objects in flight and their multipart parts each hold one (botocore: 10).
        # payload_signing_enabled off: a body is covered by its CRC32 checksum header (botocore's default), not by
        # a SHA-256 pass in the signature too. Over https botocore does so already; over http (an emulator, a
        # MinIO on a private network) that pass was the client's largest cost (bench/bucket.py).
        config_kwargs={"connect_timeout": 10, "read_timeout": 120, "max_pool_connections": 64,
                       "s3": {"payload_signing_enabled": False}, "http_session_cls": OneTryHTTPSession,
                       "retries": {"total_max_attempts": 1, "mode": "standard"}},
    )
    fs.retries = 1  # s3fs's retry loop off, likewise
    return fs

