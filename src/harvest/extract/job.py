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
import logging
import queue
import threading
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any, Iterator

import jax
import numpy as np

from harvest.config import ExtractConfig, parse_ranges, stable_hash
from harvest.data import prompts, streams
from harvest.data.batching import Row, pack_stream, stream_pieces
from harvest.errors import UserError
from harvest.extract.report import Progress, summarize
from harvest.model import Decoder, default_compute_dtype, load_decoder
from harvest.model.weights import resolve_checkpoint
from harvest.runtime import distributed
from harvest.runtime.mesh import make_mesh
from harvest.store import format as fmt
from harvest.store.commit import Leases, resume_point
from harvest.store.fs import Storage
from harvest.store.writer import Committer, ShardWriter

log = logging.getLogger(__name__)
QUEUE_DEPTH = 2


class RunMismatch(UserError):
    pass


@dataclasses.dataclass
class Batch:
    tokens: np.ndarray  # [slots * batch_size, seq]
    segments: np.ndarray
    rows: list[tuple[int, Row] | None]  # per batch row: (stream, row), None for padding rows


def run_extract(cfg: ExtractConfig) -> dict[str, Any]:
    """Run (or resume) an extraction; returns the summary printed at the end."""
    distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id)
    mesh = make_mesh(cfg.mesh or f"data={jax.device_count()}")
    out = Storage(cfg.out)
    checkpoint = resolve_checkpoint(cfg.model)
    tokenizer = prompts.load_tokenizer(checkpoint)
    data = streams.open_data(cfg.data)
    chosen = _chosen_streams(cfg, data.num_streams)
    compute_dtype = cfg.compute_dtype or default_compute_dtype()
    decoder = load_decoder(checkpoint, cfg.points, mesh, compute_dtype, out_dtype=cfg.dtype)
    run_info = _run_info(cfg, decoder, checkpoint, data, compute_dtype)

    if cfg.overwrite:
        _wipe(out, chosen)
    _check_or_write_run(out, run_info)
    worker = cfg.worker_id or f"{__import__('socket').gethostname()}:{jax.process_index()}"
    leases = Leases(out, worker)
    leases.acquire(chosen)
    try:
        return _extract(cfg, decoder, tokenizer, data, chosen, out, leases, run_info)
    finally:
        leases.release_all()


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


def _run_info(cfg: ExtractConfig, decoder: Decoder, checkpoint: Path, data, compute_dtype: str) -> dict[str, Any]:
    m = decoder.cfg
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
        "points": [[p, list(layers)] for p, layers in decoder.plan.points],
        "tensors": {fmt.tensor_name(p, layer): (m.intermediate_size if p == "mlp_hidden" else m.hidden_size)
                    for p, layer in decoder.plan.keys()},
        "dtype": cfg.dtype,
        "compute_dtype": compute_dtype,
        "max_seq_len": cfg.max_seq_len,
        "long": cfg.long,
        "format": cfg.format,
        "data": {"source": cfg.data, "num_streams": data.num_streams, "counts": counts, "mapping": "round_robin"},
        "config": cfg.to_dict(),
    }
    info["config_sha256"] = stable_hash(_agreed(info))
    return info


def _agreed(info: dict[str, Any]) -> dict[str, Any]:
    """What two commands writing into one run must agree on (not flags like --batch-size or --streams)."""
    settings = {k: info["config"][k] for k in ExtractConfig.OUTPUT_FIELDS}
    return {"model": info["model"]["config_sha256"], "tokenizer": info["tokenizer_sha256"], "data": info["data"],
            "tensors": info["tensors"], "compute_dtype": info["compute_dtype"], **settings}


def _check_or_write_run(out: Storage, info: dict[str, Any]) -> None:
    if out.exists("run.json"):
        existing = out.read_json("run.json")
        old, new = _agreed(existing), _agreed(info)
        differ = [f"{k}: {old.get(k)!r} -> {new[k]!r}" for k in new if old.get(k) != new[k]]
        if differ:
            raise RunMismatch(f"{out.url} holds a run made with other settings ({'; '.join(differ)}); "
                              "use another --out, or --overwrite to start over")
        return
    out.write_json("run.json", info)


def _wipe(out: Storage, chosen: list[int]) -> None:
    for stream in chosen:
        directory = fmt.stream_dir(stream)
        for name in out.listdir(directory):
            out.delete(f"{directory}/{name}")
    out.delete("run.json")


def _extract(cfg, decoder: Decoder, tokenizer, data, chosen, out: Storage, leases: Leases, info) -> dict[str, Any]:
    resume = {s: resume_point(out, s) for s in chosen}
    todo = [s for s in chosen if not resume[s].done]
    slots = decoder.mesh.shape["data"] * decoder.mesh.shape["fsdp"]
    widths = info["tensors"]
    dtype = np.dtype(fmt.DTYPES[cfg.dtype])
    writers = {s: ShardWriter(s, widths, dtype, cfg.shard_bytes, resume[s]) for s in todo}
    totals = info["data"]["counts"]
    progress = Progress(out, {s: (totals[s] if totals else None) for s in chosen}, resume, worker=leases.worker)
    committer = Committer(out, on_commit=progress.committed)
    encode = prompts.encoder(tokenizer, cfg.format)
    arc = {"encoder": cfg.arc_encoder, "augment": cfg.arc_augment, "include_answer": cfg.arc_include_answer}
    if cfg.arc_template is not None:
        arc["template"] = cfg.arc_template
    render = prompts.make_renderer(cfg.format, tokenizer, text_field=cfg.text_field, seed=cfg.seed,
                                   arc=prompts.ArcOptions(**arc))

    def stream_rows(stream: int) -> Iterator[Row]:
        point = resume[stream]
        records = data.records(stream, start=point.row_start[0])
        if cfg.max_samples is not None:
            records = _limit(records, cfg.max_samples - point.row_start[0])
        events = stream_pieces(records, render, encode, first_index=point.row_start[0],
                               max_seq_len=cfg.max_seq_len, long=cfg.long, strict=cfg.strict,
                               sample_error=prompts.SampleError)
        return pack_stream(events, cfg.max_seq_len, skip_before=point.row_start)

    plan = [todo[k::slots] for k in range(slots)]
    batches: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
    captured: queue.Queue = queue.Queue(maxsize=QUEUE_DEPTH)
    failure: list[BaseException] = []
    feeder = _Stage(lambda: _feed(plan, stream_rows, cfg.batch_size, cfg.max_seq_len, batches, failure), failure)
    host = _Stage(lambda: _to_shards(captured, decoder, writers, committer, progress), failure)
    start = time.monotonic()
    with progress.display():
        while (batch := _get(batches, failure)) is not None:
            outputs = decoder(batch.tokens, batch.segments)
            for array in outputs.values():
                array.copy_to_host_async()
            _put(captured, (batch, outputs), failure)
        _put(captured, None, failure)
        host.join(failure)
        feeder.join(failure)
        committer.close()
    for stream in todo:
        leases.release(stream)
    return summarize(out, chosen, elapsed=time.monotonic() - start, progress=progress)


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


def _feed(plan: list[list[int]], stream_rows, batch_size: int, seq_len: int, batches: queue.Queue,
          failure: list[BaseException]) -> None:
    """Batches of `batch_size` rows per slot; a slot that runs out of streams pads with empty rows."""
    iterators = [_chain(streams_of_slot, stream_rows) for streams_of_slot in plan]
    live = [True] * len(plan)
    while any(live):
        rows: list[tuple[int, Row] | None] = []
        for slot, it in enumerate(iterators):
            for _ in range(batch_size):
                item = next(it, None) if live[slot] else None
                if item is None:
                    live[slot] = False
                rows.append(item)
        if not any(rows):
            break
        tokens = np.zeros((len(rows), seq_len), np.int32)
        segments = np.zeros((len(rows), seq_len), np.int32)
        for i, item in enumerate(rows):
            if item is not None:
                tokens[i], segments[i] = item[1].tokens, item[1].segments
        _put(batches, Batch(tokens, segments, rows), failure)
    _put(batches, None, failure)


def _chain(stream_ids: list[int], stream_rows) -> Iterator[tuple[int, Row]]:
    for stream in stream_ids:
        for row in stream_rows(stream):
            yield stream, row


def _to_shards(captured: queue.Queue, decoder: Decoder, writers, committer: Committer, progress: Progress) -> None:
    """Host side: captures to numpy, rows to their stream's writer, closed shards to the committer."""
    names = [(p, j, fmt.tensor_name(p, layer)) for p, layers in decoder.plan.points for j, layer in enumerate(layers)]
    while (item := captured.get()) is not None:
        batch, outputs = item
        host = {p: np.asarray(v) for p, v in outputs.items()}
        for r, entry in enumerate(batch.rows):
            if entry is None:
                continue
            stream, row = entry
            values = {name: host[p][j, r, : row.used] for p, j, name in names}
            for shard in writers[stream].add_row(row, values):
                committer.submit(shard)
            progress.rows_done(stream, row)
