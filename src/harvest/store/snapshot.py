"""What a run holds at one moment: its run.json and the sidecars of the shards committed then.

A `Snapshot` is plain data (a URL, a RunInfo and Sidecars), so it can be handed to data-loader workers or
other ranks: every reader given the same one reads the same shards, however far the run has grown since.
Totals and merged stats come from the sidecars alone; `read_shard` and `shard_samples` decode a shard's
data object whole (status/inspect, sample access), checked against the sidecar's checksums as it is
decoded (one pass over bytes already in memory); token batches read ranges instead (harvest.read).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Iterable, Iterator, Mapping

import numpy as np

from harvest.errors import UserError
from harvest.storage import Storage
from harvest.store import encoding, format as fmt, quant
from harvest.store.listing import (SHARD_ARRAYS, CorruptShardError, covered_streams, read_chains, read_run_info,
                                   stream_generation)
from harvest.store.records import RunInfo, Sidecar
from harvest.store.stats import RunningStats

ShardCounts = Mapping[int, int]  # {stream: committed shards}: how ranks agree on the shards they split


class StartedOverError(UserError):
    """A stream read was started over (a new generation: an --overwrite) while its reader read it."""


def started_over(url: str, streams: Iterable[int]) -> StartedOverError:
    """The one line for streams that a reader read in a generation that has ended since."""
    streams = sorted(streams)
    it, some = ("them new generations", "s") if len(streams) > 1 else ("it a new generation", "")
    return StartedOverError(
        f"{url}: stream{some} {', '.join(map(str, streams))} started over (an --overwrite gave {it}) while being "
        "read: what was read is no longer the run; start the reader over too (a new --out for an SAE)")


@dataclasses.dataclass(frozen=True)
class Sample:
    """One sample (a record, or one variant of it): its tokens and every captured tensor, [n_tokens, d]."""

    sample_id: int
    variant: int
    tokens: np.ndarray
    activations: dict[str, np.ndarray]
    stream: int = -1
    shard: int = -1

    def __len__(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """run.json and the committed shards' sidecars, by (stream, shard). `take` lists a run; `limited` keeps
    the first shards of each stream, as another reader's `counts()` names them."""

    url: str
    info: RunInfo
    shards: tuple[Sidecar, ...]

    @classmethod
    def take(cls, storage: Storage) -> Snapshot:
        """run.json and the chains of the streams it names (strict: one line for a broken chain)."""
        info = read_run_info(storage)
        chains = read_chains(storage, covered_streams(info))
        return cls(storage.url, info, tuple(sc for s in sorted(chains) for sc in chains[s]))

    def grown(self, storage: Storage) -> Snapshot:
        """The run as it stands now, for a reader that follows it: only the sidecars committed since this
        snapshot are read (committed ones never change). StartedOverError in one line when run.json changed or
        went meanwhile (a full --overwrite deletes it after ending every stream's generation, then writes it
        again): what was read of it is no longer the run."""
        try:
            info = read_run_info(storage)
        except UserError:
            if storage.exists(fmt.RUN_JSON):
                raise
            raise StartedOverError(f"{storage.url}: run.json went while the run was being read (a full --overwrite "
                                   "is starting it over, or it was deleted): what was read is no longer the run; "
                                   "start the reader over too (a new --out for an SAE)") from None
        if info.to_bytes() != self.info.to_bytes():
            raise StartedOverError(f"{storage.url_of(fmt.RUN_JSON)} changed while it was being read (the run was "
                                   "started over, e.g. with --overwrite): what was read belongs to another run; "
                                   "start the reader over too (a new --out for an SAE)")
        known = {(sc.stream, sc.shard): sc for sc in self.shards}
        try:
            chains = read_chains(storage, covered_streams(info), known=known)
        except UserError:  # a gap: an --overwrite deleting a generation this listing began in, or a real loss
            read = self.generations()
            gone = [s for s, g in read.items() if stream_generation(storage, s) != g]
            if gone:
                raise started_over(self.url, gone) from None
            raise
        grown = dataclasses.replace(self, shards=tuple(sc for s in sorted(chains) for sc in chains[s]))
        grown.check_generations(self.generations())
        return grown

    def shared(self) -> dict[int, list]:
        """{stream: [committed shards, their generation]}: what ranks share to split the same shards (`pinned`)."""
        return {s: [len(scs), scs[0].generation] for s, scs in self._by_stream.items()}

    def holds(self, generations: Mapping[int, str]) -> bool:
        """Whether this snapshot's streams are in `generations` (a later listing may be, where it is not)."""
        now = self.generations()
        return all(now.get(s) == g for s, g in generations.items())

    def generations(self) -> dict[int, str]:
        """{stream: the generation its committed shards are of}, for the streams with any."""
        return {s: scs[0].generation for s, scs in self._by_stream.items()}

    def check_generations(self, read: Mapping[int, str]) -> None:
        """StartedOverError when a stream whose shards of generation `read[stream]` were read has other shards
        now, or none (a wipe ended that generation: an --overwrite)."""
        now = self.generations()
        gone = [s for s, g in read.items() if now.get(int(s)) != g]
        if gone:
            raise started_over(self.url, gone)

    def limited(self, counts: ShardCounts) -> Snapshot:
        """The first counts[stream] shards of each stream named (streams not named are left out).
        ValueError when this snapshot holds fewer: it was taken before the one `counts` came from."""
        short = {s: n for s, n in counts.items() if len(self.of_stream(s)) < n}
        if short:
            s, n = next(iter(short.items()))
            raise ValueError(f"stream {s}: {n} shards named, {len(self.of_stream(s))} committed")
        keep = {int(s): int(n) for s, n in counts.items()}
        return dataclasses.replace(self, shards=tuple(sc for sc in self.shards if sc.shard < keep.get(sc.stream, 0)))

    def slim(self, names: list[str]) -> Snapshot:
        """What token batches of tensors `names` need, and no more (it is what a data-loader worker is
        handed): the sidecars without stats or skipped entries, with the checksums of those tensors (and of
        the small ones every reader checks) only."""
        keep = {*SHARD_ARRAYS, *names, *map(quant.scale_name, names)}

        def slimmed(sc: Sidecar) -> Sidecar:
            sums = None if sc.tensor_digests is None else {k: v for k, v in sc.tensor_digests.items() if k in keep}
            chunks = None if sc.chunk_digests is None else {k: v for k, v in sc.chunk_digests.items() if k in keep}
            return dataclasses.replace(sc, stats={}, skipped=[], tensor_digests=sums, chunk_digests=chunks,
                                       first_stats=None)

        return dataclasses.replace(self, shards=tuple(map(slimmed, self.shards)))

    @functools.cached_property
    def _by_stream(self) -> dict[int, list[Sidecar]]:
        by: dict[int, list[Sidecar]] = collections.defaultdict(list)
        for sc in self.shards:
            by[sc.stream].append(sc)
        return by

    def of_stream(self, stream: int) -> list[Sidecar]:
        """Sidecars of one stream's committed shards, in order."""
        return list(self._by_stream.get(stream, []))

    def counts(self) -> dict[int, int]:
        """{stream: committed shards}: give it to every rank so that they split the same shards."""
        return {s: len(scs) for s, scs in self._by_stream.items()}

    @property
    def streams(self) -> list[int]:
        """Streams with at least one committed shard."""
        return sorted(self._by_stream)

    @property
    def tensors(self) -> dict[str, int]:
        return {name: int(width) for name, width in self.info.tensors.items()}

    @property
    def dtype(self) -> str:
        return self.info.dtype

    @property
    def num_samples(self) -> int:
        return sum(sc.samples for sc in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(sc.tokens for sc in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(sc.bytes for sc in self.shards)

    def done(self, stream: int) -> bool:
        scs = self._by_stream.get(stream)
        return bool(scs) and scs[-1].final

    def complete(self, streams: Iterable[int] | None = None) -> bool:
        """Every stream the run covers (or of `streams`) has its final shard: nothing more will be committed."""
        return all(self.done(s) for s in (covered_streams(self.info) if streams is None else streams))

    def first_token_stats(self, name: str) -> RunningStats | None:
        """Stats of each committed sample's first token alone (the attention sinks), merged from the sidecars;
        None when a shard's sidecar lacks them (written before harvest recorded them)."""
        if any(sc.first_stats is None and sc.tokens for sc in self.shards):
            return None
        return self._merged(name, lambda sc: sc.first_stats or {})

    def stats(self, name: str) -> RunningStats:
        """Per-dimension count/mean/M2 over every committed token, merged from the sidecars (pairwise tree)."""
        return self._merged(name, lambda sc: sc.stats)

    def _merged(self, name: str, field) -> RunningStats:
        """The sidecars' stats `field(sidecar)[name]`, merged."""
        width = int(self.info.tensors[name])
        parts = []
        for sc in self.shards:
            entry = field(sc).get(name)
            if entry is None:
                if sc.tokens == 0:
                    continue
                raise UserError(f"{self.url}/{fmt.sidecar_path(sc.stream, sc.shard)}: no stats for {name}; "
                                f"run `harvest verify {self.url}`")
            parts.append(RunningStats.from_json(entry))
        if not parts:
            return RunningStats(0, np.zeros(width), np.zeros(width))
        while len(parts) > 1:  # pairwise: rounding grows with log(shards), not shards
            parts = [parts[i].merge(parts[i + 1]) if i + 1 < len(parts) else parts[i] for i in range(0, len(parts), 2)]
        return parts[0]


def pinned(given: Mapping) -> tuple[dict[int, int], dict[int, str]]:
    """(counts, generations) of a snapshot ranks share: {stream: [shards, generation]} as `Snapshot.shared`
    gives it (JSON keys as strings too), or {stream: shards} with no generation (as harvest gave it before)."""
    counts, generations = {}, {}
    for s, value in given.items():
        if isinstance(value, (list, tuple)):
            counts[int(s)], generations[int(s)] = int(value[0]), str(value[1])
        else:
            counts[int(s)] = int(value)
    return counts, generations


def shard_path(sidecar: Sidecar) -> str:
    """The data object a sidecar commits, relative to the run."""
    return fmt.data_path(sidecar.stream, sidecar.file, sidecar.generation)


def read_shard(storage: Storage, sidecar: Sidecar) -> dict[str, np.ndarray]:
    """All tensors of one committed shard (8-bit codes as float32 values), read whole, decoded and checked
    against its sidecar: the size, each tensor's digest and the file's (Sidecar.mismatch).
    CorruptShardError in one line naming the shard when they do not match."""
    rel = shard_path(sidecar)
    try:
        data = storage.read_bytes(rel)
        if mismatch := sidecar.mismatch(data):
            raise ValueError(mismatch)
        tensors = encoding.decode_shard(data)
        coded = [n[:-len(quant.SCALE_SUFFIX)] for n in tensors if n.endswith(quant.SCALE_SUFFIX)]
        return quant.dequantize_named(tensors, coded) if coded else tensors
    except ValueError as e:
        raise CorruptShardError(f"{storage.url}/{rel}: {e}; run `harvest verify {storage.url}`") from None


def sample_at(sidecar: Sidecar, tensors: dict[str, np.ndarray], names: list[str], row: int) -> Sample:
    """Sample `row` of a decoded shard; its arrays are views into the shard's."""
    lo, hi = int(tensors["offsets"][row]), int(tensors["offsets"][row + 1])
    return Sample(sample_id=int(tensors["sample_ids"][row]), variant=int(tensors["variants"][row]),
                  tokens=tensors["tokens"][lo:hi], activations={name: tensors[name][lo:hi] for name in names},
                  stream=sidecar.stream, shard=sidecar.shard)


def shard_samples(storage: Storage, sidecar: Sidecar, names: list[str]) -> Iterator[Sample]:
    """The samples of one committed shard, in order (one read of the shard)."""
    tensors = read_shard(storage, sidecar)
    for row in range(len(tensors["sample_ids"])):
        yield sample_at(sidecar, tensors, names, row)
