"""A stream's committed shards as a sequence, for `harvest verify`: numbered 0, 1, ..., contiguous, one final
shard (the chain's rules are listing's, which every reader applies: listing.link_problem), and every record
exactly once (a sample or a skipped entry, nothing twice). Files are named by their generation's paths."""

from __future__ import annotations

import dataclasses
import numpy as np

from harvest.ranges import format_ranges
from harvest.store import format as fmt
from harvest.store.listing import link_problem
from harvest.store.records import RunInfo, Sidecar


@dataclasses.dataclass
class Totals:
    """What the committed shards of the streams checked add up to (verify's summary line)."""

    shards: int = 0
    records: int = 0
    samples: int = 0
    tokens: int = 0
    bytes: int = 0
    skipped: int = 0


@dataclasses.dataclass
class Shard:
    """What verify learned about one committed shard of a stream."""

    k: int
    sidecar: Sidecar
    sample_ids: np.ndarray | None = None
    variants: np.ndarray | None = None


class Problems:
    """Problems found, as (path in the run, message); checks append from several threads."""

    def __init__(self):
        self.found: list[tuple[str, str]] = []

    def add(self, rel: str, message: str) -> None:
        self.found.append((rel, message))

    def lines(self, url: str) -> list[str]:
        """One line per problem, grouped by file in path order (threads report in any order)."""
        return [f"{url.rstrip('/')}/{rel}: {message}" for rel, message in sorted(self.found, key=lambda p: p[0])]


def check_stream(info: RunInfo, s: int, shards: list[Shard], problems: Problems, report: Totals,
                 unfinished: Problems) -> None:
    """A stream's shards as a sequence: numbered 0, 1, ..., contiguous, one final shard; then coverage. A stream
    never started, or whose chain has no final shard yet, goes to `unfinished`: a resume goes on from it."""
    data = info.data
    num_streams = data["num_streams"]
    count = None if data.get("counts") is None else data["counts"][s]
    if not shards:
        unfinished.add(fmt.stream_dir(s) + "/", "no committed shard: the stream was never started"
                     + (f" ({count} records)" if count is not None else ""))
        return
    generation = shards[0].sidecar.generation  # the stream's current one: its files' paths name it
    gaps: list[tuple[int, int]] = []  # record-index ranges already reported as gaps
    previous, previous_next, expected, previous_records, final_seen = None, (0, 0), 0, 0, None
    for sh in shards:
        sc, rel = sh.sidecar, fmt.sidecar_path(s, sh.k, generation)
        start, next_ = sc.start, sc.next
        if sh.k != expected:
            missing = (fmt.shard_stem(expected) if sh.k == expected + 1
                       else f"{fmt.shard_stem(expected)}..{fmt.shard_stem(sh.k - 1)}")
            problems.add(rel, f"gap: {missing} missing before it (records from {list(previous_next)} "
                              f"to {list(start)} are in no shard)")
            gaps.append((previous_next[0], start[0]))
        elif problem := link_problem(previous, sc):  # the chain's rules, as every reader applies them
            if previous is None or not previous.final:  # a start that misses the previous shard's end
                problem = f"{'gap' if start > previous_next else 'overlap'}: {problem}"
                if start > previous_next:
                    gaps.append((previous_next[0], start[0]))
            problems.add(rel, problem)
        if sc.records < previous_records:
            problems.add(rel, f"records {sc.records} less than the previous shard's {previous_records}")
        if sc.final and final_seen is None:
            final_seen = sh.k
        previous = sc
        previous_next, expected, previous_records = next_, sh.k + 1, sc.records
        report.shards += 1
        report.samples += sc.samples
        report.tokens += sc.tokens
        report.bytes += sc.bytes
        report.skipped += len(sc.skipped)

    last = shards[-1].sidecar
    if final_seen is None:
        total = f" of {count}" if count is not None else ""
        unfinished.add(fmt.sidecar_path(s, shards[-1].k, generation),
                       f"no final shard after this one: stream incomplete ({last.records}{total} records "
                       f"read, committed through {list(last.next)})")
        end = last.next[0]
    else:
        final = next(sh.sidecar for sh in shards if sh.k == final_seen)
        end = final.records
        if count is not None and end != count:
            problems.add(fmt.sidecar_path(s, final_seen, generation),
                         f"final shard says the stream has {end} records, run.json data.counts says {count}")
        if final.next > (end, 0):
            problems.add(fmt.sidecar_path(s, final_seen, generation),
                         f"final shard ends at {list(final.next)}, past the stream's {end} records")
    report.records += end
    entries = sum(sh.sidecar.samples + len(sh.sidecar.skipped) for sh in shards)
    if end > entries + 10_000_000:  # each record needs a sample or a skip: do not allocate for a bogus count
        problems.add(fmt.sidecar_path(s, shards[-1].k, generation),
                     f"{end:,} records but only {entries:,} samples and skipped entries: at least "
                     f"{end - entries:,} records have neither")
        return
    check_coverage(s, num_streams, shards, end, gaps, problems)


def check_coverage(s: int, num_streams: int, shards: list[Shard], end: int, gaps: list[tuple[int, int]],
                   problems: Problems) -> None:
    """Exactly once: each record 0..end-1 has samples or a skipped entry, nothing twice."""
    generation = shards[0].sidecar.generation if shards else ""
    covered = np.zeros(max(end, 0), bool)
    ids, variants, owner = [], [], []
    # Skipped entries as format.sidecar has them ({sample_id, location, reason}) name no variant: a record
    # may have several (empty variants) next to written pieces, so they only count for coverage. Entries
    # that do name a variant are held to exactly once.
    skipped_pieces: dict[tuple[int, int], int] = {}
    for sh in shards:
        sc = sh.sidecar
        start, next_ = sc.start, sc.next
        data_rel = fmt.data_path(s, sc.file, sc.generation)
        if sh.sample_ids is not None and len(sh.sample_ids):
            sid, var = sh.sample_ids, sh.variants.astype(np.int64)
            index = sid // num_streams
            wrong = sid % num_streams != s
            if wrong.any():
                problems.add(data_rel, f"{int(wrong.sum())} sample_ids do not belong to stream {s} "
                                       f"(e.g. {int(sid[wrong][0])}; sample_id = index * {num_streams} + stream)")
            first, lastp = (int(index[0]), int(var[0])), (int(index[-1]), int(var[-1]))
            order_ok = np.all((np.diff(index) > 0) | ((np.diff(index) == 0) & (np.diff(var) > 0)))
            if not order_ok:
                problems.add(data_rel, "samples are not in strictly increasing (index, variant) order")
            if first < start or lastp >= next_ or (var < 0).any():
                problems.add(data_rel, f"samples span {list(first)}..{list(lastp)}, outside the sidecar's "
                                       f"[start {list(sc.start)}, next {list(sc.next)})")
            ok = ~wrong & (index < end)
            if (index[~wrong] >= end).any():
                problems.add(data_rel, f"samples past the stream's last record ({end} records)")
            covered[index[ok]] = True
            ids.append(sid)
            variants.append(var)
            owner.append(np.full(len(sid), sh.k))
        elif sh.sample_ids is None:  # data unreadable, already reported: do not report its records again
            gaps.append((start[0], next_[0] + 1))
        for entry in sc.skipped:
            sid = entry.get("sample_id") if isinstance(entry, dict) else None
            if not isinstance(sid, int) or sid < 0 or sid % num_streams != s:
                problems.add(fmt.sidecar_path(s, sh.k, generation),
                             f"skipped entry {entry!r} has no sample_id of stream {s}")
                continue
            i, variant = sid // num_streams, entry.get("variant")
            if not (start[0] <= i and (i, 0 if variant is None else int(variant)) < next_):
                problems.add(fmt.sidecar_path(s, sh.k, generation),
                             f"skipped sample_id {sid} (record {i}) outside "
                             f"[start {list(sc.start)}, next {list(sc.next)})")
            if variant is not None:  # a piece-level entry: (sample_id, variant) is unique in the run
                key = (sid, int(variant))
                if key in skipped_pieces:
                    problems.add(fmt.sidecar_path(s, sh.k, generation), f"sample_id {sid} variant {variant} "
                                 f"skipped twice (also in {fmt.sidecar_name(skipped_pieces[key])})")
                skipped_pieces[key] = sh.k
            if i < end:
                covered[i] = True

    files = {sh.k: sh.sidecar.file for sh in shards}
    if ids:
        sid, var, own = np.concatenate(ids), np.concatenate(variants), np.concatenate(owner)
        order = np.lexsort((own, var, sid))
        sid, var, own = sid[order], var[order], own[order]
        dup = np.flatnonzero((sid[1:] == sid[:-1]) & (var[1:] == var[:-1])) + 1
        by_shard: dict[int, list[int]] = {}
        for j in dup.tolist():
            by_shard.setdefault(int(own[j]), []).append(j)
        for k, js in sorted(by_shard.items()):
            j = js[0]
            problems.add(fmt.data_path(s, files[k], generation),
                         f"{len(js)} duplicate sample{'s' * (len(js) > 1)}: sample_id {int(sid[j])} variant "
                         f"{int(var[j])} is also in {files[int(own[j - 1])]}")
        pairs = set(zip(sid.tolist(), var.tolist())) if skipped_pieces else set()
    else:
        pairs = set()
    for key, k in sorted(skipped_pieces.items()):
        if key in pairs:
            problems.add(fmt.sidecar_path(s, k, generation),
                         f"sample_id {key[0]} variant {key[1]} is both skipped and written")

    missing = np.flatnonzero(~covered)
    if gaps and len(missing):  # records inside a reported gap are not reported again
        in_gap = np.zeros(len(missing), bool)
        for lo, hi in gaps:
            in_gap |= (missing >= lo) & (missing < hi)
        missing = missing[~in_gap]
    if len(missing):
        starts = [sh.sidecar.start[0] for sh in shards]
        for k, records in _group_by_shard(missing, starts, [sh.k for sh in shards]).items():
            problems.add(fmt.data_path(s, files[k], generation),
                         f"{len(records)} record{'s' * (len(records) > 1)} in this shard's range with no sample "
                         f"and no skipped entry: records {format_ranges(records, sep=', ', limit=6)} (sample_ids "
                         f"{', '.join(str(r * num_streams + s) for r in records[:3])}{'...' * (len(records) > 3)})")


def _group_by_shard(records: np.ndarray, starts: list[int], ks: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r in records.tolist():
        j = max(0, int(np.searchsorted(starts, r, side="right")) - 1)
        out.setdefault(ks[j], []).append(r)
    return out
