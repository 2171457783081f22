"""A stream's committed generation, kept where no lease operation can lose it: `stream_NNNNN/generation.json`
(a GenerationRecord: the generation readers read, and the ended ones a wipe deletes). The lease names the
generation its holder writes; this pointer, the one readers read. It moves forward only, each write a
compare-and-swap from a version read before the lease write it reflects, so a writer stalled between its read
and its swap lands nothing. The cases (wipe, first pointer, a taker's reconcile): docs/storage.md."""

from __future__ import annotations

from typing import Callable

from harvest.errors import RetryLater, UserError
from harvest.storage import Storage, Versioned
from harvest.store import format as fmt
from harvest.store.records import GenerationRecord, LeaseRecord


def read(storage: Storage, stream: int) -> Versioned | None:
    """The pointer as it is now, with the version a later swap of it compares against (None: absent)."""
    return storage.read_versioned(fmt.generation_path(stream))


def parse(storage: Storage, stream: int, current: Versioned | None) -> GenerationRecord | None:
    if current is None:
        return None
    try:
        return GenerationRecord.from_bytes(current.data)
    except ValueError as e:
        raise UserError(f"{storage.url_of(fmt.generation_path(stream))}: not a harvest generation record ({e}); it "
                        "names the generation the stream's shards lie in: restore it (lease.json names the same "
                        "one while no wipe runs)") from None


def _swap(storage: Storage, stream: int, record: GenerationRecord, seen: Versioned | None) -> bool:
    """Write the pointer only if it is still the version `seen` (None: only if absent)."""
    rel = fmt.generation_path(stream)
    if seen is None:
        return storage.create_exclusive(rel, record.to_bytes())
    return storage.replace_if(rel, record.to_bytes(), seen.token)


def first(storage: Storage, stream: int, generation: str) -> Versioned:
    """The pointer before a wipe: created where absent (a stream never wiped), naming `generation`, the lease's."""
    current = read(storage, stream)
    if current is None:
        _swap(storage, stream, GenerationRecord(generation), None)
        current = read(storage, stream)
    if current is None:
        raise RetryLater(f"stream {stream}: its generation.json vanished while this worker wiped the stream; rerun "
                         "the same command")
    return current


def advance(storage: Storage, stream: int, record: GenerationRecord, seen: Versioned | None,
            guard: Callable[[int], None]) -> None:
    """A wipe's second swap: the pointer to `record` (the lease's new state) from the version `seen` read before the
    lease's swap. Where it moved meanwhile to another generation (nothing ended is deleted then): `guard(stream)`'s
    error where the lease was lost, else RetryLater."""
    if _swap(storage, stream, record, seen):
        return
    now = parse(storage, stream, read(storage, stream))
    if now is None or now.generation != record.generation:
        guard(stream)
        raise RetryLater(f"stream {stream}: its generation.json changed while this worker wiped the stream (another "
                         "worker took it over meanwhile); nothing was deleted: rerun the same command")


def follow(storage: Storage, stream: int, lease: LeaseRecord, seen: Versioned | None, fresh: bool,
           adopt: Callable[[GenerationRecord], None]) -> None:
    """A taker's reconciliation of the pointer with the lease it just took (see the module docstring); `seen` was
    read before the take, `fresh`: the lease was created (from `seen`). `adopt(record)` swaps the lease to a
    pointer ahead of it. RetryLater where the pointer moved since `seen` to neither."""
    mine = GenerationRecord(lease.generation, list(lease.ended))
    named = parse(storage, stream, seen)
    if _ahead(named, mine):
        adopt(named)
        return
    if named is None and mine == GenerationRecord():
        return  # nothing to point at: readers read generation "" without it (a wipe creates it first)
    if named is not None and named.generation == mine.generation and not fresh:
        return
    if _swap(storage, stream, mine, seen):
        return
    now = parse(storage, stream, read(storage, stream))
    if now is not None and now.generation == mine.generation:
        return
    if _ahead(now, mine):
        adopt(now)
        return
    raise RetryLater(f"stream {stream}: its generation.json changed while this worker took the stream (another "
                     "worker took it over meanwhile); rerun the same command")


def _ahead(named: GenerationRecord | None, mine: GenerationRecord) -> bool:
    """Whether the pointer names a generation after the lease's (which it records as ended)."""
    return named is not None and named.generation != mine.generation and mine.generation in named.ended
