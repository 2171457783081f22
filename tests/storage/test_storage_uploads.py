"""Shard-sized uploads to fake-gcs-server and moto, real servers on 127.0.0.1: GCS's one streamed media upload
and S3's multipart upload with its parts in flight (parts made small here through S3Backend.part_size). A data
object lands whole or not at all, its sidecar is still created once, and a failure midway leaves nothing that
a listing (or `harvest verify`, which lists the same way) sees."""

from __future__ import annotations

import time

import numpy as np
import pytest

from harvest.storage import Storage, StorageError

pytest_plugins = ["storage_servers"]

PART = 5 * 2**20  # S3's smallest part but the last (moto refuses smaller ones, as S3 does)
DATA = "stream_00000/shard_000000-0123abcd.safetensors"
SIDECAR = "stream_00000/shard_000000.json"


def shard_parts(size: int, seed: int = 0) -> list:
    """A data object as the Committer hands it to Storage.write_bytes: a header, then uint8 views of tensors."""
    body = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)
    return [b"\x10\x00\x00\x00header", *np.array_split(body, 3)]


def joined(parts: list) -> bytes:
    return b"".join(bytes(p) for p in parts)


def storage(url: str, part_size: int = PART, **kwargs) -> Storage:
    st = Storage(url, backoff=0.05, **kwargs)
    if st.protocol == "s3":
        st.backend.part_size = part_size
    return st


def multipart_uploads(st: Storage) -> list:
    """The S3 multipart uploads begun and neither completed nor aborted in the bucket."""
    fs = st.backend.fs
    return fs.call_s3("list_multipart_uploads", Bucket=st.bucket).get("Uploads", [])


@pytest.fixture(params=["gs", "s3"])
def flaky(request):
    """(URL through a FlakyProxy, the proxy)."""
    kind = "gcs" if request.param == "gs" else "s3"
    return request.getfixturevalue(f"{kind}_proxy_url"), request.getfixturevalue(f"{kind}_proxy")


@pytest.mark.parametrize("url_fixture", ["gcs_url", "s3_url"])
def test_a_large_shard_reads_back_byte_identical_and_its_sidecar_is_created_once(url_fixture, request):
    st = storage(request.getfixturevalue(url_fixture))
    parts = shard_parts(3 * PART + 12345)
    st.write_bytes(DATA, parts)
    assert st.read_bytes(DATA) == joined(parts)
    assert st.listdir("stream_00000") == [DATA.split("/")[1]]
    if st.protocol == "s3":  # a multipart object's ETag ends in its part count: the parallel path ran
        assert st.read_versioned(DATA).token.strip('"').endswith("-4")
    assert st.create_exclusive(SIDECAR, b'{"writer": 1}')
    assert not st.create_exclusive(SIDECAR, b'{"writer": 2}')
    assert st.read_bytes(SIDECAR) == b'{"writer": 1}'


@pytest.mark.parametrize("url_fixture", ["gcs_url", "s3_url"])
def test_a_shard_of_many_parts_reads_back_byte_identical(url_fixture, request):
    """An 8-bit shard comes in about a thousand parts, some empty, some a few bytes (scales): S3's parts cut
    across them."""
    st = storage(request.getfixturevalue(url_fixture))
    rng = np.random.default_rng(1)
    sizes = rng.choice([0, 3, 4096, 60_000], size=1000, p=[0.1, 0.3, 0.3, 0.3])
    parts = [b"\x10\x00header", *(rng.integers(0, 256, n, dtype=np.uint8) for n in sizes)]
    assert sum(len(p) for p in parts) > 2 * PART
    st.write_bytes(DATA, parts)
    assert st.read_bytes(DATA) == joined(parts)


def test_a_refused_multipart_upload_is_aborted_and_leaves_no_object(s3_url):
    """Parts below S3's 5 MiB minimum: the server refuses the completion, the upload is aborted."""
    st = storage(s3_url, part_size=2**20)
    with pytest.raises(StorageError, match=r"cannot write s3://.*shard_000000-0123abcd\.safetensors"):
        st.write_bytes(DATA, shard_parts(3 * 2**20))
    assert not st.exists(DATA) and st.listdir("stream_00000") == []
    assert multipart_uploads(st) == []


def test_an_upload_cut_off_midway_leaves_nothing_listed(flaky):
    url, proxy = flaky
    st = storage(url, attempts=1)
    proxy.outage_after(2 * PART, 0.5)
    with pytest.raises(StorageError, match="cannot write"):
        st.write_bytes(DATA, shard_parts(6 * PART))
    while proxy.down:
        time.sleep(0.05)
    assert not st.exists(DATA) and st.listdir("stream_00000") == []


def test_an_upload_retried_through_an_outage_lands_whole_and_alone(flaky):
    url, proxy = flaky
    st = storage(url)
    parts = shard_parts(6 * PART + 7)
    proxy.outage_after(2 * PART, 0.5)
    st.write_bytes(DATA, parts)
    assert proxy.outages == 1
    assert st.read_bytes(DATA) == joined(parts)
    assert st.listdir("stream_00000") == [DATA.split("/")[1]]


def test_object_stores_keep_more_writes_in_flight_than_a_disk(tmp_path, gcs_url, s3_url):
    """A disk: a write per core (two at least); a bucket: twice that, 4 to 32 (each holds a shard in memory)."""
    local, gs, s3 = Storage(str(tmp_path)), Storage(gcs_url), Storage(s3_url)
    assert local.writes_in_flight >= 2
    for bucket in (gs, s3):
        assert bucket.writes_in_flight == min(32, max(4, 2 * local.writes_in_flight))
