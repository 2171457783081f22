"""An SAE's data: the runs it reads, checked before anything is written, and their rows as global arrays.

Each step's batch takes equal parts of every run (one harvest reader per run, seeded, shuffled, rows over
the mesh's data axes). With --follow the runs may still be written (or not started): their readers follow
them (harvest.read.rounds), recording the rounds they read in the SAE run's `follow/run_R/`.
A run's held-out streams (chosen by the seed) are never read by training; `sae eval`
reads them. Every reader's position goes into the checkpoint: each process's own, gathered so that every
process writes the same data file.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from harvest.errors import UserError
from harvest.read.jax_data import GlobalBatches
from harvest.read.rounds import wait_for_run
from harvest.read.run import Run, open_run
from harvest.runtime.mesh import data_slots
from harvest.sae.step import DATA_AXES
from harvest.storage import Storage
from harvest.store.listing import covered_streams


class SaeInputError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class Inputs:
    runs: list[Run]
    widths: dict[str, int]  # tensor -> width, the same in every run
    holdout: list[list[int]]  # per run: streams left out of training
    streams: list[list[int]]  # per run: the streams read (training and held out)

    def train_streams(self, r: int) -> list[int]:
        return [s for s in self.streams[r] if s not in self.holdout[r]]

    def median_norms(self, tensors: list[str]) -> list[dict[str, float]]:
        """Per run, {tensor: its median token norm} over every stream it reads (harvest.read.batches.median_norms)."""
        return [run.median_norms(tensors, streams=streams) for run, streams in zip(self.runs, self.streams)]

    def mean_square_norm(self, tensor: str) -> float:
        """E ||x||^2 over every committed token of every run (their merged stats)."""
        total = count = 0.0
        for run in self.runs:
            stats = run.stats(tensor)
            total += float(np.sum(stats.m2 + stats.count * stats.mean.astype(np.float64) ** 2))
            count += stats.count
        return total / max(count, 1)


def open_inputs(urls: tuple[str, ...], tensors: tuple[str, ...], holdout_streams: int, seed: int,
                follow: float | None = None) -> Inputs:
    """Open the runs; refuse (one line) a tensor one of them lacks, a run with no committed shard, widths
    that differ between runs, or held-out streams that leave nothing to train on. Following (`follow`: the
    seconds between listings), a run not started yet is waited for, and every stream it covers is read,
    committed yet or not."""
    runs = [open_run(storage) if follow is None else Run(storage, wait_for_run(storage, follow))
            for storage in map(Storage, urls)]
    widths: dict[str, int] = {}
    for run in runs:
        missing = [t for t in tensors if t not in run.tensors]
        if missing:
            raise SaeInputError(f"{run.url} holds no {', '.join(missing)}; it holds {', '.join(run.tensors)}")
        if follow is None and (not run.streams or run.num_tokens == 0):
            raise SaeInputError(f"{run.url} has no committed shards yet: nothing to train on")
        for t in tensors:
            if widths.setdefault(t, run.tensors[t]) != run.tensors[t]:
                raise SaeInputError(f"{t} is {widths[t]} wide in {runs[0].url} but {run.tensors[t]} in {run.url}: "
                                    "one SAE needs runs of the same width")
    holdout, streams = [], [run.streams if follow is None else covered_streams(run.info) for run in runs]
    for run, read in zip(runs, streams):
        if holdout_streams >= len(read):
            raise SaeInputError(f"--holdout-streams {holdout_streams}: {run.url} has {len(read)} streams"
                                + ("" if follow else " with committed shards") + "; keep at least one for training")
        picked = np.random.default_rng(seed).choice(read, holdout_streams, replace=False)
        holdout.append(sorted(int(s) for s in picked))
    return Inputs(runs, widths, holdout, streams)


def check_batch(batch_tokens: int, runs: int, mesh: Mesh) -> int:
    """Rows per run per step; refuses a batch whose parts do not divide over the data slots."""
    slots = data_slots(mesh)
    part = batch_tokens // runs
    if part % slots:
        raise SaeInputError(f"--batch-tokens {batch_tokens}" + (f" / {runs} runs = {part}" if runs > 1 else "")
                            + f" rows is not a multiple of the mesh's {slots} data slots (data x fsdp); "
                            f"use a multiple of {slots * runs}")
    return part


def readers(inputs: Inputs, tensors: list[str], part: int, mesh: Mesh, seed: int,
            streams: list[list[int]] | None = None, epochs: int | None = None,
            skip_first: int = 0, follow: float | None = None, book: Storage | None = None,
            on_wait: Callable[[], None] | None = None, max_norm: float = 0.0,
            medians: list[dict[str, float]] | None = None) -> list[GlobalBatches]:
    """One reader per run, `part` rows a step each, of its training streams (or `streams`), without each
    sample's first `skip_first` tokens, nor (`max_norm` R > 0) the tokens over R x the run's median norm
    (`medians[r]`, per tensor); following the runs (`follow`) with their rounds in `book`/run_R."""
    def following(r: int) -> dict:
        return {} if follow is None else {"follow": follow, "rounds": book and book.child(f"run_{r}"),
                                          "on_wait": on_wait}

    return [run.jax_batches(part, tensors, mesh=mesh, data_axes=DATA_AXES, seed=seed, epochs=epochs,
                            dtype="float32", skip_first=skip_first,
                            **({"max_norm": max_norm, "median_norm": medians[r]} if max_norm else {}),
                            streams=inputs.train_streams(r) if streams is None else streams[r], **following(r))
            for r, run in enumerate(inputs.runs)]


def held_out(inputs: Inputs, tensors: list[str], part: int, mesh: Mesh, seed: int,
             batches: int, skip_first: int = 0, max_norm: float = 0.0,
             medians: list[dict[str, float]] | None = None) -> dict[str, jax.Array]:
    """Up to `batches` batches ({tensor: [n, B, d]}) of the held-out streams, read once: the same rows at
    every evaluation during training. Refuses held-out streams shorter than one batch."""
    readers_ = readers(inputs, tensors, part, mesh, seed, streams=inputs.holdout, epochs=1, skip_first=skip_first,
                       max_norm=max_norm, medians=medians)
    rows = []
    for _ in range(batches):
        try:
            rows.append(next_batch(readers_, tensors))
        except StopIteration:
            break
    if not rows:
        raise SaeInputError(f"--eval-every: the {sum(map(len, inputs.holdout))} held-out streams hold fewer than one "
                            f"batch of {part} rows per run; hold out more streams (--holdout-streams)")
    return {t: jnp.stack([r[t] for r in rows]) for t in tensors}


def next_batch(batches: list[GlobalBatches], tensors: list[str]) -> dict[str, jax.Array]:
    """The step's rows of every tensor: the runs' parts one after another."""
    parts = [next(b) for b in batches]
    if len(parts) == 1:
        return {t: parts[0][t] for t in tensors}
    return {t: jnp.concatenate([p[t] for p in parts]) for t in tensors}


def gather_states(batches: list[GlobalBatches]) -> list[list[dict]]:
    """Every process's reader states ([process][run]), on every process (a collective)."""
    mine = json.dumps([b.state_dict() for b in batches]).encode()
    if jax.process_count() == 1:
        return [json.loads(mine)]
    from jax.experimental import multihost_utils

    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([len(mine)], np.int64))).reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[:len(mine)] = np.frombuffer(mine, np.uint8)
    table = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(bytes(row[:n])) for row, n in zip(table, lengths)]


def left_out(batches: list[GlobalBatches]) -> tuple[int, int]:
    """(tokens the norm rule left out, tokens it looked at) by this process's readers, in the groups read so far."""
    return (sum(b.reader.massive_left_out for b in batches), sum(b.reader.tokens_considered for b in batches))
