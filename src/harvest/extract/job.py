"""The extraction job: streams -> packed batches -> forward with captures -> shards, exactly once.

`run_extract` checks everything that could refuse the command, takes the leases, writes run.json, loads
the model and runs the pipeline (harvest.extract.pipeline) over this worker's streams. SIGTERM (a spot VM's
preemption notice) stops it within seconds: no batch is taken after it, the shards already closed are
committed, the leases released, and the command exits 75 (RetryLater) so that a rerun resumes at once.
Each data slot of the mesh (data x fsdp) works through its own streams, one at a time; a row never
spans two streams. Resume is the default: each stream restarts from its committed shards.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import socket
import time
from typing import Any, Iterator

import jax
import numpy as np

from harvest.clock import STOPPABLE
from harvest.config import ExtractConfig
from harvest.data import prompts, streams
from harvest.data.batching import Row, pack_stream, stream_pieces
from harvest.errors import RetryLater, UserError
from harvest.extract.pipeline import run_pipeline
from harvest.extract.report import Progress, summarize
from harvest.extract.runinfo import agreed, build_run_info, check_run
from harvest.extract.shards import ShardWriter, pin_sources
from harvest.extract.startup import Startup, since_start
from harvest.model import (
    Decoder,
    ModelConfig,
    compile_forward,
    default_compute_dtype,
    held_bytes,
    load_decoder,
    moments,
    parse_points,
)
from harvest.model.attention import resolve as resolve_attention
from harvest.model.weights import params_shape, resolve_checkpoint
from harvest.ranges import parse_ranges
from harvest.runtime import cache, cores, distributed
from harvest.runtime.mesh import data_slots, describe, make_mesh
from harvest.runtime.sigterm import Interrupted, SigtermFlag
from harvest.store import format as fmt, quant
from harvest.store.bounds import IDLE_SLOTS_ADVICE
from harvest.store.commit import ResumePoint, read_chain, sweep, wipe
from harvest.store.committer import Committer
from harvest.storage import Storage, StorageError
from harvest.store.lease import Leases
from harvest.store.records import RunInfo
from harvest.store.report import human_bytes

log = logging.getLogger("harvest")


def run_extract(cfg: ExtractConfig) -> dict[str, Any]:
    """Run (or resume) an extraction; returns the summary printed at the end.

    Everything that can refuse the command is checked before the first lease or byte is written (settings,
    mesh, points, streams, tokenizer and renderer, the run.json diff, storage reachable), so a refused
    command leaves the output as it was. The first write is a lease: where storage refuses it, nothing
    was written.
    """
    clock = Startup()
    clock.span("imports", 0.0)
    checkpoint = resolve_checkpoint(cfg.model)
    # The tokenizer loads beside the backend's start (transformers imports torch where it is installed: seconds).
    tokenizer_loading = _in_background(clock.timed, "tokenizer", prompts.load_tokenizer, checkpoint,
                                       encode_only=cfg.format != "chat")
    backend_start = since_start()
    # Without a --mesh, a one-process CPU run is one slot whose batches the host's cores split (runtime.cores).
    multi = distributed.resolve(cfg.coordinator, cfg.num_processes, cfg.process_id).multi
    cores_as_devices = cores.expose_cores(multi or cfg.mesh is not None)
    distributed.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, timeout_s=cfg.peer_timeout)
    cache.keep_compiled(not cfg.no_compile_cache)
    one_slot = cores_as_devices and jax.default_backend() == "cpu"
    model = ModelConfig.from_dir(checkpoint)
    plan = parse_points(cfg.points, model.num_layers)
    compute_dtype = cfg.compute_dtype or default_compute_dtype()
    if one_slot:
        devices = cores.core_devices(cores.tree_bytes(params_shape(model, dtype=compute_dtype,
                                                                   num_layers=plan.num_layers)))
        mesh = make_mesh(f"data={len(devices)}", devices)
    else:
        mesh = make_mesh(cfg.mesh or f"data={jax.device_count()}")
    clock.span("backend", backend_start)

    out = Storage(cfg.out, clock=STOPPABLE)
    data = streams.open_data(cfg.data)
    chosen = _chosen_streams(cfg, data.num_streams)
    # The attention kernel is resolved once, here: every process must compile the same program, so it goes into
    # run.json's config and the agreement. It is no output setting (another kernel rounds differently, no more),
    # so a resume may resolve another.
    if model.rope is None and cfg.max_seq_len > model.max_positions:
        raise UserError(f"--max-seq-len {cfg.max_seq_len}: {cfg.model} has learned positions for "
                        f"{model.max_positions} tokens; use --max-seq-len {model.max_positions} or less")
    cfg = dataclasses.replace(cfg, attention=resolve_attention(cfg.attention, model.sliding_windows, cfg.max_seq_len,
                                                               softcap=model.attn_softcap))
    run_info = build_run_info(cfg, model, plan, checkpoint, data, compute_dtype)
    distributed.agree({**agreed(run_info), "harvest_version": run_info.harvest_version, "streams": chosen,
                       "attention": cfg.attention,
                       "mesh": describe(mesh), "batch_size": cfg.batch_size}, "the run's settings")
    # The forward compiles from here on (it needs only shapes), beside the tokenizer's load, the checks below, the
    # weights' load and the resume reads. Compiling writes nothing to the run; a command refused below prints its
    # line at once and exits when the compile ends (it cannot be interrupted), leaving the program in the cache.
    # 8-bit codes are made on the device from float32 values, whose moments the sidecars' stats are.
    code = cfg.dtype if quant.is_quantized(cfg.dtype) else None
    decoding = dict(compute_dtype=compute_dtype, out_dtype=None if code else cfg.dtype, quantize=code,
                    moment_slots=moments.SLOTS, attention=cfg.attention)
    compile_start = since_start()
    compiled = compile_forward(checkpoint, cfg.points, mesh, (data_slots(mesh) * cfg.batch_size, cfg.max_seq_len),
                               **decoding)
    compiled.add_done_callback(lambda _: clock.span("compile", compile_start))
    tokenizer = tokenizer_loading.result()
    render = _renderer(cfg, tokenizer)
    fed, owned = _slot_plan(mesh, chosen, one_slot)
    mine = sorted(s for k in owned for s in fed[k])
    whole = len(chosen) == data.num_streams  # --overwrite of every stream replaces run.json too
    if not (cfg.overwrite and whole):
        # storage reachable; the first lease is the first write, and checks it. A --overwrite of some streams
        # keeps run.json, which must go on describing the streams it does not touch.
        check_run(out, run_info, partial_overwrite=cfg.overwrite)

    failure: list[BaseException] = []
    worker = cfg.worker_id or f"{socket.gethostname()}:{jax.process_index()}"
    leases = Leases(out, worker, ttl_s=cfg.lease_ttl, on_lost=failure.append, clock=STOPPABLE)
    # A full --overwrite with fewer streams drops the run's others (process 0 does, under their leases); a later
    # extract of the whole run finishes such a drop where it was interrupted.
    dropped = _streams_beyond(out, data.num_streams) if whole and jax.process_index() == 0 else []
    existed = out.exists()
    created_run = False
    # SIGTERM ends every wait from here on (a lease's wait-out, storage's back-offs: harvest.clock), and every exit
    # releases the leases this process took.
    with SigtermFlag() as sigterm, _stops_on_sigterm(), contextlib.ExitStack() as held:
        held.callback(leases.release_all)
        _take_leases(out, leases, mine + dropped)  # --overwrite included: never delete streams another worker holds
        try:
            if cfg.overwrite:
                distributed.barrier("harvest-leased")  # every process holds its streams before anything is deleted
                _wipe(out, mine, dropped, leases, run_json=whole and jax.process_index() == 0)
                distributed.barrier("harvest-overwrite")
            else:
                _wipe(out, [], dropped, leases, run_json=False)
            for stream in mine:  # ours now: clear what a killed predecessor's interrupted writes left
                for directory in {fmt.stream_dir(stream), fmt.shard_dir(stream, leases.generation(stream))}:
                    out.remove_stale_temps(directory)
            if jax.process_index() == 0:
                created_run = out.create_exclusive(fmt.RUN_JSON, run_info.to_bytes())
                if not created_run:
                    check_run(out, run_info)  # another worker created it meanwhile: it must be the same run
                out.remove_stale_temps(of=fmt.RUN_JSON)  # a create of it that a kill cut short
            # Loaded only now: a worker refused above (lease, run.json) spends nothing on the weights.
            decoder = clock.timed("weights", load_decoder, checkpoint, cfg.points, mesh, **decoding)
            slot_rows = cfg.batch_size * (data_slots(mesh) if one_slot else 1)
            return _extract(Extraction(cfg, decoder, compiled, tokenizer, render, data, fed, mine, out, leases,
                                       run_info, failure, sigterm, clock, slot_rows))
        except UserError as e:
            if e.exit_code != 2:  # lost a stream (3: nothing of it is ours to touch), or retry later (75)
                raise
            # Bad input met on the way (--strict) or a refusal: streams this worker never wrote go back as they were.
            left = _leave_untouched(out, leases, created_run, existed)
            if isinstance(e, StrictStop):
                left = left or ("the shards committed before the stop are kept and the leases released; the run is "
                                "incomplete (`harvest status` shows where each stream stopped): rerun without "
                                "--strict to resume, skipping and recording bad inputs, or fix the data and rerun "
                                "with --overwrite")
            if not left:
                raise
            raise UserError(f"{e}; {left}") from None


@contextlib.contextmanager
def _stops_on_sigterm() -> Iterator[None]:
    """A wait ended by SIGTERM (harvest.runtime.sigterm.Interrupted) stops the command retryably."""
    try:
        yield
    except Interrupted:
        raise RetryLater("stopped on SIGTERM while waiting (for a lease, or for storage); the leases it took were "
                         "released: rerun the same command to resume") from None


class StrictStop(UserError):
    """--strict met a bad input (harvest.data.batching names it): the run stops there, exit 2."""


def _strict_stops(events: Iterator) -> Iterator:
    """The stream's events, where --strict's stop at a bad input (a plain UserError from the pieces; storage's
    own errors are StorageErrors) becomes a StrictStop."""
    try:
        yield from events
    except UserError as e:
        if type(e) is not UserError:
            raise
        raise StrictStop(str(e)) from None


def _take_leases(out: Storage, leases: Leases, streams: list[int]) -> None:
    """Take the streams' leases: the command's first write. Where storage refuses it (a read-only or full disk,
    a file on the path, no permission, no bucket), nothing was written, and the one line says --out is the
    input at fault."""
    try:
        leases.acquire(streams)
    except StorageError as e:
        if e.exit_code != 2:
            raise
        raise UserError(f"cannot write --out {out.url}: {e.reason}; give a --out this process can write (nothing "
                        "was written)") from None


def _leave_untouched(out: Storage, leases: Leases, created_run: bool, existed: bool) -> str | None:
    """After a stop on bad input or a refusal once the leases were taken: the held streams that hold nothing but
    their lease are removed (Leases.drop_untouched), then run.json where this process created it and no stream
    is left (one process: another may still hold its streams), then --out itself where this command made it.
    Says so when nothing is left of the command; None when something is."""
    leases.drop_untouched()
    try:
        if created_run and jax.process_count() == 1 and not _streams_beyond(out, 0):
            out.delete(fmt.RUN_JSON)
            if not existed:
                out.remove_empty_dir()  # made by this command's first write
            return "nothing was written (--out is as it was)"
    except UserError as e:
        log.warning("could not remove run.json after the stop (%s)", e)
    return None


def _say_memory(compiled: concurrent.futures.Future) -> None:
    """One line: what the forward holds on each device, from its compiled program (before the first batch);
    a warning where that is more than the device has (an accelerator's limit; the CPU's is the host's memory)."""
    stats = None if compiled.exception() else compiled.result()
    if stats is None:
        return
    weights, captures = stats.argument_size_in_bytes, stats.output_size_in_bytes
    need = held_bytes(stats)
    line = (f"memory: the forward holds {human_bytes(need)} a device (weights and batch {human_bytes(weights)}, "
            f"captures {human_bytes(captures)}, working {human_bytes(stats.temp_size_in_bytes)})")
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    if limit and need > limit:
        log.warning("%s, more than the device's %s: lower --batch-size or --max-seq-len, or capture fewer points",
                    line, human_bytes(limit))
    else:
        log.info(line)


def _in_background(fn, *args, **kwargs) -> concurrent.futures.Future:
    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


def _renderer(cfg: ExtractConfig, tokenizer) -> prompts.Renderer:
    """The record -> prompts function; raises UserError for a bad template, field or tokenizer."""
    arc = {"encoder": cfg.arc_encoder, "augment": cfg.arc_augment, "include_answer": cfg.arc_include_answer}
    if cfg.arc_template is not None:
        arc["template"] = cfg.arc_template
    return prompts.make_renderer(cfg.format, tokenizer, text_field=cfg.text_field, seed=cfg.seed,
                                 arc=prompts.ArcOptions(**arc))


def _slot_plan(mesh, chosen: list[int], one_slot: bool = False) -> tuple[dict[int, list[int]], set[int]]:
    """Slot k (the k-th block of the batch, over data x fsdp) takes streams chosen[k::slots]. A process
    feeds every slot with a device on it (the model axis may span hosts: each feeds the same rows) and
    owns, i.e. writes, the slots whose first device is its own. `one_slot`: the whole batch is one slot
    (a one-process CPU run's cores)."""
    if one_slot:
        return {0: list(chosen)}, {0}
    grid = mesh.devices.reshape(-1, mesh.devices.shape[-1])
    me = jax.process_index()
    fed = {k: chosen[k :: len(grid)] for k, devices in enumerate(grid) if any(d.process_index == me for d in devices)}
    return fed, {k for k in fed if grid[k][0].process_index == me}


def idle_slots(todo: dict[int, list[int]]) -> int:
    """How many data slots this process feeds have no stream left to do while others have: each step computes
    their rows as padding. Says so in one line, with what to do."""
    idle = sum(not streams_of_slot for streams_of_slot in todo.values())
    left = sum(len(streams_of_slot) for streams_of_slot in todo.values())
    if idle and left:
        log.warning("%d of the %d data slots this process feeds have no stream to take (%d stream%s left for them): "
                    "each step computes their rows as padding; %s", idle, len(todo), left,
                    "" if left == 1 else "s", IDLE_SLOTS_ADVICE)
    return idle


def _chosen_streams(cfg: ExtractConfig, num_streams: int) -> list[int]:
    if cfg.streams is None:
        return list(range(num_streams))
    chosen = parse_ranges(cfg.streams, "--streams")
    if chosen[-1] >= num_streams:
        raise UserError(f"--streams {cfg.streams}: the data has streams 0-{num_streams - 1}")
    return chosen


def _streams_beyond(out: Storage, num_streams: int) -> list[int]:
    """The run's streams numbered `num_streams` and up (its directories)."""
    found = (fmt.dir_stream(name) for name in out.listdir())
    return sorted(n for n in found if n is not None and n >= num_streams)


def _wipe(out: Storage, streams_to_wipe: list[int], dropped: list[int], leases: Leases, run_json: bool) -> None:
    """--overwrite, under the leases of every stream named (harvest.store.commit.wipe: a new generation each);
    the `dropped` streams, beyond the run's, go whole."""
    for stream in streams_to_wipe:
        wipe(out, stream, leases)
    for stream in dropped:
        wipe(out, stream, leases, whole=True)
    if run_json:
        out.delete(fmt.RUN_JSON)


@dataclasses.dataclass(frozen=True)
class Extraction:
    """What the extraction proper works with, once everything that could refuse the command has passed."""

    cfg: ExtractConfig
    decoder: Decoder  # the weights, loaded over the mesh
    compiled: concurrent.futures.Future  # the forward, compiling since the settings were agreed
    tokenizer: Any
    render: prompts.Renderer
    data: streams.StreamSet | streams.SourceStreams
    slots: dict[int, list[int]]  # each data slot this process feeds -> its streams, in order
    mine: list[int]  # the streams this process writes
    out: Storage
    leases: Leases
    info: RunInfo  # run.json
    failure: list[BaseException]  # a lost lease's error, set by a heartbeat thread
    sigterm: SigtermFlag
    clock: Startup
    slot_rows: int  # rows a slot computes per batch


def _extract(job: Extraction) -> dict[str, Any]:
    cfg, decoder, data, slots, mine, out, leases, info = (job.cfg, job.decoder, job.data, job.slots, job.mine, job.out,
                                                         job.leases, job.info)
    # Ours now: what writers that lost the stream left behind, where it can never be committed, is swept. A stream
    # wiped by --overwrite starts afresh in a generation of its own: nothing a stalled writer lands is read there.
    chains = {s: [] if cfg.overwrite else sweep(out, s, leases.generation(s), leases.check) if s in mine
              else read_chain(out, s) for streams_of_slot in slots.values() for s in streams_of_slot}
    resume = {s: ResumePoint.after(chain) for s, chain in chains.items()}
    distributed.barrier("harvest-resume-read")  # every feeder of a stream starts from the same commit
    todo = {k: [s for s in streams_of_slot if not resume[s].done] for k, streams_of_slot in slots.items()}
    widths = info.tensors
    dtype = np.dtype(fmt.STORED_DTYPES[cfg.dtype])
    code = cfg.dtype if quant.is_quantized(cfg.dtype) else None
    writers = {s: ShardWriter(s, widths, dtype, cfg.shard_bytes, resume[s], code) for s in mine if not resume[s].done}
    pin_sources(data, chains, writers)  # a resume reads the input its committed shards were made from, or refuses
    totals = info.data["counts"]
    progress = Progress(out, {s: (totals[s] if totals else None) for s in mine}, resume, worker=leases.worker,
                        slots=(idle_slots(todo), len(todo)))
    committer = Committer(out, on_commit=progress.committed, attempt=leases.id[:16], guard=leases.check,
                          on_lost=leases.lose, generation=leases.generation)
    encode = prompts.encoder(job.tokenizer, cfg.format)

    def stream_rows(stream: int) -> Iterator[Row]:
        point = resume[stream]
        records = data.records(stream, start=point.row_start[0])
        if cfg.max_samples is not None:
            records = _limit(records, cfg.max_samples - point.row_start[0])
        events = stream_pieces(records, job.render, encode, first_index=point.row_start[0],
                               max_seq_len=cfg.max_seq_len, long=cfg.long, strict=cfg.strict,
                               sample_error=prompts.SampleError)
        if cfg.strict:
            events = _strict_stops(events)
        return pack_stream(events, cfg.max_seq_len, skip_before=point.row_start)

    start = time.monotonic()
    job.compiled.add_done_callback(_say_memory)  # past every refusal: a refused command says one line
    with progress.display(), distributed.peers_watched():
        stopped = run_pipeline(decoder, todo, stream_rows, cfg.batch_size, cfg.max_seq_len, writers, committer,
                               progress, job.failure, job.compiled, stop=lambda: job.sigterm.raised, startup=job.clock,
                               slot_rows=job.slot_rows)
    if stopped:
        raise RetryLater("stopped on SIGTERM: the shards closed by then are committed, the leases released; rerun "
                         "the same command to resume")
    for stream in writers:
        leases.release(stream)
    with distributed.peers_watched():
        distributed.barrier("harvest-extract-done")
    return {**summarize(out, mine, elapsed=time.monotonic() - start, progress=progress),
            "devices": describe(decoder.mesh), "startup": job.clock.line()}


def _limit(records, n: int):
    for k, record in enumerate(records):
        if k >= n:
            return
        yield record
