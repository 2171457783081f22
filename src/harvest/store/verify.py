"""`harvest verify`: is every record of every stream in the run exactly once, and is every byte as committed?
Each problem is one line naming its file; the report ends OK, INCOMPLETE (every committed byte checks, but a
stream is unstarted or unfinished) or FAILED, and the CLI exits 0 on OK, else 1. The checks, one by one, are
listed in docs/storage.md (verify)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from harvest.errors import UserError
from harvest.ranges import format_ranges
from harvest.store import encoding, format as fmt, quant
from harvest.storage import Storage
from harvest.store.coverage import Problems, Shard, Totals, check_stream
from harvest.store.listing import (SHARD_ARRAYS, covered_streams, dtype_name, list_stream_dirs, read_run_info,
                                   read_generation, read_sidecar)
from harvest.store.records import RunInfo, Sidecar, check_format
from harvest.store.report import human_bytes

_EXPECTED_ARRAYS = {"tokens": (np.int32, 1), "offsets": (np.int64, 1), "sample_ids": (np.int64, 1),
                    "variants": (np.int32, 1)}


@dataclasses.dataclass
class Report(Totals):
    url: str = ""
    problems: list[str] = dataclasses.field(default_factory=list)
    streams: int = 0
    leftovers: list[str] = dataclasses.field(default_factory=list)  # data objects no sidecar names
    ended: list[str] = dataclasses.field(default_factory=list)  # what ended generations still hold
    unfinished: list[str] = dataclasses.field(default_factory=list)  # streams not started or without a final shard

    @property
    def ok(self) -> bool:
        return not self.problems and not self.unfinished

    @property
    def summary(self) -> str:
        what = (f"{self.streams} streams, {self.records:,} records, {self.shards} shards, {self.samples:,} samples, "
                f"{self.tokens:,} tokens, {human_bytes(self.bytes)}, {self.skipped} skipped"
                + (f", {len(self.leftovers)} uncommitted leftovers" if self.leftovers else "")
                + (f", {len(self.ended)} files of ended generations" if self.ended else ""))
        if self.ok:
            return f"OK {self.url}: {what}"
        if not self.problems:
            n = len(self.unfinished)
            return (f"INCOMPLETE {self.url}: {n} stream{'s' * (n != 1)} not finished, every committed shard "
                    f"checks ({what}); rerun the extraction to resume")
        return f"FAILED {self.url}: {len(self.problems)} problem{'s' * (len(self.problems) != 1)} ({what})"

    def lines(self) -> list[str]:
        return [*self.problems, *self.unfinished,
                *_first(self.url, self.leftovers, "leftover, committed by no sidecar (deleted by the stream's next "
                                                  "writer)", "leftovers"),
                *_first(self.url, self.ended, "in an ended generation, read by nothing (a writer stalled across "
                                              "an --overwrite; the stream's next --overwrite deletes it)",
                        "files of ended generations"),
                self.summary]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _first(url: str, rels: list[str], what: str, plural: str, shown: int = 5) -> list[str]:
    more = [f"... and {len(rels) - shown} more {plural}"] if len(rels) > shown else []
    return [f"{url}/{rel}: {what}" for rel in rels[:shown]] + more


def verify(url: str | Storage, *, workers: int = 4, only: set[int] | None = None) -> Report:
    """Check one run (see the module doc); `workers` shards are read and checked at a time. `only`: check
    just these streams, the part of a split run one output holds (see verify_split)."""
    storage = url if isinstance(url, Storage) else Storage(str(url))
    report, problems, unfinished = Report(url=storage.url), Problems(), Problems()
    info = check_run_info(storage, problems)
    if info is not None:
        streams = covered_streams(info)
        check_stream_dirs(storage, streams, problems)
        if only is not None:
            streams = [s for s in streams if s in only]
        report.streams = len(streams)
        listing = {s: list_stream(storage, s, problems, unfinished) for s in streams}
        jobs = [(s, k) for s in streams for k in listing[s][0]]
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            sidecars = dict(zip(jobs, pool.map(lambda job: checked_sidecar(storage, *job, problems, listing[job[0]][2]),
                                               jobs)))
            checked = [(s, k) for s in streams for k in listing[s][0] if sidecars[(s, k)] is not None]
            results = pool.map(lambda job: check_shard(storage, info, job[0], listing[job[0]][1], sidecars[job],
                                                       problems), checked)
            arrays = dict(zip(checked, results))
        for s in streams:
            shards = [Shard(k, sidecars[(s, k)], *arrays.get((s, k), (None, None)))
                      for k in listing[s][0] if sidecars[(s, k)] is not None]
            named = {sh.sidecar.file for sh in shards}
            unnamed = [name for name in listing[s][1] if name not in named]
            damaged = {k for k in listing[s][0] if sidecars[(s, k)] is None}
            for name in unnamed:  # an object of a shard whose sidecar is there but unreadable is that shard's
                rel = fmt.data_path(s, name, listing[s][2])
                if fmt.data_file_shard(name) in damaged:
                    problems.add(rel, f"may be the data of {fmt.sidecar_name(fmt.data_file_shard(name))}, which "
                                      "cannot be read: committed state is damaged here, not a leftover")
                else:
                    report.leftovers.append(rel)
            report.ended += listing[s][3]
            check_stream(info, s, shards, problems, report, unfinished)
    report.problems, report.unfinished = problems.lines(storage.url), unfinished.lines(storage.url)
    return report


def check_stream_dirs(storage: Storage, streams: list[int], problems: Problems) -> None:
    """No stream directory outside the streams run.json covers."""
    for d in list_stream_dirs(storage):
        if d not in streams:
            problems.add(fmt.stream_dir(d) + "/", "stream directory outside the run (run.json data covers streams "
                                                  f"{format_ranges(streams, sep=', ', limit=6)})")


def check_run_info(storage: Storage, problems: Problems) -> RunInfo | None:
    """run.json's fields that the other checks rely on; None (and problems) when it cannot be used."""
    if not storage.exists(fmt.RUN_JSON):
        problems.add(fmt.RUN_JSON, "missing: not a harvest run, or one that never started")
        return None
    try:
        info = storage.read_json(fmt.RUN_JSON)
    except (ValueError, UserError) as e:
        problems.add(fmt.RUN_JSON, f"unreadable ({e})")
        return None
    bad = []
    if not isinstance(info, dict):
        problems.add(fmt.RUN_JSON, "not a JSON object")
        return None
    version = info.get("format_version")
    if isinstance(version, int) and not isinstance(version, bool):
        try:  # the readers' rule (records.check_format): a run of another format is not checked further
            check_format(version)
        except ValueError as e:
            problems.add(fmt.RUN_JSON, str(e))
            return None
    tensors = info.get("tensors")
    if not isinstance(tensors, dict) or not tensors or not all(
            isinstance(w, int) and w > 0 for w in tensors.values()):
        bad.append(f"tensors must map names to positive widths, got {tensors!r}")
    if info.get("dtype") not in fmt.STORED_DTYPES:
        bad.append(f"dtype {info.get('dtype')!r} is not one of {', '.join(fmt.STORED_DTYPES)}")
    data = info.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("num_streams"), int) or data["num_streams"] < 1:
        bad.append("data.num_streams must be a positive integer")
    else:
        counts = data.get("counts")
        if counts is not None and (not isinstance(counts, list) or len(counts) != data["num_streams"]
                                   or not all(isinstance(c, int) and c >= 0 for c in counts)):
            bad.append(f"data.counts must be null or {data['num_streams']} record counts, got {counts!r}")
        if counts is None and data["num_streams"] != 1:
            bad.append("data.counts is null (a source of unknown length) but num_streams is not 1")
        if data.get("streams") is not None and not all(
                isinstance(s, int) and 0 <= s < data["num_streams"] for s in data["streams"]):
            bad.append(f"data.streams must list stream numbers below num_streams, got {data['streams']!r}")
    typed = None
    if not bad:
        try:
            typed = RunInfo.from_json(info)
        except ValueError as e:
            bad.append(f"not a harvest run.json ({e})")
    for message in bad:
        problems.add(fmt.RUN_JSON, message)
    return typed


def list_stream(storage: Storage, s: int, problems: Problems, unfinished: Problems
                ) -> tuple[list[int], set[str], str, list[str]]:
    """The shard numbers that have a sidecar in the stream's committed generation (listing.read_generation, as
    every reader reads it), the data objects there, the generation, and the files ended generations still hold;
    reports unknown files in the current one, and a generation neither current nor ended (a wipe stopped between
    its swaps of the lease and of generation.json: the stream's next writer settles it) as unfinished."""
    record = read_generation(storage, s)
    generation = record.generation
    sdir = fmt.shard_dir(s, generation)
    sidecars, files = [], set()
    names = storage.listdir(sdir)
    for name in names:
        if (k := fmt.sidecar_shard(name)) is not None:
            sidecars.append(k)
        elif fmt.data_file_shard(name) is not None:
            files.add(name)
        elif name not in fmt.STREAM_FILES and fmt.dir_generation(name) is None:
            problems.add(f"{sdir}/{name}", "unknown file in a stream directory (not a shard, sidecar, "
                                           "progress.json, lease.json or generation.json)")
    for name in names if generation == "" else storage.listdir(fmt.stream_dir(s)):
        other = fmt.dir_generation(name)
        if other is not None and other != generation and other not in record.ended:
            unfinished.add(fmt.shard_dir(s, other) + "/", f"a generation no reader reads yet, nor ended (a wipe "
                                                          f"stopped part-way; generation.json names "
                                                          f"{generation or 'the stream directory'}): rerunning the "
                                                          "extraction settles it")
    return sorted(sidecars), files, generation, ended_files(storage, s, generation, names)


def ended_files(storage: Storage, s: int, generation: str, listed: list[str]) -> list[str]:
    """The files of the stream's ended generations, as its generation record names them (`listed`: the current
    generation's directory): what a writer stalled across a wipe landed after it. No reader reads them; a later
    wipe deletes them."""
    ended = read_generation(storage, s).ended
    top = listed if generation == "" else storage.listdir(fmt.stream_dir(s))
    found = [] if generation == "" or "" not in ended else [
        f"{fmt.stream_dir(s)}/{name}" for name in top
        if fmt.sidecar_shard(name) is not None or fmt.data_file_shard(name) is not None]
    for name in top:
        old = fmt.dir_generation(name)
        if old is not None and old != generation and old in ended:
            found += [f"{fmt.shard_dir(s, old)}/{child}" for child in storage.listdir(fmt.shard_dir(s, old))]
    return found


def checked_sidecar(storage: Storage, s: int, k: int, problems: Problems, generation: str) -> Sidecar | None:
    """A sidecar as the one reader of committed state reads it; None (and a problem) when it cannot be used."""
    try:
        return read_sidecar(storage, s, k, generation)
    except UserError as e:
        problems.add(fmt.sidecar_path(s, k, generation), f"unreadable sidecar ({e})")
    except ValueError as e:
        problems.add(fmt.sidecar_path(s, k, generation), f"bad sidecar: {e}")
    return None


def check_shard(storage: Storage, info: RunInfo, s: int, files: set[str], sc: Sidecar, problems: Problems):
    """Checksum and structure of one shard file; returns its (sample_ids, variants) or (None, None)."""
    rel, k = fmt.data_path(s, sc.file, sc.generation), sc.shard
    if sc.file not in files:
        problems.add(fmt.sidecar_path(s, k, sc.generation), f"sidecar without its data: {sc.file} is missing")
        return None, None
    try:
        data = storage.read_bytes(rel)
    except UserError as e:
        problems.add(rel, f"unreadable ({e})")
        return None, None
    try:
        if mismatch := sc.mismatch(data):
            problems.add(rel, mismatch)
        meta = encoding.shard_metadata(data)
        if meta.get("format") != "harvest":
            problems.add(rel, "safetensors metadata lacks format=harvest")
        if meta.get("stream", str(s)) != str(s) or meta.get("shard", str(k)) != str(k):
            problems.add(rel, f"its metadata says stream {meta.get('stream')} shard {meta.get('shard')}")
        t = encoding.decode_shard(data)
    except ValueError as e:
        problems.add(rel, str(e))
        return None, None
    del data
    bad = []
    for name, (dtype, ndim) in _EXPECTED_ARRAYS.items():
        if name not in t:
            bad.append(f"no {name} tensor")
        elif t[name].dtype != dtype or t[name].ndim != ndim:
            bad.append(f"{name} is {dtype_name(t[name])}{list(t[name].shape)}, expected {np.dtype(dtype).name} 1-d")
    if bad:
        for message in bad:
            problems.add(rel, message)
        return None, None
    n, n_tokens = len(t["sample_ids"]), len(t["tokens"])
    offsets = t["offsets"]
    if n != sc.samples:
        bad.append(f"{n} samples, sidecar says {sc.samples}")
    if n_tokens != sc.tokens:
        bad.append(f"{n_tokens} tokens, sidecar says {sc.tokens}")
    if len(t["variants"]) != n:
        bad.append(f"{len(t['variants'])} variants for {n} samples")
    if len(offsets) != n + 1 or offsets[0] != 0 or offsets[-1] != n_tokens or np.any(np.diff(offsets) < 0):
        bad.append(f"offsets must run non-decreasing from 0 to {n_tokens} over {n + 1} entries "
                   f"(got {len(offsets)} entries, {offsets[:1].tolist()}..{offsets[-1:].tolist()})")
    want_dtype = np.dtype(fmt.STORED_DTYPES[info.dtype])
    coded = quant.is_quantized(info.dtype)
    for name, width in info.tensors.items():
        if name not in t:
            bad.append(f"no {name} tensor")
        elif t[name].shape != (n_tokens, width) or t[name].dtype != want_dtype:
            bad.append(f"{name} is {dtype_name(t[name])}{list(t[name].shape)}, run.json says "
                       f"{info.dtype}[{n_tokens}, {width}]")
        elif coded and (problem := quant.scale_problem(t[name], t.get(quant.scale_name(name)), info.dtype)):
            bad.append(f"{quant.scale_name(name)} {problem}")
        stats = sc.stats.get(name)
        if not isinstance(stats, dict) or stats.get("count") != n_tokens or len(stats.get("mean") or []) != width:
            bad.append(f"sidecar stats for {name} do not cover {n_tokens} tokens x {width}")
    scales = {quant.scale_name(name) for name in info.tensors} if coded else set()
    extra = sorted(set(t) - set(info.tensors) - set(SHARD_ARRAYS) - scales)
    if extra:
        bad.append(f"tensors not in run.json: {', '.join(extra)}")
    for message in bad:
        problems.add(rel, message)
    if len(t["variants"]) != n:
        return None, None
    return t["sample_ids"], t["variants"]


def verify_all(urls: Sequence[str], *, workers: int = 4) -> list[Report]:
    """Each run on its own, or, when the URLs are parts of one run (see verify_split), that run."""
    storages = [Storage(str(url)) for url in urls]
    split = _split_run(storages)
    if split is None:
        return [verify(st, workers=workers) for st in storages]
    return verify_split(storages, split, workers=workers)


def _split_run(storages: list[Storage]) -> tuple[list[int], list[set[int]]] | None:
    """(the run's streams, the streams each output holds) when several outputs have one run.json config
    (config_sha256) and none holds every stream: a fleet's buckets, each written by some of its workers."""
    if len(storages) < 2 or not all(st.exists(fmt.RUN_JSON) for st in storages):
        return None
    try:
        infos = [read_run_info(st) for st in storages]
    except UserError:
        return None
    if len({i.config_sha256 for i in infos}) != 1:
        return None
    streams = covered_streams(infos[0])
    held = [set(list_stream_dirs(st)) for st in storages]
    return None if any(h >= set(streams) for h in held) else (streams, held)


def verify_split(storages: list[Storage], split: tuple[list[int], list[set[int]]], *,
                 workers: int = 4) -> list[Report]:
    """One run split over outputs: each output checked for the streams it holds, then one more report
    (named after all of them) on the split itself: every stream in exactly one output."""
    streams, held = split
    reports = [verify(st, workers=workers, only=h) for st, h in zip(storages, held)]
    whole = Report(url=" + ".join(st.url for st in storages), streams=len(streams))
    for s in streams:
        where = [st.url for st, h in zip(storages, held) if s in h]
        if not where:
            whole.unfinished.append(f"{fmt.stream_dir(s)}/: in none of the {len(storages)} outputs (never started)")
        elif len(where) > 1:
            whole.problems.append(f"{fmt.stream_dir(s)}/: written in {len(where)} outputs ({', '.join(where)}); "
                                  f"a stream belongs to exactly one worker")
    for r in reports:
        for name in ("records", "shards", "samples", "tokens", "bytes", "skipped"):
            setattr(whole, name, getattr(whole, name) + getattr(r, name))
    return [*reports, whole]
