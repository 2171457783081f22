"""Amazon S3 and S3-compatible stores (s3://) through s3fs; conditional writes with `If-None-Match: *` (create)
and `If-Match: <ETag>` (compare-and-swap).

A plain write of at least two parts' worth (`part_size`) is a multipart upload with `parts_in_flight` parts
uploaded at once: one connection to S3 carries far less than a VM's NIC. The object appears whole at
CompleteMultipartUpload, or not at all: on any failure the upload is aborted (its parts are never listed as
objects; a bucket lifecycle rule with AbortIncompleteMultipartUpload clears what a killed process left), and
Storage's retry starts a fresh one. Smaller writes are one PUT. Bodies are read from the caller's parts
(objects.PartsBody), never joined."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from fsspec.asyn import sync

from harvest.storage.backend import Buffer
from harvest.storage.errors import PreconditionFailed
from harvest.storage.filesystems import s3_filesystem
from harvest.storage.objects import ObjectBackend, PartsBody


class S3Backend(ObjectBackend):
    token_key = "ETag"
    part_size = 32 * 2**20  # S3 takes 5 MiB to 5 GiB a part, 10,000 parts: 32 MiB parts reach 335 GB
    parts_in_flight = 8  # one object's parts uploaded at once

    def filesystem(self) -> Any:
        return s3_filesystem()

    def write(self, path: str, parts: list[Buffer]) -> None:
        fs = self.fs
        bucket, key, _ = fs.split_path(path)
        size = len(PartsBody(parts))
        if size < 2 * self.part_size:
            fs.call_s3("put_object", Bucket=bucket, Key=key, Body=PartsBody(parts))
        else:
            sync(fs.loop, self._multipart, fs, bucket, key, parts, size)

    async def _multipart(self, fs: Any, bucket: str, key: str, parts: list[Buffer], size: int) -> None:
        """One multipart upload, `parts_in_flight` parts at a time, aborted (and its parts still in flight
        cancelled) on any failure."""
        upload = (await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key))["UploadId"]
        in_flight = asyncio.Semaphore(self.parts_in_flight)

        async def put(number: int, start: int) -> dict:
            async with in_flight:
                body = PartsBody(parts, start, min(size, start + self.part_size))
                out = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=upload, PartNumber=number,
                                        Body=body)
            return {"PartNumber": number, "ETag": out["ETag"]}

        tasks = [asyncio.ensure_future(put(i + 1, start)) for i, start in enumerate(range(0, size, self.part_size))]
        try:
            done = await asyncio.gather(*tasks)
            await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=upload,
                              MultipartUpload={"Parts": done})
        except Exception:
            for task in tasks:
                task.cancel()
            with contextlib.suppress(Exception):
                await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload)
            raise

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
