"""The simulation's world (tests/store/test_simulation.py): simulated time and a run queue of greenlets, the
writer processes that sleep, stall and take SIGTERM on it, and an in-memory object store that honours
create-if-absent and compare-and-swap like GCS and S3, whose requests and replies a seeded scheduler delays,
reorders and drops."""

from __future__ import annotations

import heapq
import itertools
import random

import greenlet

from harvest.runtime.sigterm import Interrupted
from harvest.storage import Backend, Versioned
from harvest.storage.errors import PreconditionFailed
from harvest.store.format import generation_path, shard_dir
from harvest.store.lease import LEASE
from harvest.store.records import GenerationRecord, LeaseRecord, Sidecar


class Stop(Exception):
    """Thrown into a greenlet still waiting when its schedule ends."""


class Sim:
    """Simulated time and a run queue of greenlets: only one runs at a time, the earliest to wake first."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.now = 0.0
        self._queue: list = []
        self._seq = itertools.count()
        self.hub = greenlet.getcurrent()
        self.waiting: dict[greenlet.greenlet, None] = {}  # in the order they began to wait

    def spawn(self, fn, *args) -> greenlet.greenlet:
        g = greenlet.greenlet(lambda: fn(*args), parent=self.hub)
        self._at(self.now, g)
        return g

    def _at(self, t: float, g: greenlet.greenlet) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), g))
        self.waiting[g] = None

    def wait_until(self, t: float) -> None:
        self._at(max(t, self.now), greenlet.getcurrent())
        self.hub.switch()

    def park(self) -> None:
        """Wait until another greenlet calls wake (or the schedule ends)."""
        self.waiting[greenlet.getcurrent()] = None
        self.hub.switch()

    def wake(self, g: greenlet.greenlet, t: float) -> None:
        self._at(max(t, self.now), g)

    def run(self, until: float) -> None:
        while self._queue and self._queue[0][0] <= until:
            t, _, g = heapq.heappop(self._queue)
            self.waiting.pop(g, None)
            self.now = t
            if not g.dead:
                g.switch()
        while self.waiting:  # the rest wait forever: end them, so nothing leaks into the next schedule
            g = next(iter(self.waiting))
            del self.waiting[g]
            self._queue.clear()
            if not g.dead:
                try:
                    g.throw(Stop)
                except Stop:
                    pass


class Process:
    """One writer process: its clock (a skewed rate; a monotonic clock never jumps), its stalls, and when it gets
    SIGTERM (None: never), which ends its sleeps as harvest.clock's does (Interrupted, at once)."""

    def __init__(self, sim: Sim, name: str, rate: float, stalls: list[tuple[float, float]], overwrite: str = "",
                 term_at: float | None = None, before_commit: tuple[int, float] | None = None):
        self.sim, self.name, self.rate, self.stalls, self.overwrite = sim, name, rate, stalls, overwrite
        self.term_at = term_at
        self.before_commit = before_commit  # (shard, seconds): stopped after its last lease check before that commit

    def stop_before_commit(self, stream: int, shard: int) -> None:
        """commit's fault injection point (HARVEST_TEST_STOP_BEFORE_COMMIT): a stall of this process (SIGSTOP)."""
        if self.before_commit is not None and self.before_commit[0] == shard:
            self.stalls = sorted([*self.stalls, (self.sim.now, self.sim.now + self.before_commit[1])])
            self.before_commit = None
            self.resume_at(self.sim.now)

    def terminated(self) -> bool:
        return self.term_at is not None and self.sim.now >= self.term_at

    def monotonic(self) -> float:
        return 1000.0 + self.sim.now * self.rate

    def wall(self) -> float:
        return 1.7e9 + self.sim.now * self.rate

    def sleep(self, seconds: float) -> None:
        until = self.sim.now + max(0.0, seconds) / self.rate
        if self.term_at is not None and until >= self.term_at:
            self.resume_at(max(self.sim.now, self.term_at))
            raise Interrupted("stopped on SIGTERM while waiting")
        self.resume_at(until)

    def resume_at(self, t: float) -> None:
        """Wait until `t`, and past any stall that covers the moment this process would run again."""
        self.sim.wait_until(self.runs_at(t))

    def running(self, start: float, end: float) -> float:
        """How long of [start, end) this process was not stalled."""
        return end - start - sum(max(0.0, min(end, b) - max(start, a)) for a, b in self.stalls)

    def runs_at(self, t: float) -> float:
        """When this process runs again if it is ready at `t`: after any stall that covers `t`."""
        for start, end in self.stalls:
            if start <= t < end:
                t = end
        return t


class SimLock:
    """A lock for greenlets of one thread (a threading.Lock held across a switch would block them all): a
    waiter runs again as soon as the holder releases it (past its process's stalls), as a thread would."""

    def __init__(self, process: Process):
        self.process, self.held = process, False
        self.waiters: list[greenlet.greenlet] = []

    def __enter__(self):
        while self.held:
            self.waiters.append(greenlet.getcurrent())
            self.process.sim.park()
        self.held = True

    def __exit__(self, *exc):
        self.held = False
        sim = self.process.sim
        for g in self.waiters:
            sim.wake(g, self.process.runs_at(sim.now))
        self.waiters.clear()


class Store(Backend):
    """An object store in memory, reached through a network the simulation controls (see `request`)."""

    def __init__(self, sim: Sim, faults: bool):
        self.sim, self.faults = sim, faults
        self.objects: dict[str, tuple[bytes, int]] = {}
        self.generation = 0
        self.violations: list[str] = []
        self.process: Process | None = None  # the caller of the operation in progress
        self.dropped = False  # a full overwrite wiped stream 1
        self.events: dict[str, int] = {}  # what the schedule reached (test_every_schedule_commits_each_sample_once)

    def reached(self, event: str) -> None:
        self.events[event] = self.events.get(event, 0) + 1

    # --- the network ---

    def request(self, caller: Process, apply, writes: bool, slowest: float = 30.0):
        """One request from `caller`: a latency each way (at most `slowest` seconds); sometimes the request or
        the reply is lost, and a write may time out at its client and land much later (or never)."""
        rng = self.sim.rng
        fate = rng.random() if self.faults else 1.0
        latency = rng.expovariate(20.0) if rng.random() > 0.05 else rng.uniform(1.0, slowest)
        if fate < 0.03:  # the request is lost
            caller.resume_at(self.sim.now + latency)
            raise ConnectionResetError("request lost")
        if writes and fate < 0.06:  # the client times out; the request lands later, or never
            if rng.random() < 0.8:
                self.sim.spawn(self._late, apply, rng.uniform(0.0, 600.0))
            caller.resume_at(self.sim.now + 60.0)
            raise TimeoutError("request timed out")
        self.sim.wait_until(self.sim.now + latency / 2)
        try:
            result = apply()
        except (FileNotFoundError, PreconditionFailed) as e:
            error = e
        else:
            error = None
        if fate < 0.09:  # the reply is lost
            caller.resume_at(self.sim.now + latency / 2)
            raise ConnectionResetError("reply lost")
        caller.resume_at(self.sim.now + latency / 2)
        if error is not None:
            raise error
        return result

    def _late(self, apply, delay: float) -> None:
        """A request that timed out at its client lands now, whatever happened meanwhile (wipes included)."""
        self.sim.wait_until(self.sim.now + delay)
        try:
            apply()
        except (FileNotFoundError, PreconditionFailed):
            pass

    # --- the store, as GCS and S3 keep it ---

    def _get(self, path: str) -> tuple[bytes, int]:
        if path not in self.objects:
            raise FileNotFoundError(path)
        return self.objects[path]

    def _put(self, path: str, data: bytes) -> None:
        name = path.rsplit("/", 1)[-1]
        if name.endswith(".json") and name.startswith("shard_") and path in self.objects:
            self.violations.append(f"{path} rewritten")
        self.generation += 1
        self.objects[path] = (bytes(data), self.generation)

    def _delete(self, paths: list[str]) -> None:
        sidecars = self.current_sidecars()
        named = {f"{path.rsplit('/', 1)[0]}/{sidecar.file}" for path, sidecar in sidecars.items()}
        for path in paths:
            if path in sidecars:
                self.violations.append(f"{path} deleted, a sidecar of the stream's current generation")
            if path in named:
                self.violations.append(f"{path} deleted while a sidecar of the current generation names it")
            self.objects.pop(path, None)

    def current(self, stream: int) -> str:
        """The stream's current generation, as its readers read it (listing.read_generation): its generation
        pointer's, else its lease's."""
        pointer = self.objects.get(f"bucket/run/{generation_path(stream)}")
        if pointer:
            return GenerationRecord.from_bytes(pointer[0]).generation
        lease = self.objects.get(f"bucket/run/stream_{stream:05d}/{LEASE}")
        return LeaseRecord.from_bytes(lease[0]).generation if lease else ""

    def current_sidecars(self) -> dict[str, Sidecar]:
        """The sidecars of stream 0's current generation, by path (stream 1 is only ever dropped)."""
        directory = f"bucket/run/{shard_dir(0, self.current(0))}/"
        return {path: Sidecar.from_bytes(data) for path, (data, _) in self.objects.items()
                if path.startswith(directory) and "/" not in path[len(directory):]
                and path[len(directory):].startswith("shard_") and path.endswith(".json")}

    # --- the backend protocol, each operation one request ---

    def _call(self, apply, writes: bool = False, slowest: float = 30.0):
        return self.request(self.process_of(), apply, writes, slowest)

    def process_of(self) -> Process:
        return PROCESS_OF[greenlet.getcurrent()]

    def read(self, path: str) -> bytes:
        return self._call(lambda: self._get(path)[0])

    def read_versioned(self, path: str) -> Versioned:
        def apply():
            data, generation = self._get(path)
            return Versioned(data, str(generation))
        return self._call(apply)

    def write(self, path: str, parts: list) -> None:
        data = b"".join(bytes(p) for p in parts)
        self._call(lambda: self._put(path, data), writes=True)

    def create(self, path: str, data: bytes) -> None:
        def apply():
            if path in self.objects:
                raise PreconditionFailed(path)
            self._put(path, data)
        self._call(apply, writes=True)

    def replace(self, path: str, data: bytes, token: str) -> None:
        def apply():
            if path not in self.objects or str(self.objects[path][1]) != token:
                raise PreconditionFailed(path)
            self._put(path, data)
        self._call(apply, writes=True)

    def listdir(self, path: str) -> list[str]:
        prefix = path.rstrip("/") + "/"
        return self._call(lambda: sorted({p[len(prefix):].split("/", 1)[0] for p in self.objects
                                          if p.startswith(prefix)}))

    def find(self, path: str) -> list[str]:
        return self._call(lambda: [p for p in self.objects if p == path or p.startswith(path.rstrip("/") + "/")])

    def delete(self, paths: list[str]) -> None:
        self._call(lambda: self._delete(list(paths)), writes=True)


PROCESS_OF: dict[greenlet.greenlet, Process] = {}
