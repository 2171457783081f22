"""`harvest status` of a training run (`harvest train`, `harvest sae train`, TRM: run.json of kind "train", "sae"
or "trm"): its newest metrics and checkpoints, as a rich table, once or refreshed until Ctrl-C."""

from __future__ import annotations

import json
import time
from datetime import datetime, timezone

from rich.console import Console
from rich.live import Live
from rich.table import Table

from harvest.console import table_console
from harvest.storage import Storage
from harvest.store.report import as_storage, human_age, human_count, seconds_since
from harvest.train import step_parts


def training_status(url: str | Storage, now: datetime | None = None) -> Table | None:
    """A training run's table (run.json of kind "train", "sae" or "trm"): its newest metrics and checkpoints; None
    for any other run."""
    storage = as_storage(url)
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
    table = Table(title=f"{storage.url}: training {info.get('model_type', '?')} "
                        f"({human_count(info.get('num_params', 0))} params) on {info.get('mesh', '?')}",
                  title_justify="left")
    for name in ("step", "loss", "grad norm", "lr", "tokens/s", "MFU", "checkpoints", "updated"):
        table.add_column(name, justify="right")
    updated = datetime.fromtimestamp(last["time"], timezone.utc).isoformat() if "time" in last else None
    table.add_row(f"{last.get('step', 0)}/{config.get('steps', '?')}", f"{last['loss']:.4f}" if last else "-",
                  f"{last['grad_norm']:.3g}" if last else "-", f"{last['lr']:.3g}" if last else "-",
                  human_count(last["tokens_per_s"]) if last else "-", f"{last['mfu']:.1%}" if last else "-",
                  ", ".join(map(str, steps[-3:])) or "none",
                  human_age(seconds_since(updated, now or datetime.now(timezone.utc))))
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
                  human_age(seconds_since(updated, now or datetime.now(timezone.utc))))
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
                  human_age(seconds_since(updated, now or datetime.now(timezone.utc))))
    return table


def watch(url: str | Storage, interval: float = 10.0, *, console: Console | None = None) -> None:
    """Refresh a training run's table every `interval` seconds until Ctrl-C."""
    console = console or table_console()
    try:
        with Live(training_status(url), console=console, refresh_per_second=4, transient=False) as live:
            while True:
                time.sleep(interval)
                live.update(training_status(url))
    except KeyboardInterrupt:
        return
