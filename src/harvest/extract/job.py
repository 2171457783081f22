"""The extraction job: streams -> packed batches -> forward with captures -> shards, exactly once.

Three stages overlap, joined by bounded queues (a slow stage makes the others wait; nothing is dropped):
  feeder thread   reads records, renders and tokenizes them, packs rows, assembles batches;
  main thread     runs the forward on device and starts the device->host copies;
  host thread     takes the captures to host numpy and cuts them into shards, which the Committer's
                  threads encode and write (data, then sidecar).
Each data slot of the mesh (data x fsdp) works through its own streams, one at a time; a row never
spans two streams. Resume is the default: each stream restarts from its committed shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import queue
import socket
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np

from harvest.config import ExtractConfig, stable_hash
from harvest.data import prompts, streams
from harvest.data.batching import Row, pack_stream, stream_pieces
from harvest.errors import UserError
from harvest.extract.report import Progress, summarize
from harvest.extract.shards import ShardWriter
from harvest.model import (
    CapturePlan,
    Decoder,
    ModelConfig,
    default_compute_dtype,
    load_decoder,
    parse_points,
)
from harvest.model.weights import resolve_checkpoint
from harvest.ranges import parse_ranges
from harvest.runtime import distributed
from harvest.runtime.mesh import describe, make_mesh
from harvest.store import format as fmt
from harvest.store.commit import Committer, resume_point
from harvest.store.fs import Storage
from harvest.store.lease import LEASE, Leases
from harvest.store.records import RunInfo

QUEUE_DEPTH = 2


class RunMismatch(UserError):
    pass


@dataclasses.dataclass
class Batch:
    tokens: np.ndarray  # [slots * batch_size, seq]
    segments: np.ndarray
    rows: list[tuple[int, Row] | None]  # per batch row: (stream, row), None for padding rows


def run_extract(cfg: ExtractConfig) -> dict[str, Any]:
    """Run (or resume) an extraction; returns the summary printed at the end.

    Everything that can refuse the command is checked before the first lease or byte is written (settings,
    mesh, points, streams, tokenizer and renderer, the run.json diff, storage reachable), so a refused
    command leaves the output as it was. The first write is a lease: where storage refuses it, nothing
    was written.
    """
    distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, timeout_s=cfg.peer_timeout)
    mesh = make_mesh(cfg.mesh or f"data={jax.device_count()}")
    out = Storage(cfg.out)
    checkpoint = resolve_checkpoint(cfg.model)
    model = ModelConfig.from_dir(checkpoint)
    plan = parse_points(cfg.points, model.num_layers)
    data = streams.open_data(cfg.data)
    chosen = _chosen_streams(cfg, data.num_streams)
    compute_dtype = cfg.compute_dtype or default_compute_dtype()
    run_info = _run_info(cfg, model, plan, checkpoint, data, compute_dtype)
    distributed.agree({**_agreed(run_info), "harvest_version": run_info.harvest_version, "streams": chosen,
                       "mesh": describe(mesh), "batch_size": cfg.batch_size}, "the run's settings")
    tokenizer = prompts.load_tokenizer(checkpoint)
    render = _renderer(cfg, tokenizer)
    fed, owned = _slot_plan(mesh, chosen)
    mine = sorted(s for k in owned for s in fed[k])
    if not cfg.overwrite:
        _check_run(out, run_info)  # storage reachable; the first lease is the first write, and checks it

    failure: list[BaseException] = []
    worker = cfg.worker_id or f"{socket.gethostname()}:{jax.process_index()}"
    leases = Leases(out, worker, ttl_s=cfg.lease_ttl, on_lost=failure.append)
    leases.acquire(mine)  # --overwrite included: never delete streams that another worker holds
    try:
        if cfg.overwrite:
            distributed.barrier("harvest-leased")  # every process holds its streams before anything is deleted
            _wipe(out, mine, run_json=jax.process_index() == 0)
            distributed.barrier("harvest-overwrite")
        for stream in mine:  # ours now: clear what a killed predecessor's interrupted writes left
            out.remove_stale_temps(fmt.stream_dir(stream))
        if jax.process_index() == 0 and not out.create_exclusive("run.json", run_info.to_bytes()):
            _check_run(out, run_info)  # another worker created it meanwhile: it must be the same run
        # Loaded only now: a worker refused above (lease, run.json) spends nothing on the weights.
        decoder = load_decoder(checkpoint, cfg.points, mesh, compute_dtype, out_dtype=cfg.dtype)
        return _extract(cfg, decoder, tokenizer, render, data, fed, mine, out, leases, run_info, failure)
    finally:
        leases.release_all()


def _renderer(cfg: ExtractConfig, tokenizer) -> prompts.Renderer:
    """The record -> prompts function; raises UserError for a bad template, field or tokenizer."""
    arc = {"encoder": cfg.arc_encoder, "augment": cfg.arc_augment, "include_answer": cfg.arc_include_answer}
    if cfg.arc_template is not None:
        arc["template"] = cfg.arc_template
    return prompts.make_renderer(cfg.format, tokenizer, text_field=cfg.text_field, seed=cfg.seed,
                                 arc=prompts.ArcOptions(**arc))


def _slot_plan(mesh, chosen: list[int]) -> tuple[dict[int, list[int]], set[int]]:
    """Slot k (the k-th block of the batch, over data x fsdp) takes streams chosen[k::slots]. A process
    feeds every slot with a device on it (the model axis may span hosts: each feeds the same rows) and
    owns, i.e. writes, the slots whose first device is its own."""
    grid = mesh.devices.reshape(-1, mesh.devices.shape[-1])
    me = jax.process_index()
    fed = {k: chosen[k :: len(grid)] for k, devices in enumerate(grid) if any(d.process_index == me for d in devices)}
    return fed, {k for k in fed if grid[k][0].process_index == me}


def _chosen_streams(cfg: ExtractConfig, num_streams: int) -> list[int]:
    if cfg.streams is None:
        return list(range(num_streams))
    chosen = parse_ranges(cfg.streams, "--streams")
    if chosen[-1] >= num_streams:
        raise UserError(f"--streams {cfg.streams}: the data has streams 0-{num_streams - 1}")
    return chosen


def _file_hash(paths: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in paths:
        if path.exists():
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _run_info(cfg: ExtractConfig, m: ModelConfig, plan: CapturePlan, checkpoint: Path, data,
              compute_dtype: str) -> RunInfo:
    counts = None if None in data.counts else list(data.counts)  # a plain source: length unknown
    if counts is not None and cfg.max_samples is not None:
        counts = [min(c, cfg.max_samples) for c in counts]
    info = {
        "format_version": fmt.FORMAT_VERSION,
        "harvest_version": version("harvest"),
        "model": {"source": cfg.model, "model_type": m.model_type, "config_sha256": stable_hash(m.to_dict()),
                  "num_layers": m.num_layers, "hidden_size": m.hidden_size,
                  "intermediate_size": m.intermediate_size},
        "tokenizer_sha256": _file_hash([checkpoint / n for n in ("tokenizer.json", "tokenizer_config.json",
                                                                 "chat_template.jinja")]),
        "special_token_ids": prompts.special_token_ids(checkpoint),  # left out of SAE batches by the reader
        "points": [[p, list(layers)] for p, layers in plan.points],
        "tensors": {fmt.tensor_name(p, layer): (m.intermediate_size if p == "mlp_hidden" else m.hidden_size)
                    for p, layer in plan.keys()},
        "dtype": cfg.dtype,
        "compute_dtype": compute_dtype,
        "max_seq_len": cfg.max_seq_len,
        "long": cfg.long,
        "format": cfg.format,
        "data": {"source": _data_url(cfg.data), "num_streams": data.num_streams, "counts": counts,
                 "mapping": "round_robin", "sha256": getattr(data, "sha256", None)},
        "config": cfg.to_dict(),
    }
    return RunInfo(**info, config_sha256=stable_hash(_agreed(RunInfo(**info, config_sha256=""))))


def _data_url(spec: str) -> str:
    """A local path made absolute: the same files named from another working directory are the same data."""
    return spec if "://" in spec else os.path.abspath(spec)


def _agreed(info: RunInfo) -> dict[str, Any]:
    """What two commands writing into one run must agree on (not flags like --batch-size or --streams)."""
    settings = {k: info.config.get(k) for k in ExtractConfig.OUTPUT_FIELDS}
    data = dict(info.data)
    if data.get("sha256"):  # streams: their content (streams.json's sha256 per file) decides, not their URL
        data.pop("source", None)
    return {"model": info.model.get("config_sha256"), "tokenizer": info.tokenizer_sha256, "data": data,
            "tensors": info.tensors, "compute_dtype": info.compute_dtype, **settings}


def _check_run(out: Storage, info: RunInfo) -> None:
    """Refuse to add to a run made with other settings, showing the difference."""
    if not out.exists("run.json"):
        return
    try:
        existing = RunInfo.from_bytes(out.read_bytes("run.json"))
    except ValueError as e:
        raise RunMismatch(f"{out.url}/run.json: not a harvest run.json ({e}); use another --out") from None
    old, new = _agreed(existing), _agreed(info)
    differ = [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in new if old.get(k) != new[k]]
    if differ:
        raise RunMismatch(f"{out.url} holds a run made with other settings ({'; '.join(differ)}); "
                          "use another --out, or --overwrite to start over")


def _wipe(out: Storage, streams_to_wipe: list[int], run_json: bool) -> None:
    for stream in streams_to_wipe:
        directory = fmt.stream_dir(stream)
        for name in out.listdir(directory):
            if name != LEASE:  # ours: --overwrite runs under the lease
                out.delete(f"{directory}/{name}")
    if run_json:
        out.delete("run.json")


def _extract(cfg, decoder: Decoder, tokenizer, render, data, slots: dict[int, list[int]], mine: list[int],
             out: Storage, leases: Leases, info, failure: list[BaseException]) -> dict[str, Any]:
    resume = {s: resume_point(out, s) for streams_of_slot in slots.values() for s in streams_of_slot}
    distributed.barrier("harvest-resume-read")  # every feeder of a stream starts from the same commit
    todo = {k: [s for s in streams_of_slot if not resume[s].done] for k, streams_of_slot in slots.items()}
    widths = info.tensors
    dtype = np.dtype(fmt.DTYPES[cfg.dtype])
    writers = {s: ShardWriter(s, widths, dtype, cfg.shard_bytes, resume[s]) for s in mine if not resume[s].done}
    totals = info.data["counts"]
    progress = Progress(out, {s: (totals[s] if totals else None) for s in mine}, resume, worker=leases.worker)
    committer = Committer(out, on_commit=progress.committed, guard=leases.check)
    encode = prompts.encoder(tokenizer, cfg.format)

    def stream_rows(stream: int) -> Iterator[Row]:
        point = resume[stream]
        records = data.records(stream, start=point.row_start[0])
        if cfg.max_samples is not None:
            records = _limit(records, cfg.max_samples - point.row_start[0])
        events = stream_pieces(records, render, encode, first_index=point.row_start[0],
                               max_seq_len=cfg.max_seq_len, long=cfg.long, strict=cfg.strict,
                               sample_error=prompts.SampleError)
        return pack_stream(events, cfg.max_seq_len, skip_before=point.row_start)

    num_slots = decoder.mesh.shape["data"] * decoder.mesh.shape["fsdp"]
    shape = (num_slots * cfg.batch_size, cfg.max_seq_len)
    idle = Batch(np.zeros(shape, np.int32), np.zeros(shape, np.int32), [None] * shape[0])
    batches: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
    captured: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
    feeder = _Stage(lambda: _feed(todo, stream_rows, cfg.batch_size, shape, batches, failure), failure)
    host = _Stage(lambda: _to_shards(captured, decoder, writers, committer, progress), failure)
    start = time.monotonic()
    local_done = False
    with progress.display(), distributed.peers_watched():
        while True:
            batch = None if local_done else _get(batches, failure)
            local_done = batch is None
            # Every process runs every step (the model may span hosts); the run ends on all of them together.
            if not distributed.any_true(not local_done):
                break
            outputs = decoder((batch or idle).tokens, (batch or idle).segments)
            if batch is not None and writers:
                for array in outputs.values():
                    for shard in _local_blocks(array):
                        shard.data.copy_to_host_async()
                _put(captured, (batch, outputs), failure)
        _put(captured, None, failure)
        host.join(failure)
        feeder.join(failure)
        committer.close()
    for stream in writers:
        leases.release(stream)
    with distributed.peers_watched():
        distributed.barrier("harvest-extract-done")
    return summarize(out, mine, elapsed=time.monotonic() - start, progress=progress)


def _local_blocks(array: jax.Array) -> list:
    """One addressable shard per distinct batch block (model-axis replicas hold the same rows); each holds
    whole rows at full width, as forward's output sharding pins them."""
    seen: dict[int, Any] = {}
    for shard in array.addressable_shards:
        if shard.data.shape[-1] != array.shape[-1]:
            raise AssertionError(f"captures split along their width: {array.sharding}")
        seen.setdefault(shard.index[1].start or 0, shard)
    return [seen[k] for k in sorted(seen)]


def _limit(records, n: int):
    for k, record in enumerate(records):
        if k >= n:
            return
        yield record


class _Stage(threading.Thread):
    """A pipeline thread whose exception is handed to the main thread instead of being lost."""

    def __init__(self, target, failure: list[BaseException]):
        super().__init__(daemon=True)
        self._target_fn = target
        self._failure = failure
        self.start()

    def run(self) -> None:
        try:
            self._target_fn()
        except BaseException as e:
            self._failure.append(e)

    def join(self, failure=None) -> None:  # type: ignore[override]
        super().join()
        if failure:
            raise failure[0]


def _put(q: queue.Queue, item, failure: list[BaseException]) -> None:
    while True:
        if failure:
            raise failure[0]
        try:
            q.put(item, timeout=0.5)
            return
        except queue.Full:
            continue


def _get(q: queue.Queue, failure: list[BaseException]):
    while True:
        if failure:
            raise failure[0]
        try:
            return q.get(timeout=0.5)
        except queue.Empty:
            continue


def _feed(slots: dict[int, list[int]], stream_rows, batch_size: int, shape: tuple[int, int], batches: queue.Queue,
          failure: list[BaseException]) -> None:
    """Batches of `batch_size` rows for each slot this process feeds (the other blocks stay empty: other
    processes feed them); a slot out of streams pads with empty rows."""
    iterators = {k: _chain(streams_of_slot, stream_rows) for k, streams_of_slot in slots.items()}
    live = {k: True for k in slots}
    while any(live.values()):
        tokens, segments = np.zeros(shape, np.int32), np.zeros(shape, np.int32)
        rows: list[tuple[int, Row] | None] = [None] * shape[0]
        for k, it in iterators.items():
            for i in range(k * batch_size, (k + 1) * batch_size):
                item = next(it, None) if live[k] else None
                if item is None:
                    live[k] = False
                    continue
                rows[i] = item
                tokens[i], segments[i] = item[1].tokens, item[1].segments
        if any(rows):
            _put(batches, Batch(tokens, segments, rows), failure)
    _put(batches, None, failure)


def _chain(stream_ids: list[int], stream_rows) -> Iterator[tuple[int, Row]]:
    for stream in stream_ids:
        for row in stream_rows(stream):
            yield stream, row


def _to_shards(captured: queue.Queue, decoder: Decoder, writers, committer: Committer, progress: Progress) -> None:
    """Host side: the rows of the slots this process owns, to numpy, to their stream's writer; closed shards
    to the committer."""
    names = [(p, j, fmt.tensor_name(p, layer)) for p, layers in decoder.plan.points for j, layer in enumerate(layers)]
    while (item := captured.get()) is not None:
        batch, outputs = item
        blocks = {p: [(shard.index[1].start or 0, np.asarray(shard.data)) for shard in _local_blocks(v)]
                  for p, v in outputs.items()}
        for r, entry in enumerate(batch.rows):
            if entry is None or entry[0] not in writers:  # another process writes that slot
                continue
            stream, row = entry
            values = {}
            for p, j, name in names:
                start, block = next((s, b) for s, b in reversed(blocks[p]) if s <= r)
                values[name] = block[j, r - start, : row.used]
            for shard in writers[stream].add_row(row, values):
                committer.submit(shard)
            progress.rows_done(stream, row)
