"""`harvest status` and `harvest inspect` of an extraction run: what it has done and what it holds, as rich
renderables (a training run's status is harvest.training.status's).

Committed counts (records, samples, tokens, shards) come from the sidecars, the truth: a stream's run of
shards numbered 0, 1, 2, ... Rates, worker and update time come from progress.json, which is for show only.
`watch` re-reads only new sidecars on each refresh.
"""

from __future__ import annotations

import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import numpy as np
from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from harvest.console import table_console
from harvest.ranges import format_ranges
from harvest.storage import Storage
from harvest.store import format as fmt
from harvest.store.bounds import ADVICE, IDLE_SLOTS_ADVICE
from harvest.store.listing import (covered_streams, read_chains, read_lease, read_progress, read_run_info,
                                   stream_count)
from harvest.store.records import RunInfo, Sidecar
from harvest.store.snapshot import Snapshot, shard_samples
from harvest.store.stats import RunningStats
from harvest.tl_hooks import tl_hook_of_tensor

STALE_S = 600.0  # a running stream whose progress.json is older than this is shown as stale


def as_storage(url: str | Storage) -> Storage:
    return url if isinstance(url, Storage) else Storage(str(url))


def seconds_since(updated_at: str | None, now: datetime) -> float | None:
    if not updated_at:
        return None
    try:
        then = datetime.fromisoformat(updated_at)
    except ValueError:
        return None
    if then.tzinfo is None:
        then = then.replace(tzinfo=timezone.utc)
    return max(0.0, (now - then).total_seconds())


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 172800:
        return f"{seconds / 3600:.1f}h ago"
    return f"{seconds / 86400:.1f}d ago"


def human_count(n: float) -> str:
    for unit in ("", "K", "M", "B", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return str(n)


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


class RunScanner:
    """Reads a run's progress; keeps sidecars between scans (a committed sidecar does not change)."""

    def __init__(self, url: str | Storage, threads: int = 16):
        self.storage = as_storage(url)
        self.info = read_run_info(self.storage)
        self.streams = covered_streams(self.info)
        self.threads = threads
        self._sidecars: dict[tuple[int, int], Sidecar] = {}
        self._chains: dict[int, list[Sidecar]] = {}

    def committed(self) -> list[Sidecar]:
        """The committed chains' sidecars of the last scan, by (stream, shard)."""
        return [sc for stream in sorted(self._chains) for sc in self._chains[stream]]

    def scan(self) -> list[dict[str, Any]]:
        """Each stream's committed chain up to any break (lenient: status shows a broken run; verify says
        what is wrong) and its progress.json."""
        chains = self._chains = read_chains(self.storage, self.streams, strict=False, known=self._sidecars)
        with ThreadPoolExecutor(max_workers=max(1, min(self.threads, len(self.streams)))) as pool:
            progress = list(pool.map(lambda s: read_progress(self.storage, s), self.streams))
            leases = list(pool.map(lambda s: read_lease(self.storage, s), self.streams))
        return [{"stream": s, "committed": chains[s], "progress": p, "lease": lease}
                for s, p, lease in zip(self.streams, progress, leases)]


def _row(info: RunInfo, scanned: dict[str, Any], now: datetime) -> dict[str, Any]:
    s, committed, progress = scanned["stream"], scanned["committed"], scanned["progress"]
    done = bool(committed) and committed[-1].final
    records = committed[-1].records if committed else 0
    total = stream_count(info, s)
    if total is None:
        total = records if done else (progress.total if progress else None)
    age = seconds_since(progress.updated_at if progress else None, now)
    if done:
        state = "done"
    elif not committed and not progress:
        state = "pending"
    elif scanned["lease"] is not None and scanned["lease"].released:
        state = "stopped"  # its worker ended (--strict, SIGTERM, a full disk, ...) and let the stream go
    elif age is not None and age > STALE_S:
        state = "stale"
    else:
        state = "running"
    tokens, stored = sum(sc.tokens for sc in committed), sum(sc.bytes for sc in committed)
    rate = progress.tokens_per_s if progress and state == "running" else 0.0
    return {
        "stream": s, "state": state, "records": records, "total": total,
        "samples": sum(sc.samples for sc in committed), "tokens": tokens, "shards": len(committed),
        "bytes": stored, "rate": rate, "bytes_per_token": stored / tokens if tokens else 0.0,
        # what storage absorbs: the rate at the bytes per token its committed shards hold (0 before the first)
        "byte_rate": rate * stored / tokens if tokens else 0.0,
        "worker": progress.worker if progress else "-", "age": age,
        # the stage that bounded the stream's worker, as it last recorded it, and that stage's share of its time
        "bound": (progress.bound, progress.bound_share) if progress and progress.bound else None,
        # (data slots without a stream, data slots) of the worker's process, as it last recorded them
        "slots": tuple(progress.slots) if progress and len(progress.slots) == 2 else None,
    }


_STYLE = {"done": "green", "running": "cyan", "stale": "yellow", "stopped": "yellow", "pending": "dim"}


def _records_cell(records: int, total: int | None) -> str:
    if total:
        return f"{human_count(records)}/{human_count(total)} ({records / total:.0%})"
    return f"{human_count(records)}/?"


def status_rows(url: str | Storage | RunScanner, now: datetime | None = None) -> list[dict[str, Any]]:
    """Per-stream status as plain dicts (stream, state, records, total, samples, tokens, shards, bytes,
    rate (tokens/s), byte_rate (bytes/s), bytes_per_token, worker, age, bound ((stage, share) or None))."""
    scanner = url if isinstance(url, RunScanner) else RunScanner(url)
    now = now or datetime.now(timezone.utc)
    return [_row(scanner.info, scanned, now) for scanned in scanner.scan()]


def status_table(url: str | Storage | RunScanner, *, max_rows: int | None = None,
                 now: datetime | None = None) -> Table:
    """One row per stream the run covers, then a total row. With max_rows, streams not done come first
    and the rest fold into one line."""
    scanner = url if isinstance(url, RunScanner) else RunScanner(url)
    rows = status_rows(scanner, now)
    done = sum(r["state"] == "done" for r in rows)
    table = Table(title=f"{scanner.storage.url}: {done}/{len(rows)} streams done", title_justify="left")
    for name, justify in [("stream", "right"), ("state", "left"), ("records", "right"), ("samples", "right"),
                          ("tokens", "right"), ("shards", "right"), ("stored", "right"), ("B/token", "right"),
                          ("tokens/s", "right"), ("bytes/s", "right"), ("bound", "left"), ("worker", "left"),
                          ("updated", "right")]:
        table.add_column(name, justify=justify)
    shown = rows
    if max_rows is not None and len(rows) > max_rows:
        first = sorted(rows, key=lambda r: (r["state"] == "done", r["state"] not in ("stale", "stopped"),
                                            r["stream"]))
        shown = first[:max(max_rows, 1)]
        shown.sort(key=lambda r: r["stream"])
    for r in shown:
        table.add_row(str(r["stream"]), Text(r["state"], style=_STYLE[r["state"]]),
                      _records_cell(r["records"], r["total"]),
                      human_count(r["samples"]), human_count(r["tokens"]), str(r["shards"]), human_bytes(r["bytes"]),
                      _per_token(r["bytes"], r["tokens"]), human_count(r["rate"]) if r["rate"] else "-",
                      human_bytes(r["byte_rate"]) if r["byte_rate"] else "-", _bound_cell(r["bound"]),
                      str(r["worker"]), human_age(r["age"]))
    if len(shown) < len(rows):
        hidden = [r for r in rows if r not in shown]
        table.add_row("...", Text(f"{len(hidden)} more", style="dim"), "", "", "", "", "", "", "", "", "", "",
                      f"{sum(r['state'] == 'done' for r in hidden)} of them done")
    totals = [r["total"] for r in rows]
    total = sum(totals) if all(t is not None for t in totals) else None
    ages = [r["age"] for r in rows if r["age"] is not None]
    tokens, stored = sum(r["tokens"] for r in rows), sum(r["bytes"] for r in rows)
    bounds = Counter(stage for _, stage in {(r["worker"], r["bound"][0]) for r in rows if r["bound"]})  # workers
    table.add_row("total", Text(f"{done}/{len(rows)} done"), _records_cell(sum(r["records"] for r in rows), total),
                  human_count(sum(r["samples"] for r in rows)), human_count(tokens),
                  str(sum(r["shards"] for r in rows)), human_bytes(stored), _per_token(stored, tokens),
                  human_count(sum(r["rate"] for r in rows)) if any(r["rate"] for r in rows) else "-",
                  human_bytes(sum(r["byte_rate"] for r in rows)) if any(r["byte_rate"] for r in rows) else "-",
                  ", ".join(f"{stage} x{n}" for stage, n in bounds.most_common()) or "-",
                  f"{len({r['worker'] for r in rows if r['state'] == 'running'})} running",
                  human_age(min(ages) if ages else None), style="bold", end_section=True)
    committed = Snapshot(scanner.storage.url, scanner.info, tuple(scanner.committed()))
    table.caption = "\n".join([
        "first tokens: " + "; ".join(f"{name} {first_token_share(committed, name)}" for name in scanner.info.tensors),
        f"bytes per token: {_per_token(stored, tokens)} stored; the values "
        + ", ".join(f"{name} {size:,} B" for name, size in token_bytes(scanner.info).items())
        + f" ({scanner.info.dtype}{', with a float32 scale' if scanner.info.quantization else ''})",
        *(f"bound {stage}: {ADVICE[stage]}" for stage in bounds if stage in ADVICE),
        *(f"idle slots: {worker} computed {idle} of its {slots} data slots as padding, with no stream to take: "
          f"{IDLE_SLOTS_ADVICE}" for worker, (idle, slots) in idle_slots_of(rows).items())])
    table.caption_justify = "left"
    return table


def idle_slots_of(rows: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """{worker: (data slots without a stream, data slots)} of the workers whose last record has idle slots."""
    return {r["worker"]: r["slots"] for r in rows if r["slots"] and r["slots"][0]}


def token_bytes(info: RunInfo) -> dict[str, int]:
    """Each tensor's bytes per token as stored: its width in the run's dtype, plus a float32 scale where the
    values are 8-bit codes (harvest.store.quant); a shard adds its header and the token ids."""
    itemsize = np.dtype(fmt.STORED_DTYPES[info.dtype]).itemsize
    return {name: width * itemsize + (4 if info.quantization else 0) for name, width in info.tensors.items()}


def _per_token(stored: int, tokens: int) -> str:
    return f"{stored / tokens:,.0f} B" if tokens else "-"


def _bound_cell(bound: tuple[str, float] | None) -> str:
    return f"{bound[0]} {bound[1]:.0%}" if bound else "-"


def watch(url: str | Storage, interval: float = 10.0, *, console: Console | None = None,
          until_done: bool = True) -> None:
    """Refresh the status table every `interval` seconds until every stream is done (or Ctrl-C)."""
    console = console or table_console()
    scanner = RunScanner(url)
    try:
        with Live(status_table(scanner, max_rows=max(console.height - 8, 4)), console=console,
                  refresh_per_second=4, transient=False) as live:
            while True:
                rows = status_rows(scanner)
                live.update(status_table(scanner, max_rows=max(console.height - 8, 4)))
                if until_done and rows and all(r["state"] == "done" for r in rows):
                    return
                time.sleep(interval)
    except KeyboardInterrupt:
        return


def inspect(url: str | Storage, *, sample_tokens: int = 16) -> list[RenderableType]:
    """What a run holds: its setup, the committed totals, per-tensor stats, and one sample."""
    storage = as_storage(url)
    run = Snapshot.take(storage)
    info, data, model = run.info, run.info.data, run.info.model
    streams = covered_streams(info)
    done = sum(run.done(s) for s in streams)
    skipped = sum(len(sc.skipped) for sc in run.shards)
    counts = data.get("counts")

    about = Table.grid(padding=(0, 2))
    about.add_column(style="bold")
    about.add_column()
    about.add_row("run", run.url)
    about.add_row("model", f"{model.get('source', '?')} ({model.get('model_type', '?')}, "
                           f"{model.get('num_layers', '?')} layers, d={model.get('hidden_size', '?')}, "
                           f"ffn={model.get('intermediate_size', '?')})")
    points = ", ".join(f"{p}:{format_ranges(layers)}" for p, layers in info.points)
    about.add_row("points", points or ", ".join(run.tensors))
    about.add_row("dtype", f"{run.dtype} (computed in {info.compute_dtype})")
    about.add_row("input", f"{data.get('source', '?')}, format {info.format}, max_seq_len "
                           f"{info.max_seq_len}, long {info.long}")
    about.add_row("streams", f"{done}/{len(streams)} done"
                  + (f", {sum(counts):,} records" if isinstance(counts, list) else ", length unknown"))
    about.add_row("committed", f"{run.num_samples:,} samples, {run.num_tokens:,} tokens, {len(run.shards)} shards, "
                               f"{human_bytes(run.num_bytes)}, {skipped} skipped")
    packing = _packing(storage, streams)
    if packing is not None:
        about.add_row("packing", f"{packing:.1%} of computed row slots hold real tokens (last session of each stream)")
    about.add_row("version", f"harvest {info.harvest_version}, format {info.format_version}, "
                             f"config {info.config_sha256[:12]}")

    tensors = Table(title="tensors (stats over every committed token; first tokens: each sample's first, their "
                          "share of the tokens and of the variance)", title_justify="left")
    for name in ("tensor", "TransformerLens hook", "width", "dtype", "tokens", "mean of means", "mean std",
                 "max |mean|", "first tokens"):
        tensors.add_column(name, justify="left" if name in ("tensor", "TransformerLens hook") else "right")
    for name, width in run.tensors.items():
        stats, hook = run.stats(name), tl_hook_of_tensor(name) or "-"
        if stats.count:
            std = np.sqrt(stats.var)
            tensors.add_row(name, hook, str(width), run.dtype, f"{stats.count:,}", f"{stats.mean.mean():+.4g}",
                            f"{std.mean():.4g}", f"{np.abs(stats.mean).max():.4g}", first_token_share(run, name))
        else:
            tensors.add_row(name, hook, str(width), run.dtype, "0", "-", "-", "-", "-")

    out: list[RenderableType] = [about, tensors]
    if run.num_tokens:
        out.append(massive_table(storage, run))
    first = next((sc for sc in run.shards if sc.samples > 0), None)
    if first is not None:
        sample = next(shard_samples(storage, first, list(run.tensors)))
        n = min(sample_tokens, len(sample.tokens))
        table = Table(title=f"sample {sample.sample_id} variant {sample.variant} (stream {sample.stream}, "
                            f"{len(sample.tokens)} tokens): first {n} tokens, activation L2 norms",
                      title_justify="left")
        table.add_column("", style="bold")
        for j in range(n):
            table.add_column(str(j), justify="right")
        table.add_row("token", *(str(int(t)) for t in sample.tokens[:n]))
        for name, values in sample.activations.items():
            norms = np.linalg.norm(np.asarray(values[:n], np.float32), axis=-1)
            table.add_row(name, *(f"{v:.3g}" for v in norms))
        out.append(table)
    else:
        out.append(Text("no committed sample yet", style="dim"))
    return out


MASSIVE_RATIO = 20  # inspect's massive activations: tokens over this many times the median L2 norm
MASSIVE_BYTES = 256 * 2**20  # inspect reads the run's first shards, up to about this many bytes


def massive_activations(storage: Storage, run: Snapshot, *, ratio: float = MASSIVE_RATIO,
                        max_bytes: int = MASSIVE_BYTES) -> tuple[int, dict[str, dict[str, Any]]]:
    """Where a run's massive activations sit, in its first shards (in (stream, shard) order, whole shards up to
    about `max_bytes`): (tokens read, {tensor: {median (L2 norm over those tokens), count (tokens over `ratio` x
    median), positions ({position in its sample: count}), share (of the tokens' variance the massive ones hold),
    later_share (of the variance of the tokens past each sample's first, the massive ones among them hold:
    what `--skip-first 1` leaves)}})."""
    names, rows, read = list(run.tensors), {n: [] for n in run.tensors}, 0
    positions = []
    for sc in run.shards:
        if sc.samples == 0:
            continue
        if read and read * sc.bytes / max(sc.tokens, 1) >= max_bytes:
            break
        for sample in shard_samples(storage, sc, names):
            positions.append(np.arange(len(sample.tokens)))
            for n in names:
                rows[n].append(np.asarray(sample.activations[n], np.float32))
        read += sc.tokens
    where = np.concatenate(positions) if positions else np.zeros(0, np.int64)
    out = {}
    for n in names:
        x = np.concatenate(rows[n]) if rows[n] else np.zeros((0, run.tensors[n]), np.float32)
        norms = np.sqrt(np.einsum("ij,ij->i", x.astype(np.float64), x.astype(np.float64)))
        median = float(np.median(norms)) if len(norms) else 0.0
        massive = norms > ratio * median
        later = where > 0
        share = (RunningStats.of(x[massive]).share_of(RunningStats.of(x)) if massive.any() else 0.0)
        later_share = (RunningStats.of(x[massive & later]).share_of(RunningStats.of(x[later]))
                       if (massive & later).any() else 0.0)
        found, counts = np.unique(where[massive], return_counts=True)
        out[n] = {"median": median, "count": int(massive.sum()), "positions": dict(zip(found.tolist(), counts.tolist())),
                  "share": share, "later_share": later_share}
    return len(where), out


def massive_table(storage: Storage, run: Snapshot, ratio: float = MASSIVE_RATIO) -> Table:
    """inspect's table of massive_activations: per tensor, how many, at which positions, their share of variance."""
    read, found = massive_activations(storage, run, ratio=ratio)
    table = Table(title=f"massive activations: tokens over {ratio:g}x the median L2 norm, in the first {read:,} tokens "
                        "(sae train --skip-first N leaves out each sample's first N; --max-norm R every token over "
                        "R x the median)", title_justify="left")
    for name in ("tensor", "median norm", "massive", "at position 0", "at later positions (position: count)",
                 "share of variance", "later positions' share"):
        table.add_column(name, justify="left" if name in ("tensor", "at later positions (position: count)") else "right")
    for name, f in found.items():
        later = {p: c for p, c in f["positions"].items() if p > 0}
        shown = ", ".join(f"{format_ranges([p])}: {c}" for p, c in list(later.items())[:8])
        if len(later) > 8:
            shown += f", ... ({len(later) - 8} more positions, up to {max(later)})"
        table.add_row(name, f"{f['median']:.4g}", f"{f['count']:,}", f"{f['positions'].get(0, 0):,}",
                      f"{sum(later.values()):,}" + (f" ({shown})" if later else ""), f"{f['share']:.0%}",
                      f"{f['later_share']:.0%}")
    return table


def first_token_share(run: Snapshot, name: str) -> str:
    """"0.9% hold 41% of variance": how much the samples' first tokens (attention sinks) weigh in a tensor's
    variance, from the sidecars' stats ("-" where they lack first-token stats); `sae train --skip-first`."""
    first, whole = run.first_token_stats(name), run.stats(name)
    if first is None or not whole.count:
        return "-"
    return f"{first.count / whole.count:.1%} hold {first.share_of(whole):.0%} of variance"


def _packing(storage: Storage, streams: list[int]) -> float | None:
    """Real tokens / row tokens computed, over the streams' progress.json (each stream's latest session)."""
    real = computed = 0
    for progress in (read_progress(storage, stream) for stream in streams):
        if progress is not None and len(progress.packing) == 2:
            real, computed = real + progress.packing[0], computed + progress.packing[1]
    return real / computed if computed else None
