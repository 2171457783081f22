"""bench/host.py's host stage: synthetic captures as the device hands them through the job's own host stage.

The captures [layers, batch, seq, width] are what the jitted step hands the host (harvest.model.handed): bf16
values with each piece's moments, or 8-bit codes (int8, float8_e4m3fn) with float32 per-token scales and the
moments and first tokens of the float values, made before the clock starts (one device array of captures,
reused by every batch; each batch its own moments). They go through extract.pipeline.to_shards (device->host
arrays, rows cut into shards by ShardWriter) and the Committer (stats merged from the moments, safetensors
encoding, checksums of each tensor and each 1 MiB chunk, writes with fsync, sidecars). Then each step alone
on the same shards, one thread, to say which one bounds the stage.
"""

from __future__ import annotations

import dataclasses
import functools
import queue
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from harvest.config import parse_size
from harvest.data.batching import SampleTokens, StreamEnd, pack_stream
from harvest.extract import pipeline
from harvest.extract.report import Progress
from harvest.extract.shards import ShardWriter
from harvest.model import handed, parse_points
from harvest.store import encoding, format as fmt, quant
from harvest.store.commit import ResumePoint
from harvest.store.committer import Committer
from harvest.store.records import Sidecar
from harvest.store.stats import RunningStats
from harvest.storage import Storage

DTYPES = ("bfloat16", "int8", "float8_e4m3fn")  # what a run may store: bf16 values, or 8-bit codes with scales


class FakeDecoder:
    """What to_shards needs of a Decoder: the capture plan."""

    def __init__(self, plan):
        self.plan = plan


class Collect:
    """What to_shards needs of a Committer, keeping the closed shards (to time each step alone)."""

    def __init__(self):
        self.shards = []

    def submit(self, shard) -> None:
        self.shards.append(shard)


@dataclasses.dataclass
class Workload:
    """One storage dtype's batches as the device hands them, and what they hold."""

    dtype: str
    batches: list  # (pipeline.Batch, captures, moments)
    widths: dict[str, int]
    tokens: int  # real tokens
    nbytes: int  # their capture bytes as stored (codes and scales where quantized)

    @property
    def code(self) -> str | None:
        return self.dtype if quant.is_quantized(self.dtype) else None

    def writers(self, args) -> dict[int, ShardWriter]:
        stored = np.dtype(fmt.STORED_DTYPES[self.dtype])
        return {0: ShardWriter(0, self.widths, stored, parse_size(args.shard_size, "--shard-size"), ResumePoint(),
                               quantize=self.code)}


def synthetic_rows(args, batches: int) -> list:
    """One whole stream of lognormal-length pieces (median 300 tokens) packed as the job packs them, about
    `batches` x --batch-size rows, ending with its StreamEnd (so its shards form a complete commit chain)."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(300), 1.0, 4 * batches * args.batch_size * args.seq // 300),
                      50, args.seq).astype(int)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), 0.97 * batches * args.batch_size * args.seq)]
    events = [SampleTokens((i, 0), i, np.full(n, i % 1000, np.int32)) for i, n in enumerate(lengths)]
    return list(pack_stream([*events, StreamEnd(len(events))], args.seq))


def per_token(args, dtype: str) -> int:
    """Capture bytes a token stores: its codes and scales where quantized."""
    code = quant.is_quantized(dtype)
    return args.layers * (args.width * np.dtype(fmt.STORED_DTYPES[dtype]).itemsize + (4 if code else 0))


def workloads(args, dtypes) -> dict[str, Workload]:
    """Each dtype's batches of the same values, about --batches of bf16's bytes (an 8-bit one ~2x the rows, so
    that each writes as many shards: the last shard's write, on one thread, weighs the same): the stream's rows
    as the job's batches (the last padded with empty rows), each with its own moments (the device's share of
    the stats, done here)."""
    values = jnp.asarray(np.random.default_rng(1).normal(
        size=(args.layers, args.batch_size, args.seq, args.width)).astype(np.float32))
    widths = {fmt.tensor_name("resid_post", layer): args.width for layer in range(args.layers)}
    out = {}
    for dtype in dtypes:
        rows = synthetic_rows(args, round(args.batches * per_token(args, "bfloat16") / per_token(args, dtype)))
        tokens = sum(r.used for r in rows)
        code = dtype if quant.is_quantized(dtype) else None
        step = jax.jit(functools.partial(handed, moment_slots=args.slots, quantize=code))
        source = {"resid_post": values if code else values.astype(fmt.DTYPES[dtype])}
        batches, captures = [], None
        for at in range(0, len(rows), args.batch_size):
            chunk = rows[at : at + args.batch_size]
            ids = np.zeros((args.batch_size, args.seq), np.int32)
            segments = np.zeros_like(ids)
            ids[: len(chunk)] = [r.tokens for r in chunk]
            segments[: len(chunk)] = [r.segments for r in chunk]
            batch = pipeline.Batch(ids, segments, [(0, r) for r in chunk] + [None] * (args.batch_size - len(chunk)))
            made, moments = jax.block_until_ready(step(source, segments))
            captures = captures or made  # one device array of captures, as before: their values do not matter
            batches.append((batch, captures, moments))
        out[dtype] = Workload(dtype, batches, widths, tokens, tokens * per_token(args, dtype))
    return out


def plan(args):
    return parse_points(f"resid_post:0-{args.layers - 1}", args.layers)


def cut(args, work: Workload, committer) -> None:
    """The job's to_shards over every batch (on this thread), closed shards to `committer`."""
    captured: queue.Queue = queue.Queue()
    for item in [*work.batches, None]:
        captured.put(item)
    pipeline.to_shards(captured, FakeDecoder(plan(args)), work.writers(args), committer,
                       Progress(None, {0: None}, {0: ResumePoint()}, worker="bench"))


def committer_for(args, directory: Path, progress: Progress | None = None, checksum: str | None = None) -> Committer:
    out = Storage(str(directory))

    def committed(manifest):
        if progress is not None:
            progress.committed(manifest)
        if not args.keep:  # as the page cache reuses its pages once a long run's old shards are on disk
            out.delete(f"{fmt.stream_dir(manifest.stream)}/{manifest.file}")

    return Committer(out, on_commit=committed, attempt="0123456789abcdef", checksum=checksum)


def whole_stage(args, work: Workload, directory: Path, checksum: str | None = None) -> float:
    """Seconds of the job's host stage: to_shards on its own thread feeding the Committer, until all is committed."""
    progress = Progress(Storage(str(directory)), {0: None}, {0: ResumePoint()}, worker="bench")
    committer = committer_for(args, directory, progress, checksum)
    failure: list[BaseException] = []
    captured: queue.Queue = queue.Queue(maxsize=pipeline.QUEUE_DEPTH)
    writers = work.writers(args)
    t = time.perf_counter()
    host = pipeline.Stage(lambda: pipeline.to_shards(captured, FakeDecoder(plan(args)), writers, committer, progress),
                          failure)
    for item in [*work.batches, None]:
        pipeline.put(captured, item, failure)
    host.join(failure)
    committer.close()
    return time.perf_counter() - t


def shard_parts(shard) -> list:
    return encoding.shard_parts(shard.tensors, shard.tokens, shard.lengths, shard.sample_ids, shard.variants,
                                {"stream": str(shard.stream), "shard": str(shard.shard)})


def steps_alone(args, shards: list, directory: Path) -> list[tuple[str, str | None, float]]:
    """(step, the checksum it is of or None, seconds) of each step of the Committer alone, one thread, over
    every shard, as the Committer does it."""
    out = []

    def timed(name, fn, items, checksum=None):
        t = time.perf_counter()
        results = [fn(item) for item in items]
        out.append((name, checksum, time.perf_counter() - t))
        return results

    stats = timed("stats: pieces' device moments merged (fp64)", lambda s: {
        n: RunningStats.of_pieces(b, *s.moments[n]) for n, b in s.tensors.items() if n in s.moments}, shards)
    parts = timed("encoding: safetensors header + parts", shard_parts, shards)
    sums = {}
    for checksum in encoding.CHECKSUMS:
        sums[checksum] = timed(f"checksums: {checksum} of each 1 MiB chunk, each tensor's derived (one hash a byte)",
                               lambda p: encoding.shard_checksums(p, checksum, encoding.CHUNK_BYTES), parts, checksum)
    default = encoding.default_checksum()

    def sidecar(k):
        shard, (digest, tensors, chunks) = shards[k], sums[default][k]
        return Sidecar.of_shard(
            parts[k], checksum=default, digests=(digest, tensors), chunk_bytes=encoding.CHUNK_BYTES,
            chunk_digests=chunks, stream=shard.stream, shard=shard.shard, attempt="0123456789abcdef",
            start=shard.start, next=shard.next, row_start=shard.row_start, samples=len(shard.lengths),
            tokens=int(shard.lengths.sum()), stats=stats[k], skipped=shard.skipped, long=shard.long,
            final=shard.final, records=shard.records, quantization=shard.quantization,
            first_stats={n: s.to_json() for n, s in shard.first_stats.items()}).to_bytes()

    timed("sidecars: Sidecar of stats and digests, as JSON bytes", sidecar, range(len(shards)))
    storage = Storage(str(directory))

    def write(p):
        rel = f"alone/shard_{id(p)}.safetensors"
        storage.write_bytes(rel, p)
        if not args.keep:
            storage.delete(rel)

    timed("writing: atomic (temp file, fsync, rename)", write, parts)
    return out
