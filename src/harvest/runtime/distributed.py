"""Joining the processes of a multi-host run. Call `initialize()` first, before any other JAX call.

Settings come from flags (`--coordinator`, `--num-processes`, `--process-id`), else from the env
JAX_COORDINATOR_ADDRESS / JAX_PROCESS_COUNT / JAX_PROCESS_INDEX, else from JAX's own detection of a
TPU pod or a multi-task SLURM job; with none of these it is one process and nothing is started.
The timeouts are passed on to JAX so a peer that never comes, or dies, is an error in bounded time
instead of a hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Mapping

import jax
import numpy as np

from harvest.errors import UserError

FIELDS = ("coordinator", "num_processes", "process_id")
ENV = {"coordinator": "JAX_COORDINATOR_ADDRESS", "num_processes": "JAX_PROCESS_COUNT",
       "process_id": "JAX_PROCESS_INDEX"}
FLAGS = {"coordinator": "--coordinator", "num_processes": "--num-processes", "process_id": "--process-id"}
_WHAT = {"coordinator": "coordinator address", "num_processes": "process count", "process_id": "process id"}
# JAX cluster detectors we trust to mean "several hosts of one job". Not k8s (any pod in a cluster
# looks like one) nor MPI launchers: there, set the env variables above.
AUTO_CLUSTERS = ("slurm", "gketpu", "gcetpu")


class DistributedError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    process_index: int
    process_count: int
    local_device_count: int
    device_count: int
    coordinator: str | None


@dataclasses.dataclass(frozen=True)
class Settings:
    """What initialize() does: join `num_processes` via `coordinator`, or let JAX's `cluster` detector fill all in."""

    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    cluster: str | None = None

    @property
    def multi(self) -> bool:
        return self.cluster is not None or self.num_processes > 1


def detect_cluster() -> str | None:
    """Name of the first JAX cluster detector (of AUTO_CLUSTERS) that finds a job of more than one process.

    Reuses jax._src.clusters (what jax.distributed.initialize itself consults) rather than guessing
    env variables: SLURM needs SLURM_JOB_ID/STEP_NODELIST/NTASKS/PROCID/LOCALID; TPU needs a Cloud TPU
    VM with TPU_WORKER_HOSTNAMES/TPU_PROCESS_ADDRESSES (GKE) or GCE metadata; MEGASCALE_* adds slices.
    A single-process job (SLURM_NTASKS=1, a one-host TPU VM) needs no coordinator and gets none.
    """
    try:
        from jax._src import clusters
    except ImportError:  # private module; without it, only explicit settings work
        return None
    for env in getattr(clusters.ClusterEnv, "_cluster_types", []):
        if env.name in AUTO_CLUSTERS and not env.opt_in_only_method and env.is_env_present():
            if env.get_process_count() > 1:
                return env.name
    return None


def resolve(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
            env: Mapping[str, str] | None = None, detect=detect_cluster) -> Settings:
    """Each setting from its argument, else its env variable; all or none. None at all: `detect()`."""
    env = os.environ if env is None else env
    given = dict(zip(FIELDS, (coordinator, num_processes, process_id)))
    for key in FIELDS:
        raw = env.get(ENV[key], "").strip()
        if given[key] is None and raw:
            given[key] = raw
            if key != "coordinator":
                try:
                    given[key] = int(raw)
                except ValueError:
                    raise DistributedError(f"{ENV[key]}={raw!r}: expected an integer") from None
    coord, n, pid = (given[k] for k in FIELDS)
    if coord is None and n is None and pid is None:
        cluster = detect()
        return Settings(cluster=cluster) if cluster else Settings()
    if n == 1 and pid in (None, 0):
        return Settings()  # one process needs no coordinator
    missing = [f"{_WHAT[k]} ({FLAGS[k]} or {ENV[k]})" for k in FIELDS if given[k] is None]
    if missing:
        have = ", ".join(_WHAT[k] for k in FIELDS if given[k] is not None)
        raise DistributedError(f"multi-host settings incomplete: {have} given, missing {' and '.join(missing)}")
    if n < 1 or not 0 <= pid < n:
        raise DistributedError(f"process id {pid} with {n} processes: need 0 <= process id < process count")
    if not re.fullmatch(r"\S+:\d+", coord):
        raise DistributedError(f"coordinator {coord!r}: expected HOST:PORT, e.g. 10.0.0.1:8476")
    return Settings(coord, n, pid)


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None,
               *, timeout_s: int = 60) -> ProcessInfo:
    """Join the other processes (or do nothing for one); idempotent.

    `timeout_s` bounds waiting for all processes to connect, and is the heartbeat timeout after which
    a silent peer counts as dead (the others then fail instead of waiting forever) and the limit of
    the shutdown barrier at exit. Note: JAX 0.10 does not raise when connecting times out; it aborts
    the process (SIGABRT, "DEADLINE_EXCEEDED ... RegisterTask") about timeout_s + a few s later.
    """
    settings = resolve(coordinator, num_processes, process_id)
    if jax.distributed.is_initialized():
        if settings.cluster is None and settings.multi and (
                (settings.num_processes, settings.process_id) != (jax.process_count(), jax.process_index())):
            raise DistributedError(f"already joined as process {jax.process_index()} of {jax.process_count()}; "
                                   f"cannot rejoin as {settings.process_id} of {settings.num_processes}")
    elif settings.multi:
        # gloo is jax 0.10's default for CPU collectives; set it anyway so CPU runs never fall back to none.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        explicit = settings.cluster is None
        try:
            jax.distributed.initialize(
                settings.coordinator,
                settings.num_processes if explicit else None,
                settings.process_id if explicit else None,
                cluster_detection_method="deactivate" if explicit else settings.cluster,
                initialization_timeout=timeout_s,
                heartbeat_timeout_seconds=timeout_s,
                shutdown_timeout_seconds=timeout_s,
            )
        except RuntimeError as e:  # e.g. called after a JAX computation; JaxRuntimeError is one too
            where = (f"process {settings.process_id} of {settings.num_processes} via {settings.coordinator}"
                     if explicit else f"{settings.cluster} cluster")
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DistributedError(f"cannot join the run as {where}: {first}") from e
    return ProcessInfo(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_device_count=jax.local_device_count(),
        device_count=jax.device_count(),
        coordinator=_coordinator(),
    )


def _coordinator() -> str | None:
    """The address JAX joined through (also when its cluster detector chose it); None for one process."""
    if not jax.distributed.is_initialized():
        return None
    from jax._src import distributed  # not re-exported by jax.distributed

    return getattr(distributed.global_state, "coordinator_address", None)


class DisagreementError(UserError):
    pass


class PeerLost(UserError):
    """Another process of the run died (preemption, OOM, kill): this one stops too, in bounded time."""


@contextlib.contextmanager
def peers_watched():
    """Turn a collective that fails because a peer is gone into one clear line instead of a JAX traceback."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if jax.process_count() == 1:
            raise
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise PeerLost(f"process {jax.process_index()}: another process of this run stopped ({first}); "
                       "committed shards are kept: start every process again with the same command to resume"
                       ) from None


def exit_now(code: int, *, always: bool = False) -> None:
    """Leave without JAX's shutdown barrier, which aborts the process when a peer is already gone
    (`always`: also in one process, skipping the interpreter's slow teardown of storage clients)."""
    if always or jax.distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def leave(code: int) -> None:
    """End a multi-process run whose work is done on every process: meet at a barrier, then exit without
    JAX's shutdown, whose coordination service can abort (SIGABRT) a process whose peer left a moment
    first (seen once in ~10 successful 2-process runs on a loaded 2-core machine). No-op for one process."""
    if jax.distributed.is_initialized() and jax.process_count() > 1:
        barrier("harvest-leave")
        exit_now(code)


def _allgather_bytes(data: bytes) -> list[bytes]:
    """Every process's bytes, in process order (two small collectives: lengths, then padded payloads)."""
    from jax.experimental import multihost_utils

    lengths = multihost_utils.process_allgather(np.asarray([len(data)], np.int64)).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    gathered = multihost_utils.process_allgather(padded).reshape(len(lengths), -1)
    return [bytes(row[:n]) for row, n in zip(gathered, lengths)]


def agree(settings: dict, what: str = "settings") -> None:
    """All processes must hold equal `settings` (JSON-able); otherwise every one of them stops, showing the
    fields where some process differs from process 0. A no-op for one process."""
    if jax.process_count() == 1:
        return
    mine = json.dumps(settings, sort_keys=True, default=str).encode()
    everyone = [json.loads(b) for b in _allgather_bytes(mine)]
    first = everyone[0]
    differ = []
    for index, other in enumerate(everyone[1:], start=1):
        for key in sorted(set(first) | set(other)):
            if first.get(key) != other.get(key):
                differ.append(f"{key}: process 0 has {first.get(key)!r}, process {index} has {other.get(key)!r}")
    if differ:
        raise DisagreementError(f"processes disagree on {what}: {'; '.join(differ[:6])}")


def any_true(flag: bool) -> bool:
    """True if `flag` is true on any process (one tiny collective); the processes' shared loop condition."""
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(multihost_utils.process_allgather(np.asarray([flag], np.int32)).any())


CHECK_EVERY_S = 1.0  # how far apart, in seconds of steps, StopAgreement's checks land
# jax's CPU runtime can hang when a host queues many steps whose collectives span processes (2 processes x 4
# devices, a tiny decoder: 3 of 3 runs queueing 50-80 steps hung; runs synced every 16, 24 or 40 did not).
CPU_MOST_AHEAD = 16  # so on CPU, checks (which wait for the device) at most this many steps apart


class StopAgreement:
    """Whether any process got a preemption notice, agreed on by all at the same step of a loop that visits every
    step, without a collective at every step: a collective's host read waits for the device to finish the step
    just dispatched, so one per step keeps the host from queueing step k+1 while step k runs. The processes meet
    only at check steps, about `every_s` apart: at each, one small all-gather of every process's notice and its
    proposal for the next check (`every_s` ahead at the pace it measured between its last two checks, at least
    one step, on CPU at most CPU_MOST_AHEAD, never past `last`); all take the earliest proposal, so all check at
    the same steps. (Not the coordination service's barriers: they notice a dead peer only after the heartbeat
    timeout, a collective at once.) One process checks every step, for free."""

    def __init__(self, step: int, last: int, every_s: float = CHECK_EVERY_S):
        self.next, self._last, self._every_s = step + 1, last, every_s
        self._one = jax.process_count() == 1
        self._most = CPU_MOST_AHEAD if jax.default_backend() == "cpu" else last
        self._mark = (step, time.monotonic())  # the step and time the last check returned
        self._pace = math.inf  # seconds per step between the last two checks (none yet: check at the next step)

    def due(self, step: int) -> bool:
        return self._one or step >= self.next

    def stop(self, step: int, notice: bool) -> bool:
        """True if any process gave a notice. Every process calls this at the same checks (`due`); one that
        stops between checks (its notice came while it waited) calls it once, as the others' next check."""
        if self._one:
            return notice
        from jax.experimental import multihost_utils

        proposal = min(step + min(max(1, round(self._every_s / self._pace)), self._most), self._last)
        gathered = multihost_utils.process_allgather(np.asarray([notice, proposal], np.int32)).reshape(-1, 2)
        now = time.monotonic()
        self._pace = max(now - self._mark[1], 1e-9) / max(step - self._mark[0], 1)
        self._mark, self.next = (step, now), int(gathered[:, 1].min())
        return bool(gathered[:, 0].any())


def barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)
