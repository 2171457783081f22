"""Reading back what is committed (for resume) and the per-stream lease (for one writer per stream)."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
from datetime import datetime, timezone

from harvest.errors import UserError
from harvest.store import format as fmt
from harvest.store.fs import Storage
from harvest.store.writer import ResumePoint

_SIDECAR = re.compile(r"^shard_(\d{6})\.json$")
LEASE = "lease.json"


class LeaseError(UserError):
    pass


def resume_point(storage: Storage, stream: int) -> ResumePoint:
    """The stream's state after its contiguous run of committed shards from shard 0.

    A shard without its sidecar does not exist: it is rewritten, under the same name, with the same bytes.
    """
    directory = fmt.stream_dir(stream)
    numbers = sorted(int(m.group(1)) for name in storage.listdir(directory) if (m := _SIDECAR.match(name)))
    point = ResumePoint()
    for expected, number in enumerate(numbers):
        if number != expected:
            break
        manifest = storage.read_json(f"{directory}/{fmt.shard_stem(number)}.json")
        point = ResumePoint(
            shard=number + 1,
            next=tuple(manifest["next"]),
            row_start=tuple(manifest["row_start"]),
            samples=point.samples + manifest["samples"],
            tokens=point.tokens + manifest["tokens"],
            done=bool(manifest["final"]),
        )
    return point


def _now() -> datetime:
    return datetime.now(timezone.utc)


class Leases:
    """One lease object per stream, created only if absent (O_EXCL / conditional create).

    The same worker id (a restart after preemption) takes its own lease back; another worker finds it
    held and stops before writing anything, unless the lease's heartbeat is older than `ttl_s` (its
    holder is gone). A thread refreshes the heartbeat of held leases.
    """

    def __init__(self, storage: Storage, worker: str, ttl_s: float = 300.0):
        self.storage = storage
        self.worker = worker
        self.ttl_s = ttl_s
        self.held: set[int] = set()
        self._lock = threading.Lock()  # a heartbeat never rewrites a lease just released
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        return json.dumps({"worker": self.worker, "host": socket.gethostname(), "pid": os.getpid(),
                           "heartbeat_at": _now().isoformat(timespec="seconds")}).encode()

    def acquire(self, streams: list[int]) -> None:
        """Take every stream's lease, or none: on a conflict, release what was taken and raise."""
        try:
            for stream in streams:
                self._acquire(stream)
        except BaseException:
            self.release_all()
            raise
        if self._thread is None:
            self._thread = threading.Thread(target=self._heartbeat, daemon=True, name="lease-heartbeat")
            self._thread.start()

    def _acquire(self, stream: int) -> None:
        rel = f"{fmt.stream_dir(stream)}/{LEASE}"
        if not self.storage.create_exclusive(rel, self._body()):
            held = self.storage.read_json(rel)
            age = (_now() - datetime.fromisoformat(held["heartbeat_at"])).total_seconds()
            if held.get("worker") != self.worker and age < self.ttl_s:
                raise LeaseError(
                    f"stream {stream} is held by worker {held.get('worker')!r} on {held.get('host')} "
                    f"(heartbeat {age:.0f}s ago); give each worker its own --streams, or wait {self.ttl_s:.0f}s "
                    f"after it died")
            self.storage.write_bytes(rel, self._body())
        self.held.add(stream)

    def release(self, stream: int) -> None:
        with self._lock:
            if stream in self.held:
                self.held.discard(stream)
                self.storage.delete(f"{fmt.stream_dir(stream)}/{LEASE}")

    def release_all(self) -> None:
        self._stop.set()
        for stream in sorted(self.held):
            self.release(stream)

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            with self._lock:
                for stream in sorted(self.held):
                    self.storage.write_bytes(f"{fmt.stream_dir(stream)}/{LEASE}", self._body())
