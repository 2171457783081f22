"""Amazon S3 and S3-compatible stores (s3://) through s3fs: a PUT, or a multipart upload above s3fs's
threshold; conditional writes with `If-None-Match: *` (create) and `If-Match: <ETag>` (compare-and-swap)."""

from __future__ import annotations

from typing import Any

from harvest.storage.backend import Buffer
from harvest.storage.errors import PreconditionFailed
from harvest.storage.filesystems import s3_filesystem
from harvest.storage.objects import ObjectBackend, joined


class S3Backend(ObjectBackend):
    token_key = "ETag"

    def filesystem(self) -> Any:
        return s3_filesystem()

    def write(self, path: str, parts: list[Buffer]) -> None:
        self.fs.pipe_file(path, joined(parts))

    def create(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            raise PreconditionFailed(path) from None
        except Exception as e:
            if precondition_failed(e):
                raise PreconditionFailed(path) from None
            raise

    def replace(self, path: str, data: bytes, token: str) -> None:
        fs = self.fs
        bucket, key, _ = fs.split_path(path)
        try:
            fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfMatch=token)
        except FileNotFoundError:  # gone
            raise PreconditionFailed(path) from None
        except Exception as e:
            if precondition_failed(e):
                raise PreconditionFailed(path) from None
            raise
        finally:
            fs.invalidate_cache()


def precondition_failed(exc: BaseException) -> bool:
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
