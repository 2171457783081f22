"""`harvest status` of a training run (`harvest train`, `harvest sae train`, TRM: run.json of kind "train", "sae"
or "trm"): its newest metrics and checkpoints, as a rich table, once or refreshed until Ctrl-C."""

from __future__ import annotations

import time
from datetime import datetime, timezone

from rich.console import Console
from rich.live import Live
from rich.table import Table

from harvest.console import table_console
from harvest.storage import Storage
from harvest.store.report import as_storage, human_age, human_count, seconds_since
from harvest.training.reader import TrainingRun, read_training


def training_status(url: str | Storage, now: datetime | None = None) -> Table | None:
    """A training run's table (run.json of kind "train", "sae" or "trm"): its newest metrics and checkpoints; None
    for any other run."""
    run = read_training(as_storage(url))
    if run.record is None:
        return None
    return {"train": _decoder_status, "sae": _sae_status, "trm": _trm_status}[run.record.kind](run, now)


def _row(table: Table, run: TrainingRun, now: datetime | None, cells: list[str]) -> Table:
    """The row: the step, the kind's cells, the newest checkpoints and when the trainer last logged."""
    updated = datetime.fromtimestamp(run.updated, timezone.utc).isoformat() if run.updated is not None else None
    table.add_row(*cells, ", ".join(map(str, run.checkpoints[-3:])) or "none",
                  human_age(seconds_since(updated, now or datetime.now(timezone.utc))))
    return table


def _table(title: str, columns: tuple[str, ...]) -> Table:
    table = Table(title=title, title_justify="left")
    for name in columns + ("checkpoints", "updated"):
        table.add_column(name, justify="right")
    return table


def _decoder_status(run: TrainingRun, now: datetime | None) -> Table:
    info, last = run.record.details, run.last
    table = _table(f"{run.url}: training {info.model_type or '?'} ({human_count(info.num_params)} params) on "
                   f"{run.record.mesh or '?'}", ("step", "loss", "grad norm", "lr", "tokens/s", "MFU"))
    return _row(table, run, now, [
        f"{last.get('step', 0)}/{run.record.config.get('steps', '?')}", f"{last['loss']:.4f}" if last else "-",
        f"{last['grad_norm']:.3g}" if last else "-", f"{last['lr']:.3g}" if last else "-",
        human_count(last["tokens_per_s"]) if last else "-", f"{last['mfu']:.1%}" if last else "-"])


def _sae_status(run: TrainingRun, now: datetime | None) -> Table:
    """A `harvest sae train` run: its SAEs, newest metrics and checkpoints."""
    config, last = run.record.config or {}, run.last
    saes = ", ".join(f"{name} ({sae['architecture']}, {human_count(sae['latents'])} latents)"
                     for name, sae in run.record.details.saes.items())
    table = _table(f"{run.url}: SAEs on {saes} on {run.record.mesh or '?'}",
                   ("step", "tokens", "fvu", "l0", "dead", "aux loss", "tokens/s"))
    steps_total = (config.get("tokens") or 0) // max(config.get("batch_tokens") or 1, 1)
    return _row(table, run, now, [
        f"{last.get('step', 0)}/{steps_total}", human_count(last.get("tokens", 0)),
        f"{last['fvu']:.4f}" if last else "-", f"{last['l0']:.1f}" if last else "-",
        f"{last['dead_fraction']:.1%}" if last else "-", f"{last['aux_loss']:.3g}" if last else "-",
        human_count(last["tokens_per_s"]) if last else "-"])


def _trm_status(run: TrainingRun, now: datetime | None) -> Table:
    """A TRM run: its model, newest metrics (exact accuracy and halting step of the samples that halted)."""
    info, last = run.record.details, run.last
    model = info.trm.get("model") or {}
    table = _table(f"{run.url}: training TRM ({human_count(info.num_params)} params, H {model.get('H_cycles', '?')} "
                   f"x L {model.get('L_cycles', '?')}) on {info.dataset or '?'} on {run.record.mesh or '?'}",
                   ("step", "loss", "exact", "halt step", "lr", "tokens/s"))
    return _row(table, run, now, [
        f"{last.get('step', 0)}/{info.steps if info.steps is not None else '?'}",
        f"{last['loss']:.4f}" if last else "-", f"{last['exact_accuracy']:.1%}" if last else "-",
        f"{last['halt_step']:.2f}" if last else "-", f"{last['lr']:.3g}" if last else "-",
        human_count(last["tokens_per_s"]) if last else "-"])


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
