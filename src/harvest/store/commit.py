"""The commit protocol: a shard's data object is written under a name no other writer uses (it carries the
writer's id), then the shard is committed by creating its sidecar only if absent (`Storage.create_exclusive`).
A writer whose create fails reads the sidecar that won: where it no longer holds the lease it stops (exit 3);
where it still holds it (the winner stalled past its last lease check and woke after the takeover), it goes on
if it committed the same range (shards are deterministic), else stops retryably (exit 75). So each stream's
sidecars form one contiguous chain and every sample is committed once, whatever the writers' timing.

`--overwrite` starts a new generation of the stream (named in its lease, swapped while the wiper holds it): a
writer commits only into the generation it started in, readers read the one generation.json names, and deletes
touch ended generations only, so a writer stalled across wipes cannot reach what readers read. The proof, and
`sweep`'s and a dropped stream's cases: docs/storage.md."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import uuid
from typing import Callable

from harvest.errors import FencedOut, RetryLater, UserError
from harvest.store import format as fmt, generation as pointer
from harvest.storage import Storage
from harvest.store.listing import read_chain, read_sidecar
from harvest.store.lease import Leases
from harvest.store.records import GenerationRecord, Sidecar


class CommitLost(FencedOut):
    """Another writer committed this shard first (exit 3): this one stops writing the stream."""


@dataclasses.dataclass
class ResumePoint:
    """Where a stream stands after its committed shards (all zeros for a fresh stream)."""

    shard: int = 0  # next shard number
    next: fmt.Position = (0, 0)
    row_start: fmt.Position = (0, 0)
    samples: int = 0
    tokens: int = 0
    done: bool = False

    @classmethod
    def after(cls, chain: list[Sidecar]) -> ResumePoint:
        if not chain:
            return cls()
        last = chain[-1]
        return cls(shard=len(chain), next=last.next, row_start=last.row_start,
                   samples=sum(sc.samples for sc in chain), tokens=sum(sc.tokens for sc in chain), done=last.final)


def resume_point(storage: Storage, stream: int) -> ResumePoint:
    """The stream's state after its contiguous run of committed shards from shard 0."""
    return ResumePoint.after(read_chain(storage, stream))


def leftovers(names: list[str], chain: list[Sidecar]) -> list[str]:
    """The data objects among `names` (a stream directory's listing) that no sidecar names and none ever
    can: their shard is committed to another object, or lies past the stream's final shard. An object of
    a shard not committed yet may still be committed by a writer in flight: it is not one of them."""
    done = bool(chain) and chain[-1].final
    out = []
    for name in names:
        shard = fmt.data_file_shard(name)
        if shard is not None and ((shard < len(chain) and name != chain[shard].file) or (done and shard >= len(chain))):
            out.append(name)
    return out


def sweep(storage: Storage, stream: int, generation: str, guard: Callable[[int], None] | None = None
          ) -> list[Sidecar]:
    """Delete the leftovers of the stream's `generation` (see `leftovers`); returns its chain. The directory is
    listed before the chain is read, so a data object listed is judged by sidecars at least as new as itself;
    within a generation no sidecar is ever deleted, so no object deleted here is ever named by one. A chain that
    cannot be read fails for the reason `guard(stream)` gives first: a wipe that ended the generation meanwhile
    deletes it under a lease this worker lost."""
    directory = fmt.shard_dir(stream, generation)
    try:
        names = storage.listdir(directory)
        chain = read_chain(storage, stream, generation)
    except UserError:
        (guard or (lambda s: None))(stream)
        raise
    storage.delete_many(f"{directory}/{name}" for name in leftovers(names, chain))
    return chain


def wipe(storage: Storage, stream: int, leases: Leases, *, whole: bool = False, generation: str | None = None) -> None:
    """Empty `stream` for --overwrite under this worker's lease, by the rule of the module docstring: start a
    new generation (`generation`, a fresh random one by default) in the lease, then in the stream's generation
    pointer, then delete the objects of every ended one and the stream's progress. `whole`: the stream leaves the
    run, so its whole directory goes, once this worker stopped heartbeating its lease (no write of it lands in
    the directory being deleted)."""
    new = generation or uuid.uuid4().hex[:16]
    if whole:
        leases.start_generation(stream, new)
        leases.forget(stream)
        storage.delete_tree(fmt.stream_dir(stream))
        return
    seen = pointer.first(storage, stream, leases.generation(stream))  # before the lease's swap (see generation.py)
    ended = leases.start_generation(stream, new)
    pointer.advance(storage, stream, GenerationRecord(new, ended), seen, leases.check)
    directory = fmt.stream_dir(stream)
    storage.delete_many(f"{directory}/{name}" for name in storage.listdir(directory) if name == fmt.PROGRESS or (
        "" in ended and (fmt.sidecar_shard(name) is not None or fmt.data_file_shard(name) is not None)))
    for old in ended:
        if old:
            storage.delete_tree(fmt.shard_dir(stream, old))


def commit(storage: Storage, sidecar: Sidecar, data: bytes | list | None, guard: Callable[[int], None]) -> Sidecar:
    """Write `data` as the object `sidecar` names (None: written already, by `write_data`), then commit it by
    creating the sidecar only if absent, both in the sidecar's generation. Returns the shard's committed sidecar:
    this one, or the same shard committed first by another writer (`_committed_by_other`)."""
    if data is not None:
        write_data(storage, sidecar.stream, sidecar.file, data, guard, sidecar.generation)
    try:
        guard(sidecar.stream)
    except BaseException:
        _delete_uncommitted(storage, sidecar)  # never to be committed: the lease is lost
        raise
    _test_stop_before_commit(sidecar.stream, sidecar.shard)
    if storage.create_exclusive(fmt.sidecar_path(sidecar.stream, sidecar.shard, sidecar.generation),
                                sidecar.to_bytes()) or _names_this_object(storage, sidecar):
        return sidecar
    _delete_uncommitted(storage, sidecar)
    return _committed_by_other(storage, sidecar, guard)


RANGE_FIELDS = ("start", "next", "row_start", "samples", "tokens", "records", "final")


def _committed_by_other(storage: Storage, mine: Sidecar, guard: Callable[[int], None]) -> Sidecar:
    """Another writer committed `mine`'s shard first: a writer that lost the stream and woke after this one
    took it over (its last lease check passed before it stalled), or the holder, where this one lost it. A
    writer that no longer holds the stream stops (CommitLost, exit 3). The holder goes on from the shard that
    won where it commits the same range (shards are deterministic: the same samples, packed the same); else
    it stops retryably (RetryLater, exit 75): a rerun resumes after the committed chain."""
    try:
        guard(mine.stream)
    except FencedOut:
        raise CommitLost(f"stream {mine.stream}: shard {mine.shard} was committed by another writer first (one "
                         "that took the stream over); this worker stopped writing the stream and its copy was not "
                         "committed") from None
    try:
        won = read_sidecar(storage, mine.stream, mine.shard, mine.generation)
        differs = [f for f in RANGE_FIELDS if getattr(won, f) != getattr(mine, f)]
    except ValueError as e:
        differs = [f"its sidecar is damaged ({e})"]
    if not differs:
        return won
    raise RetryLater(f"stream {mine.stream}: shard {mine.shard} was committed by another writer first, with "
                     f"other contents ({', '.join(differs)} differ); this worker stopped writing the stream: "
                     "rerun the same command to resume after the committed shards")


def _names_this_object(storage: Storage, mine: Sidecar) -> bool:
    """Whether the shard's committed sidecar names `mine`'s data object, which only this attempt writes: its
    create landed though the store answered "exists" (a resend below Storage, which docs/storage.md rules out).
    Checked before that object is deleted: deleting it would leave a committed shard without its data."""
    try:
        return read_sidecar(storage, mine.stream, mine.shard, mine.generation).file == mine.file
    except (ValueError, UserError):
        return False


def _delete_uncommitted(storage: Storage, sidecar: Sidecar) -> None:
    """Delete the data object of a commit known not to have happened (this attempt's name: no one else's)."""
    try:
        storage.delete(fmt.data_path(sidecar.stream, sidecar.file, sidecar.generation))
    except UserError:
        pass  # a leftover: the stream's next holder deletes it


def write_data(storage: Storage, stream: int, file: str, data: bytes | list, guard: Callable[[int], None],
               generation: str) -> None:
    """Write a shard's data object (`file`, a name only this attempt writes) in the stream's `generation`, once
    `guard` confirms the lease."""
    guard(stream)
    storage.write_bytes(fmt.data_path(stream, file, generation), data)


STOP_SETTLE_S = 1.0  # _test_stop_before_commit's wait for the writes under way before it stops the process


def _test_stop_before_commit(stream: int, shard: int) -> None:
    """Fault injection for tests, after the last lease check and before the commit of one shard:
    HARVEST_TEST_STOP_BEFORE_COMMIT=STREAM:SHARD stops this process (SIGSTOP), as a stalled VM would;
    STREAM:SHARD:SECONDS holds just this commit that long (a slow write; the heartbeats go on), or until the
    file HARVEST_TEST_RELEASE_COMMIT names exists, where that is set (a test releases it once it saw enough)."""
    spec = os.environ.get("HARVEST_TEST_STOP_BEFORE_COMMIT", "").split(":")
    if spec[:2] != [str(stream), str(shard)]:
        return
    if len(spec) == 3:
        release, until = os.environ.get("HARVEST_TEST_RELEASE_COMMIT"), time.monotonic() + float(spec[2])
        while time.monotonic() < until and not (release and os.path.exists(release)):
            time.sleep(min(0.1, max(0.0, until - time.monotonic())))
    else:
        # The writes already under way end first: fake-gcs-server holds its one lock while it reads an upload's
        # body, so a process stopped mid-upload would block every other client (a bucket would not).
        time.sleep(STOP_SETTLE_S)
        # Sent to this thread, the stop takes it before it returns; one sent to the process is taken by another
        # thread, and this one may go on and commit until that one is scheduled.
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
