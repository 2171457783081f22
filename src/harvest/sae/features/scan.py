"""The pass: this rank's shards, one at a time (each read by the reader's verified path, its bytes checked
against the sidecar), its rows encoded on the devices in batches of `batch_tokens` (the last one padded and
masked: one compile), the running state updated on device and added to the host state once per shard.

The state is saved under OUT/scan/ every SAVE_SECONDS (and after the first shard), as one atomic object; a
rerun with the same settings loads it and goes on after the shards it holds, so a pass killed and rerun ends
with the same bytes as one never killed. At the end the rank's part goes to OUT/scan/part-R-of-W."""

from __future__ import annotations

import contextlib
import os
import sys
import time

import jax
import numpy as np

from harvest.errors import UserError
from harvest.read.pieces import PieceReader
from harvest.read.shuffle import Piece
from harvest.sae.features import running as R
from harvest.sae.features.plan import Plan
from harvest.sae.features.state import Progress, TensorState, load_bytes, save_bytes
from harvest.storage import Storage
from harvest.store import format as fmt, quant

SCAN = "scan"
SAVE_SECONDS = 60.0
SLOW_SHARDS = "HARVEST_TEST_FEATURES_SHARD_SECONDS"  # tests: seconds to wait after each shard (to kill mid-pass)


def part_path(rank: int, world: int) -> str:
    return f"{SCAN}/part-{rank}-of-{world}.safetensors"


def state_path(rank: int, world: int) -> str:
    return f"{SCAN}/rank-{rank}-of-{world}.safetensors"


def load_state(out: Storage, rel: str, settings: dict) -> tuple[dict[str, TensorState], Progress] | None:
    """A saved state or part (None when absent); refused in one line when its settings are not `settings`."""
    if not out.exists(rel):
        return None
    try:
        states, progress = load_bytes(out.read_bytes(rel))
    except ValueError as e:
        raise UserError(f"{out.url_of(rel)}: {e}; delete it (or give another --out) to start the pass over") from None
    if progress.settings != settings:
        diff = [k for k in sorted(set(settings) | set(progress.settings))
                if settings.get(k) != progress.settings.get(k)]
        said = "; ".join(f"{k} {progress.settings.get(k)!r} then, {settings.get(k)!r} now" for k in diff)
        raise UserError(f"{out.url_of(rel)} was made with other settings ({said}); rerun with those, or give "
                        "another --out")
    return states, progress


def scan(plan: Plan, out: Storage, resumed: tuple[dict[str, TensorState], Progress] | None) -> dict[str, TensorState]:
    """This rank's pass from `resumed` (or the start); writes its part and returns its states."""
    cfg = plan.cfg
    settings = plan.settings()
    states, progress = resumed or ({t: TensorState.empty(s.latents, cfg.top, cfg.bins * cfg.per_bin)
                                    for t, s in plan.specs.items()}, Progress(settings, plan.listing()))
    mine = plan.mine()
    mesh = R.device_mesh()
    replicated = R.whole(mesh)
    params = {t: R.place(plan.params[t], spec, mesh) for t, spec in plan.specs.items()}
    encode = {t: R.make_encode(spec, mesh) for t, spec in plan.specs.items()}
    update = {t: R.make_update(spec, mesh) for t, spec in plan.specs.items()}
    running = {t: R.start(states[t], mesh) for t in plan.tensors}
    pause = float(os.environ.get(SLOW_SHARDS, 0) or 0)
    total = sum(plan.shards[o].sidecar.tokens for o in mine[progress.done:])
    saved_at = time.monotonic()
    with token_progress("features: reading", min(total, cfg.tokens - progress.tokens) if cfg.tokens else total) as bar:
        for ordinal in mine[progress.done:]:
            if cfg.tokens and progress.tokens >= cfg.tokens:
                break
            shard = plan.shards[ordinal]
            cols, rows = _rows(plan, reader(plan, shard.run), shard)  # a reader per shard: its caches go with it
            if cfg.tokens:
                rows = rows[:cfg.tokens - progress.tokens]
            for lo in range(0, len(rows), cfg.batch_tokens):
                take = rows[lo:lo + cfg.batch_tokens]
                valid = np.zeros(cfg.batch_tokens, bool)
                valid[:len(take)] = True
                offsets = np.zeros(cfg.batch_tokens, np.int32)
                offsets[:len(take)] = take
                valid_d, offsets_d = jax.device_put(valid, replicated), jax.device_put(offsets, replicated)
                for t in plan.tensors:
                    x = np.zeros((cfg.batch_tokens, plan.specs[t].width), np.float32)
                    x[:len(take)] = values(plan.runs[shard.run].dtype, cols, t, take)
                    acts = encode[t](params[t], jax.device_put(x, replicated))
                    running[t] = update[t](running[t], acts, valid_d, np.int32(ordinal), offsets_d)
                bar(len(take))
            for t in plan.tensors:
                running[t] = R.flush(running[t], states[t], mesh)
            progress = Progress(settings, progress.listing, progress.done + 1, progress.tokens + len(rows))
            if progress.done == 1 or time.monotonic() - saved_at >= SAVE_SECONDS:
                _save(out, state_path(cfg.rank, cfg.world), running, states, progress)
                saved_at = time.monotonic()
            if pause:
                time.sleep(pause)
    progress = Progress(settings, progress.listing, len(mine), progress.tokens)
    _save(out, part_path(cfg.rank, cfg.world), running, states, progress)
    out.delete(state_path(cfg.rank, cfg.world))
    return states


def _save(out: Storage, rel: str, running: dict, states: dict[str, TensorState], progress: Progress) -> None:
    for t, run in running.items():
        R.kept(run, states[t])
    out.write_bytes(rel, save_bytes(states, progress))


def reader(plan: Plan, r: int) -> PieceReader:
    """A reader of run `r`'s shards that checks every byte it reads against the sidecars."""
    run = plan.runs[r]
    stored = np.dtype(fmt.STORED_DTYPES.get(run.dtype, np.float32))
    reader = PieceReader(run.storage, run.view, plan.tensors, stored, verify="auto", on_corrupt="stop")
    reader.to_verify = {(s.sidecar.stream, s.sidecar.shard) for s in plan.shards if s.run == r}
    return reader


def _rows(plan: Plan, reader: PieceReader, shard) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """A shard's columns (checked) and the offsets of the rows read (those not left out), in order."""
    sc = shard.sidecar
    part = reader.read(Piece(sc.stream, sc.shard, 0, sc.tokens), sc, plan.exclude[shard.run], plan.skip_first,
                       plan.norm_limits[shard.run])
    rows = np.arange(sc.tokens) if part.keep is None else np.asarray(part.keep)
    return part.cols, rows.astype(np.int32)


def values(dtype: str, cols: dict[str, np.ndarray], tensor: str, rows: np.ndarray) -> np.ndarray:
    """Rows of a tensor as read (the stored dtype's bits) as float32 values (8-bit codes times their scales)."""
    stored = np.dtype(fmt.STORED_DTYPES.get(dtype, np.float32))
    x = cols[tensor][rows].view(stored)
    if quant.is_quantized(dtype):
        return quant.dequantize(x, cols[quant.scale_name(tensor)][rows].view(np.float32))
    return x.astype(np.float32)


@contextlib.contextmanager
def token_progress(label: str, total: int, unit: str = "tokens"):
    """A rich progress bar with `unit`/s on stderr when it is a terminal (else nothing); yields `advance(n)`."""
    if not sys.stderr.isatty() or total <= 0:
        yield lambda n: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress as Bar, ProgressColumn, TextColumn, TimeRemainingColumn
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task) -> Text:
            return Text(f"{task.speed or 0:,.0f} {unit}/s")

    with Bar(TextColumn(label), BarColumn(), TextColumn("{task.completed:,}/{task.total:,} " + unit), Rate(),
             TimeRemainingColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(label, total=total)
        yield lambda n: bar.advance(task, n)


def parts_present(out: Storage, world: int) -> list[int]:
    names = set(out.listdir(SCAN))
    return [r for r in range(world) if part_path(r, world).split("/", 1)[1] in names]

