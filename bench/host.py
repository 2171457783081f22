"""Host-side benchmark: how fast the host absorbs captures, and how fast the feeder makes rows. No model.

1. Host stage. Synthetic bf16 captures [layers, batch, seq, width] (one device array, reused by every batch)
   and each batch's piece moments (the device's share of the stats, harvest.model.moments, made before the
   clock starts) go through the job's own host stage: extract.pipeline.to_shards (device->host arrays, rows
   cut into shards by ShardWriter) and the Committer (stats merged from the moments, safetensors encoding,
   checksums, writes with fsync to local disk, sidecars), once with each checksum a sidecar may name
   (xxh3_128, the default, and sha256). Then each part alone on the same shards, one thread: cutting, stats,
   encoding, the checksums, writing; and the Committer alone (its own threads).
2. The floor: the work no host stage can skip, one checksum pass and one write (+ fsync) of every byte,
   measured here in the same run on the same shards (a thread per core hashing, one per core writing). The
   host stage's ratio to the floor of its own checksum is the figure of merit (the issue's target: >= 60% on
   1 core and on 2).
3. Feeder: jsonl text -> render -> tokenize -> pack (the job's data.batching), with a byte-level BPE of
   ~150k tokens like Qwen2.5's, trained here on generated text: tokens/s, and per core.

`--cores N` pins the whole process (its threads, numpy's, the tokenizer's) to N cores.

Run:  .venv/bin/python bench/host.py --cores 1      (~1-2 minutes on 2 CPU cores)
      .venv/bin/python bench/host.py --help         (widths, layers, batches, vocabulary, where to write)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import queue
import sys
import tempfile
import threading
import time
import zlib
from pathlib import Path
from typing import Callable


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cores", type=int, default=None,
                   help="pin the process to this many cores (os.sched_setaffinity; default: all it may use)")
    p.add_argument("--width", type=int, default=896, help="capture width (default 896, Qwen2.5-0.5B)")
    p.add_argument("--layers", type=int, default=8, help="captured layers (default 8)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per batch (default 8)")
    p.add_argument("--seq", type=int, default=2048, help="row length (default 2048)")
    p.add_argument("--batches", type=int, default=12, help="batches fed to the host stage (default 12)")
    p.add_argument("--shard-size", default="256MB", help="shard size (default 256MB)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds, each timing the host stage (per checksum), the Committer and each floor in turn, the "
                        "best of each kept (default 3): a machine shared with other work slows some runs, never "
                        "speeds one up")
    p.add_argument("--keep", action="store_true",
                   help="keep every shard written (default: delete each once committed, so that the page cache "
                        "recycles its pages as on a long run whose shards went to disk long ago)")
    p.add_argument("--vocab", type=int, default=150_000, help="BPE vocabulary to train (default 150000)")
    p.add_argument("--feeder-mb", type=float, default=20, help="MB of text through the feeder (default 20)")
    p.add_argument("--out", default=None,
                   help="directory the shards go to (default: a temp dir on the local disk, $TMPDIR or /tmp)")
    return p.parse_args()


ARGS = parse_args()
if ARGS.cores:  # before jax, numpy or the tokenizer start their threads: they all inherit it
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: ARGS.cores])

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/table.py
from table import show  # noqa: E402

from harvest.config import parse_size  # noqa: E402
from harvest.data import prompts, streams  # noqa: E402
from harvest.data.batching import Piece, StreamEnd, pack_stream, stream_pieces  # noqa: E402
from harvest.extract import pipeline  # noqa: E402
from harvest.extract.report import Progress  # noqa: E402
from harvest.extract.shards import ShardWriter  # noqa: E402
from harvest.model import moments, parse_points  # noqa: E402
from harvest.model.moments import piece_moments  # noqa: E402
from harvest.store import encoding, format as fmt  # noqa: E402
from harvest.store.commit import Committer, ResumePoint  # noqa: E402
from harvest.store.stats import RunningStats  # noqa: E402
from harvest.storage import Storage  # noqa: E402

SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou", "ee")]


# --- 1. host stage -------------------------------------------------------------------------------------------

class FakeDecoder:
    """What to_shards needs of a Decoder: the capture plan."""

    def __init__(self, plan):
        self.plan = plan


class Collect:
    """What to_shards needs of a Committer, keeping the closed shards (to time cutting alone)."""

    def __init__(self):
        self.shards = []

    def submit(self, shard) -> None:
        self.shards.append(shard)


def synthetic_rows(args) -> list:
    """One whole stream of lognormal-length pieces (median 300 tokens) packed as the job packs them, about
    --batches x --batch-size rows, ending with its StreamEnd (so its shards form a complete commit chain)."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(300), 1.0, 4 * args.batches * args.batch_size * args.seq // 300),
                      50, args.seq).astype(int)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), 0.97 * args.batches * args.batch_size * args.seq)]
    events = [Piece((i, 0), i, np.full(n, i % 1000, np.int32)) for i, n in enumerate(lengths)]
    return list(pack_stream([*events, StreamEnd(len(events))], args.seq))


def make_batches(args) -> tuple[list, dict, int]:
    """The stream's rows as the job's batches (the last padded with empty rows), each with the same captures
    and its own piece moments; the tensor widths; the real tokens' capture bytes."""
    rows = synthetic_rows(args)
    captures = {"resid_post": jnp.asarray(np.random.default_rng(1).normal(
        size=(args.layers, args.batch_size, args.seq, args.width)).astype(np.float32)).astype(jnp.bfloat16)}
    batches = []
    for at in range(0, len(rows), args.batch_size):  # the device's share (each batch's piece moments), done here
        chunk = rows[at : at + args.batch_size]
        tokens = np.zeros((args.batch_size, args.seq), np.int32)
        segments = np.zeros((args.batch_size, args.seq), np.int32)
        tokens[: len(chunk)] = [r.tokens for r in chunk]
        segments[: len(chunk)] = [r.segments for r in chunk]
        batch = pipeline.Batch(tokens, segments, [(0, r) for r in chunk] + [None] * (args.batch_size - len(chunk)))
        own = {"resid_post": jax.block_until_ready(piece_moments(captures["resid_post"], segments, args.slots))}
        batches.append((batch, captures, own))
    widths = {fmt.tensor_name("resid_post", layer): args.width for layer in range(args.layers)}
    return batches, widths, sum(r.used for r in rows) * args.layers * args.width * 2


def cut(args, batches, widths, committer) -> None:
    """The job's to_shards over every batch (on this thread), closed shards to `committer`."""
    plan = parse_points(f"resid_post:0-{args.layers - 1}", args.layers)
    writers = {0: ShardWriter(0, widths, np.dtype(fmt.DTYPES["bfloat16"]), parse_size(args.shard_size, "--shard-size"),
                              ResumePoint())}
    captured: queue.Queue = queue.Queue()
    for item in [*batches, None]:
        captured.put(item)
    pipeline.to_shards(captured, FakeDecoder(plan), writers, committer, Progress(None, {0: None}, {0: ResumePoint()},
                                                                                 worker="bench"))


def committer_for(args, directory: Path, progress: Progress | None = None, checksum: str | None = None) -> Committer:
    out = Storage(str(directory))

    def committed(manifest):
        if progress is not None:
            progress.committed(manifest)
        if not args.keep:  # as the page cache reuses its pages once a long run's old shards are on disk
            out.delete(f"{fmt.stream_dir(manifest.stream)}/{manifest.file}")

    return Committer(out, on_commit=committed, attempt="0123456789abcdef", checksum=checksum)


def whole_stage(args, batches, widths, directory: Path, checksum: str | None = None) -> float:
    """Seconds of the job's host stage: to_shards on its own thread feeding the Committer, until all is committed."""
    progress = Progress(Storage(str(directory)), {0: None}, {0: ResumePoint()}, worker="bench")
    committer = committer_for(args, directory, progress, checksum)
    failure: list[BaseException] = []
    captured: queue.Queue = queue.Queue(maxsize=pipeline.QUEUE_DEPTH)
    plan = parse_points(f"resid_post:0-{args.layers - 1}", args.layers)
    writers = {0: ShardWriter(0, widths, np.dtype(fmt.DTYPES["bfloat16"]), parse_size(args.shard_size, "--shard-size"),
                              ResumePoint())}
    t = time.perf_counter()
    host = pipeline.Stage(lambda: pipeline.to_shards(captured, FakeDecoder(plan), writers, committer, progress),
                          failure)
    for item in [*batches, None]:
        pipeline.put(captured, item, failure)
    host.join(failure)
    committer.close()
    return time.perf_counter() - t


def write_file(path: Path, parts: list) -> None:
    """One write of every byte and an fsync (what the floor counts; the job's local backend does the same)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def floor(shards_parts: list, directory: Path, hasher, threads: int) -> float:
    """Seconds to checksum (one pass) and write (+ fsync) every shard's bytes as a plain program would: `threads`
    threads hashing shards and `threads` writing the hashed ones, so that hashing goes on while a write waits on
    the disk (as the Committer's threads do)."""
    todo: queue.Queue = queue.Queue()
    hashed: queue.Queue = queue.Queue()
    for k, parts in enumerate(shards_parts):
        todo.put((k, parts))

    def hash_all():
        while True:
            try:
                k, parts = todo.get_nowait()
            except queue.Empty:
                return
            digest = hasher()
            for part in parts:
                digest.update(part)
            hashed.put((k, parts))

    def write_all():
        while (item := hashed.get()) is not None:
            path = directory / f"floor_{item[0]}.bin"
            write_file(path, item[1])
            if not ARGS.keep:
                path.unlink()

    t = time.perf_counter()
    hashers = [threading.Thread(target=hash_all) for _ in range(threads)]
    writers = [threading.Thread(target=write_all) for _ in range(threads)]
    for w in hashers + writers:
        w.start()
    for w in hashers:
        w.join()
    for _ in writers:
        hashed.put(None)
    for w in writers:
        w.join()
    return time.perf_counter() - t


def checksums() -> dict:
    """The checksums a sidecar may name (encoding.CHECKSUMS), and zlib's crc32 for comparison."""
    out = {"sha256": hashlib.sha256, "xxh3_128": lambda: encoding.hasher("xxh3_128")}

    class Crc32:  # zlib's crc32 (a different polynomial from crc32c, about as fast in software)
        def __init__(self):
            self.value = 0

        def update(self, data):
            self.value = zlib.crc32(data, self.value)

    out["crc32 (zlib)"] = Crc32
    try:
        import blake3
        out["blake3"] = blake3.blake3
    except ImportError:
        pass
    return out


def stages(args, shards, directory: Path, nbytes: int) -> list[tuple[str, float]]:
    """GB/s of each part of the host stage alone, one thread, over every shard."""
    rates = []

    def timed(name, fn, items):
        t = time.perf_counter()
        out = [fn(item) for item in items]
        rates.append((name, nbytes / (time.perf_counter() - t) / 1e9))
        return out

    timed("stats: pieces' device moments merged (fp64)",
          lambda s: [RunningStats.of_pieces(b, *s.moments[n]) for n, b in s.tensors.items()], shards)
    parts = timed("encoding: safetensors header + parts", lambda s: encoding.shard_parts(
        s.tensors, s.tokens, s.lengths, s.sample_ids, s.variants, {"stream": "0", "shard": str(s.shard)}), shards)
    for checksum in encoding.CHECKSUMS:
        timed(f"checksums: {checksum} of each tensor, the file's derived (one pass)",
              lambda p: encoding.shard_digests(p, checksum), parts)
    storage = Storage(str(directory))

    def write(p):
        rel = f"alone/shard_{id(p)}.safetensors"
        storage.write_bytes(rel, p)
        if not args.keep:
            storage.delete(rel)

    timed("writing: atomic (temp file, fsync, rename)", write, parts)
    return rates


def host(args, directory: Path) -> tuple[list, str, int]:
    batches, widths, nbytes = make_batches(args)
    cores = len(os.sched_getaffinity(0))
    whole_stage(args, batches[:2], widths, directory / "warm")  # first touches, imports, thread pools
    collect = Collect()
    t = time.perf_counter()
    cut(args, batches, widths, collect)
    cut_rate = nbytes / (time.perf_counter() - t) / 1e9
    shards = list(collect.shards)
    parts = [encoding.shard_parts(s.tensors, s.tokens, s.lengths, s.sample_ids, s.variants, {"stream": "0"})
             for s in shards]

    def committer_alone(r: int) -> float:
        committer = committer_for(args, directory / f"committer{r}")
        t = time.perf_counter()
        for shard in shards:
            committer.submit(shard)
        committer.close()
        return time.perf_counter() - t

    # Each round times everything once, one after another: load from other work on a shared machine slows
    # rounds, never speeds one up, and the best of rounds taken side by side compares like with like.
    runs: dict[str, Callable[[int], float]] = {
        **{f"stage {c}": functools.partial(lambda c, r: whole_stage(args, batches, widths, directory / f"whole-{c}{r}",
                                                                     c), c) for c in encoding.CHECKSUMS},
        "committer": committer_alone,
        **{f"floor {name}": functools.partial(lambda hasher, r: floor(parts, directory, hasher, cores), hasher)
           for name, hasher in {**checksums(), "write only": _NoHash}.items()}}
    best = {name: float("inf") for name in runs}
    for r in range(args.repeats):
        for name, run in runs.items():
            best[name] = min(best[name], run(r))
        print(f"  round {r + 1}: {', '.join(f'{n} {t:.1f} s' for n, t in best.items())}", flush=True)
    seconds = {c: best[f"stage {c}"] for c in encoding.CHECKSUMS}
    committer_rate = nbytes / best["committer"] / 1e9
    alone = stages(args, list(shards), directory, nbytes)
    floors = {name: nbytes / best[f"floor {name}"] / 1e9 for name in checksums()}
    write_only = nbytes / best["floor write only"] / 1e9
    gb = f"{nbytes / 1e9:.2f} GB"
    rows = []
    for checksum, t in seconds.items():
        stage = nbytes / t / 1e9
        rows.append([f"host stage, {checksum}{' (default)' if checksum == encoding.default_checksum() else ''} "
                     f"(to_shards + Committer, {len(shards)} shards)", gb, f"{t:.2f}", f"{stage:.2f}",
                     f"{stage / cores:.2f}", f"{stage / floors[checksum]:.0%} of {checksum}'s"])
    rows.append(["  alone: cutting shards (to_shards, ShardWriter)", "", "", f"{cut_rate:.2f}", "", ""])
    rows += [[f"  alone: {name}", "", "", f"{rate:.2f}", "", ""] for name, rate in alone]
    default = encoding.default_checksum()
    rows.append([f"  alone: the Committer ({default}; stats, encoding, checksums, writes; its threads)", "", "",
                 f"{committer_rate:.2f}", f"{committer_rate / cores:.2f}", f"{committer_rate / floors[default]:.0%}"])
    rows += [[f"floor: one {name} pass + one write (+fsync) of every byte", "", "", f"{rate:.2f}",
              f"{rate / cores:.2f}", "100%" if name in encoding.CHECKSUMS else ""] for name, rate in floors.items()]
    rows.append(["floor: write (+fsync) only, no checksum", "", "", f"{write_only:.2f}", f"{write_only / cores:.2f}",
                 ""])
    return rows, f"{len(shards)} shards", nbytes


class _NoHash:
    def update(self, data) -> None:
        pass


# --- 2. feeder -----------------------------------------------------------------------------------------------

def corpus(megabytes: float) -> list[str]:
    """Zipf-distributed pseudo-words over many syllables: enough distinct words to train a ~150k vocabulary."""
    rng = np.random.default_rng(3)
    vocabulary = ["".join(rng.choice(SYLLABLES, size=int(k))) for k in rng.integers(1, 5, 400_000)]
    ranks = np.minimum(rng.zipf(1.1, int(megabytes * 1e6 / 6)), len(vocabulary)) - 1
    words = np.asarray(vocabulary)[ranks]
    texts, at = [], 0
    for n in np.clip(rng.lognormal(np.log(300), 1.0, len(words)), 10, 4000).astype(int):
        if at >= len(words):
            break
        texts.append(" ".join(words[at : at + n]))
        at += n
    return texts


def train_tokenizer(texts: list[str], vocab: int, directory: Path) -> tuple[Path, int, float]:
    """A byte-level BPE (as GPT-2/Qwen2.5), saved as a transformers checkpoint's tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    t = time.perf_counter()
    tokenizer.train_from_iterator(texts, trainer)
    seconds = time.perf_counter() - t
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}))
    return directory, tokenizer.get_vocab_size(), seconds


def feeder(texts: list[str], checkpoint: Path, root: Path, seq: int) -> tuple[float, int]:
    data = root / "feeder.jsonl"
    with data.open("w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    tokenizer = prompts.load_tokenizer(checkpoint)
    t = time.perf_counter()
    events = stream_pieces(streams.open_data(str(data)).records(0), prompts.make_renderer("text", tokenizer),
                           prompts.encoder(tokenizer, "text"), first_index=0, max_seq_len=seq, long="chunk",
                           strict=False, sample_error=prompts.SampleError)
    tokens = sum(row.used for row in pack_stream(events, seq))
    return time.perf_counter() - t, tokens


def main() -> None:
    args = ARGS
    args.slots = moments.SLOTS
    load = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="harvest-host-", dir=args.out) as tmp:
        root = Path(tmp)
        print(f"host stage on {cores} core(s), writing to {root} ...", flush=True)
        rows, shards, nbytes = host(args, root)
        print("training the BPE ...", flush=True)
        texts = corpus(args.feeder_mb)
        checkpoint, vocab, train_s = train_tokenizer(texts, args.vocab, root / "tokenizer")
        print("feeder ...", flush=True)
        feed_s, feed_tokens = feeder(texts, checkpoint, root, args.seq)
    rows.append([f"feeder: read, render, tokenize (BPE {vocab:,}), pack (tokens/s)", f"{feed_tokens:,} tokens",
                 f"{feed_s:.1f}", f"{feed_tokens / feed_s:,.0f}", f"{feed_tokens / feed_s / cores:,.0f}", ""])
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    footer = (f"GB/s of the real tokens' capture bytes (bf16, {args.layers} layers x width {args.width}, "
              f"{args.batch_size} rows x {args.seq} a batch, {args.batches} batches of "
              f"lognormal pieces packed as the job packs them; shard size {args.shard_size}, {shards}), written to "
              f"{Path(tmp).parent}{' and kept' if args.keep else ', each file deleted once written'}. 'vs floor': "
              f"the rate over the floor of the same checksum measured in this run. Best of {args.repeats} rounds (each "
              f"times the host stage per checksum, the Committer and the floors in turn); parts alone: one run, one "
              f"thread. Feeder: "
              f"{len(texts):,} generated jsonl texts; the BPE trained in {train_s:.0f} s. {cores} core(s) "
              f"({model}); load average {load:.1f} before, {os.getloadavg()[0]:.1f} after (other work on the "
              f"machine lowers every rate).")
    if not sys.stdout.isatty():
        os.environ.setdefault("COLUMNS", "150")
    show("harvest host side (no model)", ["what", "amount", "seconds", "GB/s", "per core", "vs floor"], rows, footer)


if __name__ == "__main__":
    main()
