"""Exactly once under every schedule: 2-4 writers run harvest's own lease, commit, sweep and wipe code (and
Storage's retries) as greenlets on simulated time against an in-memory store (tests/simulated_store.py), some
with --overwrite (a full one also drops stream 1); a seeded scheduler delays, reorders and drops requests and
replies, lands timed-out writes late, skews clocks and stalls writers. After each schedule a clean writer
finishes the stream, and the invariants hold: one chain of sidecars from shard 0 to a final one in the current
generation, every sample committed once, each sidecar's data object present with its bytes, no sidecar
rewritten, none of the current generation deleted, no data object deleted while such a sidecar names it, no
shard left in a dropped stream 1.

A failing seed replays alone: HARVEST_SIM_SEED=<seed> pytest tests/store/test_simulation.py.
HARVEST_SIM_SCHEDULES sets how many schedules run (default 10,000).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import random
import time

import greenlet
import numpy as np
import pytest
from simulated_store import PROCESS_OF, Process, Sim, SimLock, Stop, Store

import harvest.storage.storage as storage_module
import harvest.store.commit as commit_module
import harvest.store.lease as lease_module
from harvest.errors import UserError
from harvest.runtime.sigterm import Interrupted
from harvest.storage import Storage
from harvest.store import encoding
from harvest.store.commit import ResumePoint, commit, sweep, wipe
from harvest.store.format import GENERATION, shard_dir
from harvest.store.lease import LEASE, LeaseHeld, Leases
from harvest.store.records import Sidecar

SCHEDULES = int(os.environ.get("HARVEST_SIM_SCHEDULES", "10000"))
SAMPLES_PER_SHARD = 3
HORIZON_S = 2000.0  # simulated seconds a schedule may run before its clean finisher
STOP_BOUND_S = 400.0  # how long a writer may run past SIGTERM: the requests in flight (each at most a 60 s timeout)


def shard_of(k: int, shards: int, attempt: str) -> tuple[Sidecar, bytes]:
    """Shard k of the stream, as every writer computes it (the pipeline is deterministic); only the data
    object's name differs between attempts."""
    lo, hi = k * SAMPLES_PER_SHARD, (k + 1) * SAMPLES_PER_SHARD
    data, digests = shard_bytes(k)
    sidecar = Sidecar.of_shard(data, stream=0, shard=k, stats={}, attempt=attempt, start=(lo, 0), next=(hi, 0),
                               row_start=(hi, 0), samples=hi - lo, tokens=hi - lo, skipped=[], long={},
                               final=k == shards - 1, records=hi, checksum="xxh3_128", digests=digests)
    return sidecar, data


@functools.cache
def shard_bytes(k: int) -> tuple[bytes, tuple[str, dict[str, str]]]:
    """Shard k's data object and its checksums, the same for every writer."""
    lo, hi = k * SAMPLES_PER_SHARD, (k + 1) * SAMPLES_PER_SHARD
    data = encoding.encode_shard({"resid_post.0": np.full((hi - lo, 2), k, np.float32)},
                                 np.arange(lo, hi, dtype=np.int32), np.ones(hi - lo, np.int64), np.arange(lo, hi),
                                 np.zeros(hi - lo, np.int32),
                                 metadata={"stream": "0", "shard": str(k)})
    return data, encoding.shard_digests(encoding.file_parts(data), "xxh3_128")


def writer(sim: Sim, store: Store, process: Process, worker: str, ttl: float, shards: int, outcomes: list,
           stall_between_swaps: float = 0.0) -> None:
    """One `harvest extract` of stream 0: take the lease, resume after the chain, sweep, commit the rest; with
    `process.overwrite`, wipe the stream first ("partial"), and drop stream 1 too ("full"), stalling
    `stall_between_swaps` seconds between a wipe's swap of the lease and its swap of the generation pointer. A
    SIGTERM (`process.term_at`) ends its waits, or stops it before its next commit; every exit releases its leases."""
    storage = Storage("sim://bucket/run", backend=store, clock=process, attempts=4, backoff=0.5, backoff_cap=8.0)
    leases = Leases(storage, worker, ttl_s=ttl, clock=process, heartbeat=False)
    leases._io = SimLock(process)
    leases.id = f"{sim.rng.getrandbits(64):016x}"  # seeded, so that a schedule replays
    leases.process = ""  # like containers on one VM: no writer can prove another alive or gone
    done = [False]
    if stall_between_swaps:
        swap = leases.start_generation

        def start_generation(stream: int, generation: str) -> list[str]:
            ended = swap(stream, generation)
            process.sleep(stall_between_swaps)
            return ended
        leases.start_generation = start_generation

    def heartbeat() -> None:  # a thread waiting on an Event, which SIGTERM does not end
        while not done[0]:
            process.resume_at(sim.now + leases.heartbeat_interval() / process.rate)
            if not done[0]:
                leases.heartbeat_once()

    def stop_if_terminated(where: str) -> None:
        if process.terminated():
            store.reached(f"stopped {where}")
            raise Interrupted("stopped on SIGTERM")

    try:
        try:
            leases.acquire([0, 1] if process.overwrite == "full" else [0])
        except Interrupted:
            store.reached("stopped in the lease's wait-out")
            raise
        PROCESS_OF[sim.spawn(heartbeat)] = process
        if process.overwrite:
            wipe(storage, 0, leases, generation=f"{sim.rng.getrandbits(64):016x}")
        if process.overwrite == "full":
            wipe(storage, 1, leases, whole=True, generation=f"{sim.rng.getrandbits(64):016x}")
            store.dropped = True
        generation = leases.generation(0)
        chain = [] if process.overwrite else sweep(storage, 0, generation, leases.check)  # as the job does
        for k in range(ResumePoint.after(chain).shard, shards):
            stop_if_terminated("between commits")
            sidecar, data = shard_of(k, shards, leases.id[:16])
            sidecar = dataclasses.replace(sidecar, generation=generation)
            if commit(storage, sidecar, data, leases.check).file != sidecar.file:
                store.reached("went on after a stalled writer's commit")
            stop_if_terminated("with a commit in flight")
            if sidecar.final:
                sweep(storage, 0, generation, leases.check)
        outcomes.append((process.name, "done"))
    except LeaseHeld:
        outcomes.append((process.name, "refused"))
    except UserError as e:  # lost the stream, or storage unreachable past its budget: the job stops
        asks = "rerun with --overwrite" in str(e)  # a gap: a wipe cut short, or raced by a stale commit
        outcomes.append((process.name, "asks for --overwrite" if asks else type(e).__name__))
    except Interrupted:
        outcomes.append((process.name, "stopped"))
    except Stop:
        outcomes.append((process.name, "still running at the horizon"))
    finally:
        done[0] = True
    with contextlib.suppress(Stop):
        leases.release_all()
    if process.term_at is not None and process.running(process.term_at, sim.now) > STOP_BOUND_S:
        store.violations.append(f"{process.name} ran {process.running(process.term_at, sim.now):.0f}s past its "
                                "SIGTERM")


def start(sim: Sim, store: Store, name: str, worker: str, ttl: float, shards: int, outcomes: list, *,
          rate: float = 1.0, stalls=(), at: float = 0.0, overwrite: str = "", term_at: float | None = None,
          stall_between_swaps: float = 0.0, before_commit: tuple[int, float] | None = None) -> None:
    process = Process(sim, name, rate, list(stalls), overwrite, term_at, before_commit)

    def delayed() -> None:
        process.resume_at(at)
        writer(sim, store, process, worker, ttl, shards, outcomes, stall_between_swaps)
    g = sim.spawn(delayed)
    PROCESS_OF[g] = process


def delete_lease(sim: Sim, store: Store, at: float) -> None:
    """A person deletes stream 0's lease.json (damaged, say) at `at`, as its message allows."""
    sim.wait_until(at)
    if store.objects.pop(f"bucket/run/stream_00000/{LEASE}", None) is not None:
        store.reached("lease deleted by a person")


def check(store: Store, shards: int) -> list[str]:
    """The invariants, read straight from the store."""
    problems = list(store.violations)
    root = f"bucket/run/{shard_dir(0, store.current(0))}/"
    sidecars = {sc.shard: sc for path, sc in store.current_sidecars().items() if path.startswith(root)}
    if sorted(sidecars) != list(range(shards)):
        problems.append(f"sidecars {sorted(sidecars)}, not one chain 0..{shards - 1}")
    covered: list[int] = []
    for k in sorted(sidecars):
        sc = sidecars[k]
        covered += range(sc.start[0], sc.next[0])
        data = store.objects.get(root + sc.file, (None, 0))[0]
        if data is None:
            problems.append(f"shard {k}: its data object {sc.file} is missing")
        elif (data, sc.digest) != (shard_bytes(k)[0], shard_bytes(k)[1][0]):
            problems.append(f"shard {k}: {sc.file} holds other bytes than its sidecar names")
        if sc.final != (k == shards - 1):
            problems.append(f"shard {k}: final is {sc.final}")
    if covered != list(range(shards * SAMPLES_PER_SHARD)):
        problems.append(f"samples committed {covered}, not each of 0..{shards * SAMPLES_PER_SHARD - 1} once")
    # A full overwrite refused or fenced after taking stream 1's lease leaves it released (and its generation
    # pointer): bookkeeping, no data.
    left = [p for p in store.objects if p.startswith("bucket/run/stream_00001/")
            and not p.endswith((f"/{LEASE}", f"/{GENERATION}"))]
    if store.dropped and left:
        problems.append(f"a full overwrite dropped stream 1, yet it holds {left}")
    return problems


def schedule(seed: int) -> tuple[list[str], list, dict[str, int]]:
    """One seeded schedule: 2-4 writers (some sharing a worker id, as two containers on one VM do; some with
    --overwrite, some stalled between a wipe's two swaps, some sent SIGTERM) over what an older run of 2 streams
    left, sometimes with stream 0's lease deleted by a person, then a clean finisher. Returns the invariants'
    problems, every writer's outcome and the events reached."""
    sim = Sim(seed)
    rng = sim.rng
    JITTER.seed(seed)
    store = Store(sim, faults=True)
    shards = rng.randint(1, 5)
    for k in range(rng.randint(0, 2)):  # committed by an earlier run with these settings and a stream more
        for stream in (0, 1):
            sidecar, data = shard_of(k, shards, "0eaa0eaa0eaa0eaa")
            if stream == 0 and k >= shards:
                continue
            sidecar = dataclasses.replace(sidecar, stream=stream)
            store.objects[f"bucket/run/stream_{stream:05d}/{sidecar.file}"] = (data, 0)
            store.objects[f"bucket/run/stream_{stream:05d}/shard_{k:06d}.json"] = (sidecar.to_bytes(), 0)
    outcomes: list = []
    ids = ["w0", "w1", "w2", "w3"]
    for n in range(rng.randint(2, 4)):
        ttl = rng.choice([5.0, 30.0, 120.0])
        stalls = []
        for _ in range(rng.randint(0, 3)):
            begin = rng.uniform(0.0, 600.0)
            stalls.append((begin, begin + rng.expovariate(1.0 / (ttl * rng.choice([0.3, 1.0, 3.0])))))
        at = rng.uniform(0.0, 200.0)
        start(sim, store, f"p{n}", rng.choice(ids[: n + 1]), ttl, shards, outcomes, rate=rng.uniform(0.8, 1.25),
              stalls=sorted(stalls), at=at, overwrite=rng.choices(["", "partial", "full"], [0.6, 0.2, 0.2])[0],
              term_at=at + rng.uniform(0.0, 4 * ttl) if rng.random() < 0.15 else None,
              stall_between_swaps=ttl * rng.choice([0.3, 2.0]) if rng.random() < 0.3 else 0.0,
              before_commit=(rng.randrange(shards), ttl * rng.uniform(1.0, 4.0)) if rng.random() < 0.3 else None)
    if rng.random() < 0.15:
        sim.spawn(delete_lease, sim, store, rng.uniform(0.0, 600.0))
    sim.run(HORIZON_S)
    store.faults = False  # in-flight writes may still land; no new faults
    for attempt in range(4):
        finished: list = []
        # As its user would: rerun the same command, with --overwrite where the last one asked for it.
        again = "partial" if outcomes and outcomes[-1][1] == "asks for --overwrite" else ""
        start(sim, store, f"finisher{attempt}", f"finisher{attempt}", 300.0, shards, finished, at=sim.now,
              overwrite=again)
        sim.run(sim.now + 20_000.0)
        outcomes += finished
        if finished and finished[0][1] == "done":
            break
    return check(store, shards), outcomes, store.events


JITTER = random.Random()  # Storage's retry jitter, seeded per schedule


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    """Storage logs every retry; millions of them would cost more than the schedules. Its retry jitter comes
    from JITTER, not the random module, which threads other tests left behind may draw from meanwhile. The writers
    carry no process key (see `writer`): the one Leases reads from /proc at its start would be thrown away."""
    monkeypatch.setattr(storage_module, "random", JITTER)
    monkeypatch.setattr(lease_module, "process_key", lambda pid=None: "")
    monkeypatch.setattr(commit_module, "_test_stop_before_commit",
                        lambda stream, shard: PROCESS_OF[greenlet.getcurrent()].stop_before_commit(stream, shard))
    logging.disable(logging.CRITICAL)
    yield
    logging.disable(logging.NOTSET)


def test_every_schedule_commits_each_sample_once(capsys):
    only = os.environ.get("HARVEST_SIM_SEED")
    seeds = [int(only)] if only else range(SCHEDULES)
    began = time.monotonic()
    kinds: dict[str, int] = {}
    reached: dict[str, int] = {}
    for seed in seeds:
        problems, outcomes, events = schedule(seed)
        assert not problems, (f"seed {seed} (replay: HARVEST_SIM_SEED={seed} pytest {__file__}): "
                              f"{problems}; outcomes {outcomes}")
        for _, what in outcomes:
            kinds[what] = kinds.get(what, 0) + 1
        for what, n in events.items():
            reached[what] = reached.get(what, 0) + n
    elapsed = time.monotonic() - began
    with capsys.disabled():
        print(f"\nsimulation: {len(seeds):,} schedules in {elapsed:.1f}s; writer outcomes {dict(sorted(kinds.items()))}; "
              f"reached {dict(sorted(reached.items()))}")
    # The schedules reached the cases they exist for: takeovers, lost commits, refusals, storage outages, a holder
    # going on after a stalled writer's commit, SIGTERM in every wait, leases deleted.
    if not only:
        assert kinds.get("CommitLost", 0) > 0 and kinds.get("FencedOut", 0) > 0 and kinds.get("refused", 0) > 0
        assert all(reached.get(event, 0) > 0 for event in (
            "went on after a stalled writer's commit", "stopped in the lease's wait-out", "stopped between commits",
            "stopped with a commit in flight", "lease deleted by a person")), reached


@pytest.mark.parametrize("seed", [0, 1])
def test_a_schedule_replays_the_same(seed):
    assert schedule(seed) == schedule(seed)
