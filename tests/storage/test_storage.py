"""harvest.storage.Storage against a local directory, fake-gcs-server and a real S3 server (moto), including
a proxy that cuts the connection mid-run. Conditional writes: tests/storage/test_storage_conditional.py."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import fsspec
import pytest

from harvest.errors import UserError
from harvest.storage import Storage, StorageError, StorageNotFoundError, is_transient

pytest_plugins = ["storage_servers"]  # harmless once tests/conftest.py loads it too

LOGGER = "harvest.storage.storage"


@pytest.fixture(params=["gs", "s3"])
def flaky(request):
    """(URL through a FlakyProxy, the proxy)."""
    kind = request.param
    url = request.getfixturevalue(f"{'gcs' if kind == 'gs' else 's3'}_proxy_url")
    return url, request.getfixturevalue("gcs_proxy" if kind == "gs" else "s3_proxy")


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and text, repr(text)
    return text


def test_round_trip(root):
    st = Storage(root)
    assert st.url == root.rstrip("/")
    assert st.listdir() == [] and not st.exists("a.bin")
    st.write_bytes("a.bin", b"\x00\x01abc")
    st.write_json("stream_00001/shard_000000.json", {"b": 2, "a": [1, "é"]})
    st.write_bytes("stream_00001/sub/deep.bin", b"x")
    assert st.read_bytes("a.bin") == b"\x00\x01abc"
    assert st.read_json("stream_00001/shard_000000.json") == {"a": [1, "é"], "b": 2}
    assert st.size("a.bin") == 5
    assert st.exists("a.bin") and st.exists("stream_00001") and not st.exists("nope.bin")
    assert st.listdir() == ["a.bin", "stream_00001"]
    assert st.listdir("stream_00001") == ["shard_000000.json", "sub"]
    assert st.listdir("missing") == [] and st.listdir("a.bin") == []
    child = st.child("stream_00001")
    assert child.url == f"{st.url}/stream_00001"
    assert child.read_json("shard_000000.json") == {"a": [1, "é"], "b": 2}
    st.write_bytes("a.bin", b"overwritten")
    assert st.read_bytes("a.bin") == b"overwritten"
    st.delete("a.bin")
    st.delete("a.bin")  # missing is fine
    assert not st.exists("a.bin") and st.listdir() == ["stream_00001"]
    with pytest.raises(StorageNotFoundError) as info:
        st.read_bytes("a.bin")
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, UserError)
    assert _one_line(info.value) == f"{st.url}/a.bin: not found"
    with pytest.raises(StorageNotFoundError):
        st.size("a.bin")
    with pytest.raises(ValueError):
        st.read_bytes("../escape")


def test_delete_tree_and_delete_many_take_what_they_name_and_nothing_beside_it(root):
    """A checkpoint step of many files goes in a few requests; a sibling that shares the name's prefix
    (`7.json`, `70/`) stays; deleting what is gone is fine."""
    st = Storage(root)
    st.write_bytes("7/process_00000.json", b"m")
    st.write_bytes("7.json", b"sibling")
    st.write_bytes("70/x.bin", b"sibling")
    for i in range(230):
        st.write_bytes(f"7/process_00000/state/params.{i % 3}/{i}", b"chunk")
    st.delete_tree("7")
    assert not st.exists("7") and st.listdir("7") == []
    assert st.listdir() == ["7.json", "70"] and st.read_bytes("70/x.bin") == b"sibling"
    st.delete_tree("7")
    st.delete_tree("7.json")  # a file
    assert st.listdir() == ["70"]
    st.write_bytes("70/y.bin", b"y")
    st.write_bytes("70/z.bin", b"z")
    st.delete_many(["70/x.bin", "70/gone.bin", "70/z.bin"])
    assert st.listdir("70") == ["y.bin"]
    st.delete_many(["70/gone.bin"])
    st.delete_many([])
    assert st.listdir("70") == ["y.bin"]
    st.write_bytes("70/[y].bin", b"a name from storage, not a pattern")  # as a glob it would match y.bin
    st.write_bytes("70/*", b"nor this")
    st.delete_many(["70/[y].bin", "70/*", "70/z.bin"])
    assert st.listdir("70") == ["y.bin"]
    st.write_bytes("70/sub/[y].bin", b"")
    st.write_bytes("70/sub/y.bin", b"kept")
    st.delete_tree("70/sub/[y].bin")
    assert st.listdir("70/sub") == ["y.bin"]


def test_open_text_streams_lines(root):
    st = Storage(root)
    lines = [f'{{"i": {i}, "text": "{"é" * (i % 7)}"}}' for i in range(20_000)]
    st.write_bytes("data/s.jsonl", ("\n".join(lines) + "\n").encode())
    with st.open_text("data/s.jsonl") as f:
        got = [line.rstrip("\n") for line in f]
    assert got == lines
    with pytest.raises(StorageNotFoundError), st.open_text("data/none.jsonl"):
        pass


def test_write_20mb(root):
    st = Storage(root)
    data = os.urandom(20 * 2**20)
    st.write_bytes("big/shard.safetensors", data)
    assert st.size("big/shard.safetensors") == len(data)
    assert st.read_bytes("big/shard.safetensors") == data
    assert st.listdir("big") == ["shard.safetensors"]  # no temp files left or shown


def test_listing_sees_writes_from_elsewhere(root):
    st = Storage(root)
    assert st.listdir("d") == []
    assert not st.exists("d/x")
    # Another writer (another filesystem instance, as another process would be).
    if st.is_local:
        os.makedirs(os.path.join(root, "d"))
        open(os.path.join(root, "d", "x"), "wb").close()
    else:
        other = fsspec.filesystem(st.protocol, skip_instance_cache=True)
        other.pipe_file(st.path("d/x"), b"1")
    assert st.listdir("d") == ["x"] and st.exists("d/x")


def test_outage_costs_retries_not_data(flaky, caplog):
    url, proxy = flaky
    st = Storage(url)
    payloads = {f"stream_00000/shard_{i:06d}.safetensors": os.urandom(256 * 1024 + i) for i in range(24)}
    caplog.set_level(logging.WARNING, logger=LOGGER)
    started = time.monotonic()
    for i, (rel, data) in enumerate(payloads.items()):
        if i == 4:  # cut mid-sequence: open connections reset, the port refuses for 2 s
            proxy.outage(2.0)
        st.write_bytes(rel, data)
        if i == 6:  # a lease taken during the outage's tail is still taken exactly once
            assert st.create_exclusive("stream_00000/lease.json", b'{"worker": "me", "pid": 1}') is True
    elapsed = time.monotonic() - started
    assert proxy.outages == 1 and elapsed >= 1.5
    retries = [r for r in caplog.records if r.name == LOGGER and "retry" in r.getMessage()]
    assert retries, "the outage should have cost retries"
    assert all("\n" not in r.getMessage() for r in retries)
    for rel, data in payloads.items():
        assert st.read_bytes(rel) == data
    assert st.create_exclusive("stream_00000/lease.json", b'{"worker": "other"}') is False
    assert st.read_json("stream_00000/lease.json") == {"worker": "me", "pid": 1}
    assert len(st.listdir("stream_00000")) == len(payloads) + 1


def test_read_retries_through_outage(flaky):
    url, proxy = flaky
    st = Storage(url)
    st.write_bytes("data/s.jsonl", b"".join(b'{"i": %d}\n' % i for i in range(1000)))
    st.write_json("run.json", {"ok": True})
    proxy.outage(1.0)
    assert st.read_json("run.json") == {"ok": True}
    proxy.outage(1.0)
    with st.open_text("data/s.jsonl") as f:
        assert sum(1 for _ in f) == 1000
    proxy.outage(0.5)
    assert st.listdir() == ["data", "run.json"]


def test_gives_up_with_one_line(flaky, caplog):
    url, proxy = flaky
    st = Storage(url, attempts=3, backoff=0.05, backoff_cap=0.1)
    st.write_bytes("before.json", b"{}")
    proxy.outage(30.0)
    caplog.set_level(logging.WARNING, logger=LOGGER)
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        st.write_bytes("stream_00000/shard_000000.json", b"{}")
    assert time.monotonic() - started < 10
    message = _one_line(info.value)
    assert message.startswith(f"cannot write {url}/stream_00000/shard_000000.json: ")
    assert "gave up after 3 attempts" in message
    assert isinstance(info.value, UserError) and not isinstance(info.value, FileNotFoundError)
    assert len([r for r in caplog.records if r.name == LOGGER]) == 2  # one warning per retry
    with pytest.raises(StorageError, match="gave up after 3 attempts"):
        st.read_bytes("before.json")


def test_unwritable_local_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_bytes(b"not a directory")
    st = Storage(str(blocker / "out"))
    with pytest.raises(StorageError) as info:
        st.write_json("run.json", {})
    assert _one_line(info.value) == f"cannot write {blocker}/out/run.json: {blocker} is a file, not a directory"
    with pytest.raises(StorageError, match="is a file, not a directory"):
        st.create_exclusive("stream_00000/lease.json", b"{}")
    assert blocker.read_bytes() == b"not a directory"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_local_dir(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(StorageError, match="permission denied"):
            Storage(str(ro)).write_bytes("x.bin", b"1")
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("kind", ["gs", "s3"])
def test_missing_bucket(kind, request):
    request.getfixturevalue("gcs_server" if kind == "gs" else "s3_server")
    st = Storage(f"{kind}://harvest-no-such-bucket/run")
    with pytest.raises(StorageNotFoundError) as info:
        st.write_json("run.json", {})
    assert _one_line(info.value) == (f"cannot write {kind}://harvest-no-such-bucket/run/run.json: bucket "
                                     "'harvest-no-such-bucket' does not exist or is not accessible; "
                                     "create it or fix the URL")
    assert st.listdir() == [] and not st.exists("run.json")


def test_urls():
    assert Storage("gs://b/p/").url == "gs://b/p"
    assert Storage("gcs://b").url == "gs://b"
    assert Storage("s3://key:secret@b/p").url == "s3://b/p"
    assert Storage("s3://b/p").child("x/y").url == "s3://b/p/x/y"
    assert Storage("file:///tmp/x/").url == "/tmp/x"
    with pytest.raises(StorageError, match="unsupported URL scheme"):
        Storage("ftp://host/x")
    with pytest.raises(StorageError, match="no bucket"):
        Storage("gs://")


def test_transient_classification():
    import aiohttp
    import botocore.exceptions
    from gcsfs.retry import HttpError

    def client_error(status: int, code: str):
        return botocore.exceptions.ClientError(
            {"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    def caused(outer: Exception, inner: Exception) -> Exception:
        outer.__cause__ = inner
        return outer

    transient = [ConnectionResetError(), ConnectionRefusedError(), TimeoutError(), OSError(errno.ECONNRESET, "x"),
                 HttpError({"code": 503, "message": "busy"}), HttpError({"code": 429, "message": "slow"}),
                 aiohttp.ServerDisconnectedError(), client_error(500, "InternalError"),
                 caused(OSError(errno.EIO, "x"), client_error(503, "SlowDown")),
                 botocore.exceptions.EndpointConnectionError(endpoint_url="http://x")]
    permanent = [FileNotFoundError(), PermissionError(), FileExistsError(), ValueError("Bad Request"),
                 HttpError({"code": 404, "message": "nf"}), HttpError({"code": 400, "message": "bad"}),
                 client_error(403, "AccessDenied"), caused(FileNotFoundError(), ConnectionResetError()),
                 OSError(errno.ENOSPC, "full")]
    assert [e for e in transient if not is_transient(e)] == []
    assert [e for e in permanent if is_transient(e)] == []


@pytest.mark.parametrize("tail", [b"\r", b"\r\n", b"\n", b"\x00"])
def test_exact_bytes_whatever_the_last_byte(root, tail):
    st = Storage(root)
    for n, data in enumerate([tail, b"abc" + tail, os.urandom(1000) + tail, b""]):
        st.write_bytes(f"t/{n}.bin", data)
        assert st.read_bytes(f"t/{n}.bin") == data, (n, data[-4:])
        assert st.create_exclusive(f"x/{n}.bin", data) is True
        assert st.read_bytes(f"x/{n}.bin") == data
        token = st.read_versioned(f"x/{n}.bin").token
        assert st.replace_if(f"x/{n}.bin", data + tail, token) is True
        assert st.read_bytes(f"x/{n}.bin") == data + tail
        with st.open_write(f"w/{n}.bin") as f:
            f.write(data)
        assert st.read_bytes(f"w/{n}.bin") == data


def test_connections_cut_mid_upload(flaky, caplog):
    url, proxy = flaky
    st = Storage(url, backoff=0.05)
    data = os.urandom(16 * 2**20)
    stop = threading.Event()
    caplog.set_level(logging.WARNING, logger=LOGGER)

    def cutter() -> None:
        for _ in range(2):  # twice: once 2 MB into the upload, once 2 MB into its retry
            start = proxy.bytes_up
            while proxy.bytes_up < start + 2 * 2**20:
                if stop.wait(0.001):
                    return
            proxy.cut()

    t = threading.Thread(target=cutter)
    t.start()
    try:
        st.write_bytes("big.bin", data)
    finally:
        stop.set()
        t.join()
    # Each cut costs a retry here (aiohttp may also re-send an idempotent PUT once by itself).
    assert len([r for r in caplog.records if r.name == LOGGER]) >= 1
    assert st.read_bytes("big.bin") == data


def test_an_orphaned_connection_error_is_logged_at_debug_not_printed_as_a_traceback(caplog):
    """A cut-off upload leaves aiohttp's writer task failed and unawaited (its request fails too, and Storage
    retries it); asyncio's traceback of it must not reach the user's terminal. Other errors still do."""
    import asyncio
    import gc

    import aiohttp
    import fsspec.asyn

    from harvest.storage import filesystems

    filesystems.s3_filesystem()  # harvest's first filesystem of the process sets the IO loop's handler

    async def orphan(error: Exception) -> None:
        async def fail():
            raise error
        task = asyncio.ensure_future(fail())
        await asyncio.sleep(0.01)
        del task

    caplog.set_level(logging.DEBUG, logger="harvest")  # a CLI run earlier in the process set harvest's to INFO
    for error in (aiohttp.ClientConnectionResetError("Cannot write to closing transport"), ValueError("a bug")):
        fsspec.asyn.sync(fsspec.asyn.get_loop(), orphan, error)
        gc.collect()
    reported = [r.exc_info[1] if r.exc_info else r.getMessage() for r in caplog.records if r.name == "asyncio"]
    assert [type(e) for e in reported] == [ValueError], reported
    assert any("Cannot write to closing transport" in r.getMessage() for r in caplog.records
               if r.name == "harvest.storage.filesystems")
