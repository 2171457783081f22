"""A run's committed state, read in one place: run.json, the streams it names, and each stream's chain of
sidecars (commit, the reader, status, inspect and verify all read it here).

Only committed shards exist: a shard is there when its sidecar (`shard_NNNNNN.json`) is, whatever else
lies in the stream directory; the sidecar names the data object it commits. A stream's committed shards are
its chain: sidecars from shard 0 on, each continuing the one before. Readers read only the streams run.json
names, never every `stream_*` directory on storage (an overwrite with fewer streams may leave others).
A stream's shards are those of its current generation (harvest.store.commit: a wipe starts a new one), named
in its generation.json (harvest.store.generation; runs written before it: in its lease.json) and kept in that
generation's directory; a stream without either has generation "", its own directory (every run written
before generations existed).
Strict (the default) refuses a chain with a gap, a damaged sidecar or one that does not continue its
predecessor in one line; lenient (status, which must show a broken run) keeps the chain up to the break.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from harvest.errors import UserError
from harvest.storage import Storage
from harvest.store import format as fmt
from harvest.store.records import GenerationRecord, LeaseRecord, NewerFormat, Progress, RunInfo, Sidecar

SHARD_ARRAYS = ("tokens", "offsets", "sample_ids", "variants")  # the non-activation tensors of a shard
_IO_THREADS = 16


class CorruptShardError(UserError):
    """A committed shard whose bytes do not match its sidecar."""


def dtype_name(arr: np.ndarray) -> str:
    """The run.json name of an array's dtype ("bfloat16", "int8", ...), else numpy's name."""
    for name, dtype in fmt.STORED_DTYPES.items():
        if arr.dtype == np.dtype(dtype):
            return name
    return arr.dtype.name


def covered_streams(info: RunInfo) -> list[int]:
    """The streams a run covers, from run.json's data section (`streams` if listed, else all num_streams)."""
    data = info.data
    if data.get("streams") is not None:
        return sorted(int(s) for s in data["streams"])
    return list(range(int(data.get("num_streams") or 1)))


def stream_count(info: RunInfo, stream: int) -> int | None:
    """Records in a stream per run.json (None when the source's length is unknown)."""
    counts = info.data.get("counts")
    if counts is None:
        return None
    if isinstance(counts, dict):
        value = counts.get(str(stream), counts.get(stream))
        return None if value is None else int(value)
    return int(counts[stream]) if stream < len(counts) else None


def sidecar_numbers(storage: Storage, stream: int, generation: str) -> list[int]:
    """The shard numbers that have a sidecar in a stream's `generation`, in order."""
    return sorted(k for name in storage.listdir(fmt.shard_dir(stream, generation))
                  if (k := fmt.sidecar_shard(name)) is not None)


def stream_generation(storage: Storage, stream: int) -> str:
    """The stream's committed generation, the one its readers read (see read_generation)."""
    return read_generation(storage, stream).generation


def read_generation(storage: Storage, stream: int) -> GenerationRecord:
    """The stream's committed generation and the ended ones: its generation.json (harvest.store.generation); a
    stream without one (never wiped, or written before it existed), its lease.json's; without either, ""."""
    pointer = storage.read_versioned(fmt.generation_path(stream))
    if pointer is not None:
        try:
            return GenerationRecord.from_bytes(pointer.data)
        except ValueError as e:
            raise UserError(f"{storage.url_of(fmt.generation_path(stream))}: not a harvest generation record ({e}); "
                            "it names the generation the stream's shards lie in, so the stream cannot be read") from None
    rel = fmt.lease_path(stream)
    current = storage.read_versioned(rel)
    try:
        lease = LeaseRecord.from_bytes(current.data) if current is not None else None
    except ValueError as e:
        raise UserError(f"{storage.url_of(rel)}: not a harvest lease ({e}); it names the generation the "
                        "stream's shards lie in, so the stream cannot be read") from None
    return GenerationRecord(lease.generation, list(lease.ended)) if lease is not None else GenerationRecord()


def list_stream_dirs(storage: Storage) -> list[int]:
    """Every stream directory on storage, named by run.json or not: for verify's audit and a split run's parts."""
    return sorted(s for s in map(fmt.dir_stream, storage.listdir("")) if s is not None)


def read_run_info(storage: Storage) -> RunInfo:
    if not storage.exists(fmt.RUN_JSON):
        raise UserError(f"{storage.url}: no run.json here, so not a harvest run; check the URL "
                        f"(a run writes run.json before its first shard)")
    try:
        return RunInfo.from_bytes(storage.read_bytes(fmt.RUN_JSON))
    except UserError as e:  # StorageError names the file already
        raise UserError(f"{e}; the run's metadata is damaged") from None
    except NewerFormat as e:
        raise UserError(f"{storage.url_of(fmt.RUN_JSON)}: {e}") from None
    except ValueError as e:
        raise UserError(f"{storage.url_of(fmt.RUN_JSON)}: not a harvest run.json ({e})") from None


def read_sidecar(storage: Storage, stream: int, shard: int, generation: str) -> Sidecar:
    """One sidecar, checked to name its own stream, shard and generation. ValueError saying what is wrong with
    it; storage's own error (a UserError naming the file) when it cannot be read."""
    sidecar = Sidecar.from_bytes(storage.read_bytes(fmt.sidecar_path(stream, shard, generation)))
    if sidecar.stream != stream:
        raise ValueError(f"says stream {sidecar.stream}, lies in {fmt.stream_dir(stream)}")
    if sidecar.shard != shard:
        raise ValueError(f"says shard {sidecar.shard}, named {fmt.shard_stem(shard)}")
    if sidecar.generation != generation:
        raise ValueError(f"says generation {sidecar.generation!r}, lies in {fmt.shard_dir(stream, generation)}")
    return sidecar


def read_chains(storage: Storage, streams: list[int], *, strict: bool = True,
                known: dict[tuple[int, int], Sidecar] | None = None, threads: int = _IO_THREADS,
                generations: dict[int, str] | None = None) -> dict[int, list[Sidecar]]:
    """Each stream's chain of committed shards in its current generation (or the one `generations` names);
    listings and sidecars are read `threads` at a time (those in `known`, a cache of sidecars already read, are
    not read again: a committed sidecar never changes within its generation). Strict: UserError in one line
    for a gap, a damaged sidecar, or one that does not continue its predecessor; lenient: each chain up to its
    first break."""
    known = {} if known is None else known
    if generations is None:
        generations = dict(zip(streams, _map(lambda s: stream_generation(storage, s), streams, threads)))
    numbers = dict(zip(streams, _map(lambda s: sidecar_numbers(storage, s, generations[s]), streams, threads)))
    for key in [key for key in known if key[0] in generations and known[key].generation != generations[key[0]]]:
        del known[key]  # of an ended generation
    wanted = [(s, k) for s in streams for k in _contiguous(numbers[s]) if (s, k) not in known]

    def read(job: tuple[int, int]) -> Sidecar | str:
        try:
            return read_sidecar(storage, *job, generations[job[0]])
        except ValueError as e:
            return str(e)
        except UserError as e:  # storage's error names the file
            if strict:
                raise
            return str(e)

    read_now = dict(zip(wanted, _map(read, wanted, threads)))
    for key, sidecar in read_now.items():
        if isinstance(sidecar, Sidecar):
            known[key] = sidecar
    return {s: _chain(storage, s, generations[s], numbers[s], {**read_now, **known}, strict) for s in streams}


def read_chain(storage: Storage, stream: int, generation: str | None = None) -> list[Sidecar]:
    """One stream's chain of committed shards in its current generation (or `generation`), strict, read in order
    on the caller's thread: a writer's resume point (see read_chains)."""
    return read_chains(storage, [stream], threads=1,
                       generations=None if generation is None else {stream: generation})[stream]


def _chain(storage: Storage, stream: int, generation: str, numbers: list[int], sidecars: dict, strict: bool
           ) -> list[Sidecar]:
    chain: list[Sidecar] = []
    for expected, number in enumerate(numbers):
        rel = fmt.sidecar_path(stream, number, generation)
        if number != expected:
            missing = storage.url_of(fmt.sidecar_path(stream, expected, generation))
            problem = (f"{missing} is missing while later shards of the stream are committed (lost from storage, or "
                       "an --overwrite cut short): the stream cannot be read or resumed past it; rerun with "
                       "--overwrite to start it over")
        elif isinstance(sidecar := sidecars[(stream, number)], str):
            problem = (f"{storage.url_of(rel)}: not a harvest sidecar ({sidecar}); `harvest verify` shows what else "
                       "is wrong")
        elif link := link_problem(chain[-1] if chain else None, sidecar):
            problem = f"{storage.url_of(rel)}: {link}; `harvest verify` shows what else is wrong"
        else:
            chain.append(sidecar)
            continue
        if strict:
            raise UserError(problem)
        break
    return chain


def link_problem(previous: Sidecar | None, sidecar: Sidecar) -> str | None:
    """Why `sidecar` cannot follow `previous` in a stream's chain (None: the chain's first shard), None when it
    can: the chain's rules, which every reader and `harvest verify` apply (the numbering aside: shard k follows
    k-1). A chain starts at [0, 0], each shard where the one before ends, and ends with its final shard."""
    if previous is not None and previous.final:
        return f"a shard after the stream's final shard {previous.shard}"
    start = (0, 0) if previous is None else previous.next
    if sidecar.start != start:
        after = "the stream's start" if previous is None else f"shard {previous.shard}"
        return f"does not continue {after} (starts at {list(sidecar.start)}, not {list(start)})"
    return None


def _contiguous(numbers: list[int]) -> list[int]:
    """The shard numbers 0, 1, 2, ... up to the first gap: the only sidecars a chain can hold."""
    return numbers[:next((i for i, k in enumerate(numbers) if k != i), len(numbers))]


def read_progress(storage: Storage, stream: int) -> Progress | None:
    """A stream's progress.json, for show only: None when absent, or unreadable while being rewritten."""
    return _shown(storage, fmt.progress_path(stream), Progress)


def read_lease(storage: Storage, stream: int) -> LeaseRecord | None:
    """A stream's lease.json, for show only: None when absent or unreadable (the writers judge it themselves)."""
    return _shown(storage, fmt.lease_path(stream), LeaseRecord)


def _shown(storage: Storage, rel: str, record: type):
    """A record read for show only (status): None when absent or unreadable, never an error."""
    try:
        return record.from_bytes(storage.read_bytes(rel)) if storage.exists(rel) else None
    except (ValueError, UserError):
        return None


def _map(fn, items: list, threads: int) -> list:
    if len(items) <= 1 or threads <= 1:
        return [fn(item) for item in items]
    with ThreadPoolExecutor(max_workers=min(threads, len(items))) as pool:
        return list(pool.map(fn, items))
