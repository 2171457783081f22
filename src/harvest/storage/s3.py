"""Amazon S3 and S3-compatible stores (s3://) through s3fs; conditional writes with `If-None-Match: *` (create)
and `If-Match: <ETag>` (compare-and-swap).

A plain write of at least two parts' worth (`part_size`) is a multipart upload with `parts_in_flight` parts
uploaded at once (s3fs's own): one connection to S3 carries far less than a VM's NIC. The object appears
whole at CompleteMultipartUpload, or not at all: on any failure s3fs aborts the upload (its parts are never
listed as objects; a bucket lifecycle rule with AbortIncompleteMultipartUpload clears what a killed process
left), and Storage's retry starts a fresh one. Smaller writes are one PUT."""

from __future__ import annotations

from typing import Any

from harvest.storage.backend import Buffer
from harvest.storage.errors import PreconditionFailed
from harvest.storage.filesystems import s3_filesystem
from harvest.storage.objects import ObjectBackend, joined


class S3Backend(ObjectBackend):
    token_key = "ETag"
    part_size = 32 * 2**20  # S3 takes 5 MiB to 5 GiB a part, 10,000 parts: 32 MiB parts reach 335 GB
    parts_in_flight = 8  # one object's parts uploaded at once

    def filesystem(self) -> Any:
        return s3_filesystem()

    def write(self, path: str, parts: list[Buffer]) -> None:
        self.fs.pipe_file(path, joined(parts), chunksize=self.part_size, max_concurrency=self.parts_in_flight)

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
