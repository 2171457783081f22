"""The bottom layer: one `Storage` (URLs, retries, one-line errors, conditional writes) over one backend
per protocol: local.py (a path), gcs.py (gs://), s3.py (s3://). backend.py says what a backend is, for
anyone who brings their own (`Storage("sim://bucket/run", backend=...)`)."""

from harvest.storage.backend import Backend, Upload, Versioned
from harvest.storage.errors import (
    PreconditionFailed,
    StorageError,
    StorageFull,
    StorageNotFoundError,
    StorageUnreachable,
    describe,
    is_transient,
    redact,
)
from harvest.storage.storage import Storage, json_bytes

__all__ = ["Backend", "PreconditionFailed", "Storage", "StorageError", "StorageFull", "StorageNotFoundError",
           "StorageUnreachable", "Upload", "Versioned", "describe", "is_transient", "json_bytes", "redact"]
