"""`harvest status` and `harvest inspect`: what a run has done and what it holds, as rich renderables.

Committed counts (records, samples, tokens, shards) come from the sidecars, the truth: a stream's run of
shards numbered 0, 1, 2, ... Rates, worker and update time come from progress.json, which is for show only.
`watch` re-reads only new sidecars on each refresh.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any

import numpy as np
from rich.console import Console, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from harvest.errors import UserError
from harvest.ranges import format_ranges
from harvest.store import format as fmt
from harvest.store import step_parts
from harvest.storage import Storage
from harvest.store.listing import covered_streams, list_sidecars, read_run_info, stream_count
from harvest.store.records import Progress, RunInfo, Sidecar
from harvest.store.snapshot import Snapshot, shard_samples

STALE_S = 600.0  # a running stream whose progress.json is older than this is shown as stale


def _storage(url: str | Storage) -> Storage:
    return url if isinstance(url, Storage) else Storage(str(url))


def _age(updated_at: str | None, now: datetime) -> float | None:
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
        self.storage = _storage(url)
        self.info = read_run_info(self.storage)
        self.streams = covered_streams(self.info)
        self.threads = threads
        self._sidecars: dict[tuple[int, int], Sidecar] = {}

    def _scan_stream(self, stream: int) -> dict[str, Any]:
        sdir = fmt.stream_dir(stream)
        names = list_sidecars(self.storage, stream)
        committed: list[Sidecar] = []
        for expected, name in enumerate(names):  # the contiguous run from shard 0, as a resume sees it
            k = int(name[len("shard_"):-len(".json")])
            if k != expected:
                break
            if (stream, k) not in self._sidecars:
                try:
                    self._sidecars[(stream, k)] = Sidecar.from_bytes(self.storage.read_bytes(f"{sdir}/{name}"))
                except (ValueError, UserError):
                    break
            committed.append(self._sidecars[(stream, k)])
        progress = None
        try:
            if self.storage.exists(f"{sdir}/progress.json"):
                progress = Progress.from_bytes(self.storage.read_bytes(f"{sdir}/progress.json"))
        except (ValueError, UserError):
            progress = None  # being rewritten; status is for show
        return {"stream": stream, "committed": committed, "progress": progress}

    def committed(self) -> list[Sidecar]:
        """The committed shards' sidecars read so far (every one, after a scan), by (stream, shard)."""
        return [self._sidecars[key] for key in sorted(self._sidecars)]

    def scan(self) -> list[dict[str, Any]]:
        if len(self.streams) <= 1:
            return [self._scan_stream(s) for s in self.streams]
        with ThreadPoolExecutor(max_workers=min(self.threads, len(self.streams))) as pool:
            return list(pool.map(self._scan_stream, self.streams))


def _row(info: RunInfo, scanned: dict[str, Any], now: datetime) -> dict[str, Any]:
    s, committed, progress = scanned["stream"], scanned["committed"], scanned["progress"]
    done = bool(committed) and committed[-1].final
    records = committed[-1].records if committed else 0
    total = stream_count(info, s)
    if total is None:
        total = records if done else (progress.total if progress else None)
    age = _age(progress.updated_at if progress else None, now)
    if done:
        state = "done"
    elif not committed and not progress:
        state = "pending"
    elif age is not None and age > STALE_S:
        state = "stale"
    else:
        state = "running"
    return {
        "stream": s, "state": state, "records": records, "total": total,
        "samples": sum(sc.samples for sc in committed),
        "tokens": sum(sc.tokens for sc in committed),
        "shards": len(committed), "bytes": sum(sc.bytes for sc in committed),
        "rate": progress.tokens_per_s if progress and state == "running" else 0.0,
        "worker": progress.worker if progress else "-", "age": age,
    }


_STYLE = {"done": "green", "running": "cyan", "stale": "yellow", "pending": "dim"}


def _records_cell(records: int, total: int | None) -> str:
    if total:
        return f"{human_count(records)}/{human_count(total)} ({records / total:.0%})"
    return f"{human_count(records)}/?"


def status_rows(url: str | Storage | RunScanner, now: datetime | None = None) -> list[dict[str, Any]]:
    """Per-stream status as plain dicts (stream, state, records, total, samples, tokens, shards, bytes,
    rate, worker, age)."""
    scanner = url if isinstance(url, RunScanner) else RunScanner(url)
    now = now or datetime.now(timezone.utc)
    return [_row(scanner.info, scanned, now) for scanned in scanner.scan()]


def training_status(url: str | Storage, now: datetime | None = None) -> Table | None:
    """A `harvest train` run (run.json of kind "train"): its newest metrics and checkpoints; None otherwise."""
    storage = _storage(url)
    info = storage.read_json("run.json") if storage.exists("run.json") else {}
    if not isinstance(info, dict) or info.get("kind") not in ("train", "sae", "trm"):
        return None
    lines = storage.read_bytes("metrics.jsonl").decode().splitlines() if storage.exists("metrics.jsonl") else []
    last = json.loads(lines[-1]) if lines else {}
    steps = step_parts.complete_steps(storage.child("checkpoints"))
    config = info.get("config") or {}
    if info["kind"] == "sae":
        return _sae_status(storage, info, last, steps, now)
    if info["kind"] == "trm":
        return _trm_status(storage, info, last, steps, now)
    table = Table(title=f"{storage.url}: training {info.get('model_type', '?')} ({human_count(info.get('num_params', 0))} "
                        f"params) on {info.get('mesh', '?')}", title_justify="left")
    for name in ("step", "loss", "grad norm", "lr", "tokens/s", "MFU", "checkpoints", "updated"):
        table.add_column(name, justify="right")
    updated = datetime.fromtimestamp(last["time"], timezone.utc).isoformat() if "time" in last else None
    table.add_row(f"{last.get('step', 0)}/{config.get('steps', '?')}", f"{last['loss']:.4f}" if last else "-",
                  f"{last['grad_norm']:.3g}" if last else "-", f"{last['lr']:.3g}" if last else "-",
                  human_count(last["tokens_per_s"]) if last else "-", f"{last['mfu']:.1%}" if last else "-",
                  ", ".join(map(str, steps[-3:])) or "none", human_age(_age(updated, now or datetime.now(timezone.utc))))
    return table


def _sae_status(storage: Storage, info: dict, last: dict, steps: list[int], now: datetime | None) -> Table:
    """A `harvest sae train` run: its SAEs, newest metrics and checkpoints."""
    config = info.get("config") or {}
    saes = ", ".join(f"{name} ({sae['architecture']}, {human_count(sae['latents'])} latents)"
                     for name, sae in (info.get("saes") or {}).items())
    table = Table(title=f"{storage.url}: SAEs on {saes} on {info.get('mesh', '?')}", title_justify="left")
    for name in ("step", "tokens", "fvu", "l0", "dead", "aux loss", "tokens/s", "checkpoints", "updated"):
        table.add_column(name, justify="right")
    steps_total = (config.get("tokens") or 0) // max(config.get("batch_tokens") or 1, 1)
    updated = datetime.fromtimestamp(last["time"], timezone.utc).isoformat() if "time" in last else None
    table.add_row(f"{last.get('step', 0)}/{steps_total}", human_count(last.get("tokens", 0)),
                  f"{last['fvu']:.4f}" if last else "-", f"{last['l0']:.1f}" if last else "-",
                  f"{last['dead_fraction']:.1%}" if last else "-", f"{last['aux_loss']:.3g}" if last else "-",
                  human_count(last["tokens_per_s"]) if last else "-", ", ".join(map(str, steps[-3:])) or "none",
                  human_age(_age(updated, now or datetime.now(timezone.utc))))
    return table


def _trm_status(storage: Storage, info: dict, last: dict, steps: list[int], now: datetime | None) -> Table:
    """A TRM run: its model, newest metrics (exact accuracy and halting step of the samples that halted)."""
    model = (info.get("trm") or {}).get("model") or {}
    table = Table(title=f"{storage.url}: training TRM ({human_count(info.get('num_params', 0))} params, H "
                        f"{model.get('H_cycles', '?')} x L {model.get('L_cycles', '?')}) on {info.get('dataset', '?')} "
                        f"on {info.get('mesh', '?')}", title_justify="left")
    for name in ("step", "loss", "exact", "halt step", "lr", "tokens/s", "checkpoints", "updated"):
        table.add_column(name, justify="right")
    updated = datetime.fromtimestamp(last["time"], timezone.utc).isoformat() if "time" in last else None
    table.add_row(f"{last.get('step', 0)}/{info.get('steps', '?')}", f"{last['loss']:.4f}" if last else "-",
                  f"{last['exact_accuracy']:.1%}" if last else "-", f"{last['halt_step']:.2f}" if last else "-",
                  f"{last['lr']:.3g}" if last else "-", human_count(last["tokens_per_s"]) if last else "-",
                  ", ".join(map(str, steps[-3:])) or "none",
                  human_age(_age(updated, now or datetime.now(timezone.utc))))
    return table


def status_table(url: str | Storage | RunScanner, *, max_rows: int | None = None,
                 now: datetime | None = None) -> Table:
    """One row per stream the run covers, then a total row. With max_rows, streams not done come first
    and the rest fold into one line. A training run gets its own table (training_status)."""
    if not isinstance(url, RunScanner) and (training := training_status(url, now)) is not None:
        return training
    scanner = url if isinstance(url, RunScanner) else RunScanner(url)
    rows = status_rows(scanner, now)
    done = sum(r["state"] == "done" for r in rows)
    table = Table(title=f"{scanner.storage.url}: {done}/{len(rows)} streams done", title_justify="left")
    for name, justify in [("stream", "right"), ("state", "left"), ("records", "right"), ("samples", "right"),
                          ("tokens", "right"), ("shards", "right"), ("tokens/s", "right"), ("worker", "left"),
                          ("updated", "right")]:
        table.add_column(name, justify=justify)
    shown = rows
    if max_rows is not None and len(rows) > max_rows:
        first = sorted(rows, key=lambda r: (r["state"] == "done", r["state"] != "stale", r["stream"]))
        shown = first[:max(max_rows, 1)]
        shown.sort(key=lambda r: r["stream"])
    for r in shown:
        table.add_row(str(r["stream"]), Text(r["state"], style=_STYLE[r["state"]]),
                      _records_cell(r["records"], r["total"]),
                      human_count(r["samples"]), human_count(r["tokens"]), str(r["shards"]),
                      human_count(r["rate"]) if r["rate"] else "-", str(r["worker"]), human_age(r["age"]))
    if len(shown) < len(rows):
        hidden = [r for r in rows if r not in shown]
        table.add_row("...", Text(f"{len(hidden)} more", style="dim"), "", "", "", "", "", "",
                      f"{sum(r['state'] == 'done' for r in hidden)} of them done")
    totals = [r["total"] for r in rows]
    total = sum(totals) if all(t is not None for t in totals) else None
    ages = [r["age"] for r in rows if r["age"] is not None]
    table.add_row("total", Text(f"{done}/{len(rows)} done"), _records_cell(sum(r["records"] for r in rows), total),
                  human_count(sum(r["samples"] for r in rows)), human_count(sum(r["tokens"] for r in rows)),
                  str(sum(r["shards"] for r in rows)),
                  human_count(sum(r["rate"] for r in rows)) if any(r["rate"] for r in rows) else "-",
                  f"{len({r['worker'] for r in rows if r['state'] == 'running'})} running",
                  human_age(min(ages) if ages else None), style="bold", end_section=True)
    committed = Snapshot(scanner.storage.url, scanner.info, tuple(scanner.committed()))
    table.caption = "first tokens: " + "; ".join(f"{name} {first_token_share(committed, name)}"
                                                 for name in scanner.info.tensors)
    table.caption_justify = "left"
    return table


def watch(url: str | Storage, interval: float = 10.0, *, console: Console | None = None,
          until_done: bool = True) -> None:
    """Refresh the status table every `interval` seconds until every stream is done (or Ctrl-C). A training
    run: its table (training_status), until Ctrl-C."""
    console = console or Console()
    if training_status(url) is not None:
        _watch_training(url, interval, console)
        return
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


def _watch_training(url: str | Storage, interval: float, console: Console) -> None:
    try:
        with Live(training_status(url), console=console, refresh_per_second=4, transient=False) as live:
            while True:
                time.sleep(interval)
                live.update(training_status(url))
    except KeyboardInterrupt:
        return


def inspect(url: str | Storage, *, sample_tokens: int = 16) -> list[RenderableType]:
    """What a run holds: its setup, the committed totals, per-tensor stats, and one sample."""
    storage = _storage(url)
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
    for name in ("tensor", "width", "dtype", "tokens", "mean of means", "mean std", "max |mean|", "first tokens"):
        tensors.add_column(name, justify="left" if name == "tensor" else "right")
    for name, width in run.tensors.items():
        stats = run.stats(name)
        if stats.count:
            std = np.sqrt(stats.var)
            tensors.add_row(name, str(width), run.dtype, f"{stats.count:,}", f"{stats.mean.mean():+.4g}",
                            f"{std.mean():.4g}", f"{np.abs(stats.mean).max():.4g}", first_token_share(run, name))
        else:
            tensors.add_row(name, str(width), run.dtype, "0", "-", "-", "-", "-")

    out: list[RenderableType] = [about, tensors]
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


def first_token_share(run: Snapshot, name: str) -> str:
    """"0.9% hold 41% of variance": how much the samples' first tokens (attention sinks) weigh in a tensor's
    variance, from the sidecars' stats ("-" where they lack first-token stats); `sae train --skip-first`."""
    first, whole = run.first_token_stats(name), run.stats(name)
    if first is None or not whole.count:
        return "-"
    return f"{first.count / whole.count:.1%} hold {first.share_of(whole):.0%} of variance"


def _packing(storage: Storage, streams: list[int]) -> float | None:
    """Real tokens / row slots computed, over the streams' progress.json (each stream's latest session)."""
    real = slots = 0
    for stream in streams:
        rel = f"{fmt.stream_dir(stream)}/progress.json"
        try:
            progress = Progress.from_bytes(storage.read_bytes(rel)) if storage.exists(rel) else None
        except (ValueError, UserError):
            continue  # being rewritten: progress.json is for show
        if progress is not None and len(progress.packing) == 2:
            real, slots = real + progress.packing[0], slots + progress.packing[1]
    return real / slots if slots else None
