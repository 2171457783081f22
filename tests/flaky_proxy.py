"""A TCP proxy on loopback in front of a storage server that can be told to fail (resets, refused connections,
lost replies), and its fixtures (a plugin, as storage_servers is): `gcs_proxy`, `s3_proxy` put one in front
of the server with the endpoint variable pointed at it for the test; `gcs_proxy_url`, `s3_proxy_url`: a fresh
bucket reached through that proxy."""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time

import pytest

HOST = "127.0.0.1"
_METHODS = {b"GET", b"HEAD", b"PUT", b"POST", b"DELETE", b"PATCH", b"OPTIONS"}  # a request's first chunk


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
    connections only. `lose_replies(seconds)` lets requests through and drops their replies;
    `lose_next_replies(n)` drops the replies to the next `n` requests, however long they take to come.
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
        self._replies_to_lose = 0
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
        done, doomed = threading.Semaphore(0), threading.Event()  # doomed: this connection's next reply dies
        threading.Thread(target=self._pump, args=(upstream, client, done, doomed), daemon=True).start()
        self._pump(client, upstream, done, doomed, up=True)
        done.acquire()
        done.acquire()
        with self._lock:
            self._socks.discard(client)
            self._socks.discard(upstream)
        for s in (client, upstream):
            with contextlib.suppress(OSError):
                s.close()

    def _pump(self, src: socket.socket, dst: socket.socket, done: threading.Semaphore, doomed: threading.Event,
              up: bool = False) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                if up and data.split(b" ", 1)[0] in _METHODS and self._loses_reply():
                    doomed.set()  # before the request goes on: its reply cannot come first
                if (not up and not data.startswith(b"HTTP/1.1 100 ")
                        and (doomed.is_set() or time.monotonic() < self._replies_lost_until)):
                    _abort(dst)  # the server acted; its reply dies
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

    def lose_next_replies(self, n: int) -> None:
        """The replies to the next `n` requests are dropped (their connections reset), as `lose_replies` drops
        them for a time."""
        with self._lock:
            self._replies_to_lose = n

    def _loses_reply(self) -> bool:
        """Whether the request starting now is one whose reply `lose_next_replies` drops."""
        with self._lock:
            if self._replies_to_lose:
                self._replies_to_lose -= 1
                return True
        return False

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
