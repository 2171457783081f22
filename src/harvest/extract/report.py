"""What a running extraction shows: a live progress bar (or log lines off a terminal), progress.json
per stream for `harvest status`, and the end-of-run summary of what was skipped, truncated or chunked.

The live line counts records (lines of the streams read) and samples (the pieces computed from them: one per
record under --long truncate or skip, less any bad input skipped; chunks and ARC variants add more) together, as
each packed block's last row is computed: the rows of a block hold its pieces in any order, so a block is the
unit in which both are known. Under --long truncate, samples never exceed records.
A resume re-packs the row that holds its stream's resume point, so pieces before that point are computed
again: the live line counts only pieces past it, and the summary's totals are the committed shards'."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
import threading
import time
from collections import Counter
from datetime import datetime, timezone
from typing import Any

from harvest.data.batching import SampleTokens, Row
from harvest.store.bounds import Waits
from harvest.store import format as fmt
from harvest.store.commit import ResumePoint
from harvest.store.listing import read_chains
from harvest.storage import Storage
from harvest.store.records import Progress as ProgressRecord
from harvest.store.records import Sidecar

log = logging.getLogger("harvest")
LOG_EVERY_S = 10.0


class Progress:
    """Counts rows as the host finishes them (live view) and shards as they commit (progress.json)."""

    def __init__(self, out: Storage, totals: dict[int, int | None], resume: dict[int, ResumePoint], worker: str,
                 slots: tuple[int, int] = (0, 0)):
        self.out = out
        self.slots = slots  # (data slots without a stream, data slots) this process feeds
        self.totals = totals
        self.worker = worker
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self.resumed = {s: resume[s].next for s in totals}
        self.records = {s: resume[s].next[0] for s in totals}
        self.samples = {s: resume[s].samples for s in totals}  # committed, then pieces computed past it (live)
        # What the committed shards hold, per stream: [records, samples, tokens] (the summary's totals).
        self.committed_totals = {s: [resume[s].next[0], resume[s].samples, resume[s].tokens] for s in totals}
        self.tokens_committed = 0  # committed by this process
        self.bytes_committed = 0  # the data objects of those shards
        self.session_tokens = 0  # computed in this process, for the rate
        self.packing = {s: [0, 0] for s in totals}  # [real, computed] row tokens of each stream this session
        self.shards = 0
        self.waits = Waits()  # where the pipeline's stages wait: what bounds the run

    def rows_done(self, stream: int, row: Row) -> None:
        with self._lock:
            if row.block:  # the block's last row: all its pieces are computed now
                self.records[stream] = max(self.records[stream], row.block[-1].pos[0] + 1)
                self.samples[stream] += sum(isinstance(event, SampleTokens) and event.pos >= self.resumed[stream]
                                            for event in row.block)
            if row.end is not None:
                self.records[stream] = max(self.records[stream], row.end.records)
            self.session_tokens += row.used
            self.packing[stream][0] += row.used
            self.packing[stream][1] += len(row.tokens)

    def committed(self, manifest: Sidecar) -> None:
        with self._lock:
            self.shards += 1
            totals = self.committed_totals[manifest.stream]
            totals[:] = [manifest.records if manifest.final else manifest.next[0], totals[1] + manifest.samples,
                         totals[2] + manifest.tokens]
            self.tokens_committed += manifest.tokens
            self.bytes_committed += manifest.bytes
            rate = self.session_tokens / max(time.monotonic() - self.started, 1e-9)
            packing = tuple(self.packing.get(manifest.stream, (0, 0)))
        shares = self.waits.shares(live=True)
        record = ProgressRecord(
            stream=manifest.stream, records_done=manifest.records if manifest.final else manifest.next[0],
            total=manifest.records if manifest.final else self.totals.get(manifest.stream),
            shards=manifest.shard + 1, tokens_per_s=round(rate, 1), worker=self.worker,
            updated_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), done=manifest.final, packing=packing,
            bound=shares.bound, bound_share=round(shares.bound_share, 3), slots=self.slots)
        self.out.write_bytes(fmt.progress_path(manifest.stream), record.to_bytes())

    def line(self) -> str:
        with self._lock:
            done = sum(self.records.values())
            known = all(t is not None for t in self.totals.values())
            total = sum(t for t in self.totals.values() if t is not None)
            rate = self.session_tokens / max(time.monotonic() - self.started, 1e-9)
        of = f"/{total}" if known else ""
        return (f"records {done}{of} read, samples {sum(self.samples.values())}, {rate:,.0f} tokens/s, "
                f"shards {self.shards} committed")

    @contextlib.contextmanager
    def display(self):
        """A rich progress bar on a terminal; plain log lines every LOG_EVERY_S otherwise."""
        if not sys.stderr.isatty():
            with _every(LOG_EVERY_S, lambda: log.info(self.line())):
                yield
            return
        from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        known = all(t is not None for t in self.totals.values())
        total = sum(t for t in self.totals.values() if t is not None) if known else None
        with Bar(TextColumn("extract"), BarColumn(bar_width=20), TextColumn("{task.description}"),
                 TimeRemainingColumn()) as bar:
            task = bar.add_task(self.line(), total=total, completed=sum(self.records.values()))

            def refresh():
                bar.update(task, completed=sum(self.records.values()), description=self.line())

            with _every(0.5, refresh):
                yield
            refresh()


@contextlib.contextmanager
def _every(seconds: float, tick):
    """Call `tick` every `seconds` on a thread while the block runs."""
    stop = threading.Event()

    def loop():
        while not stop.wait(seconds):
            tick()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def summarize(out: Storage, chosen: list[int], *, elapsed: float, progress: Progress) -> dict[str, Any]:
    """The end-of-run account: what the streams' committed shards hold (as `harvest verify` counts it: every
    sidecar of the streams, those of earlier commands a resume went on from included), what this process
    computed, and nothing truncated, skipped or chunked unsaid."""
    sidecars = [sc for chain in read_chains(out, chosen).values() for sc in chain]
    long: Counter = Counter()
    for sc in sidecars:
        long.update(sc.long)
    skipped = [entry for sc in sidecars for entry in sc.skipped]
    reasons = Counter(s["reason"].split(" (")[0] for s in skipped)
    real, computed = (sum(counts) for counts in zip(*progress.packing.values())) if progress.packing else (0, 0)
    stored, tokens = sum(sc.bytes for sc in sidecars), sum(sc.tokens for sc in sidecars)
    shares = progress.waits.shares()
    return {
        "out": out.url,
        "streams": len(chosen),
        "records": sum(records for records, _, _ in progress.committed_totals.values()),
        "samples": sum(samples for _, samples, _ in progress.committed_totals.values()),
        "tokens": sum(tokens for _, _, tokens in progress.committed_totals.values()),
        "tokens_this_run": progress.tokens_committed,
        "seconds": round(elapsed, 2),
        "tokens_per_s": round(progress.session_tokens / max(elapsed, 1e-9), 1),
        "bytes_per_s": round(progress.bytes_committed / max(elapsed, 1e-9), 1),  # what storage absorbed
        "packing_efficiency": round(real / computed, 4) if computed else 1.0,  # real tokens / row tokens computed
        "bytes_per_token": round(stored / tokens, 1) if tokens else 0.0,  # the data objects of the streams' shards
        "waits": dataclasses.asdict(shares),  # each stage's share of the pipeline's time (harvest.store.bounds)
        "bound": shares.line(),
        "shards_written": progress.shards,
        "truncated": long["truncated"],
        "chunked": long["chunked"],
        "skipped_long": long["skipped"],
        "skipped": len(skipped),
        "skip_reasons": dict(reasons.most_common(8)),
        "skip_examples": [f"{s['location']}: {s['reason']}" for s in skipped[:5]],
    }
