"""Host-side benchmark: how fast the host absorbs captures, and how fast the feeder makes rows. No model.

1. Host pipeline. Synthetic bf16 captures [layers, batch, seq, width] (made once on the CPU device, reused)
   and each batch's piece moments (the device's share of the stats, harvest.model.moments, computed before
   the clock starts) go through the job's own host stage as fast as it takes them: extract.pipeline.to_shards
   (captures to numpy, rows cut into shards by ShardWriter) and the Committer's threads (stats merged from
   the moments, safetensors encoding, sha256, writes to a local temp dir). Prints GB/s of captures absorbed,
   and per core. Then each stage alone, single-threaded, on the same data: GB/s each; the slowest one is what
   limits the pipeline per core.
2. Feeder. jsonl text -> render -> tokenize -> pack (the job's data.batching), with a byte-level BPE of
   ~150k tokens like Qwen2.5's, trained here on generated text: tokens/s.

Run:  .venv/bin/python bench/host.py           (~2-3 minutes on 2 CPU cores)
      .venv/bin/python bench/host.py --help    (widths, layers, batches, vocabulary)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import queue
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/table.py
import jax.numpy as jnp
from table import show

from harvest.config import parse_size
from harvest.data import prompts, streams
from harvest.data.batching import Piece, StreamEnd, pack_stream, stream_pieces
from harvest.extract import pipeline
from harvest.extract.report import Progress
from harvest.extract.shards import ShardWriter
from harvest.model import moments, parse_points
from harvest.model.moments import piece_moments
from harvest.store import format as fmt
from harvest.store.commit import Committer, ResumePoint
from harvest.storage import Storage

SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou", "ee")]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=896, help="capture width (default 896, Qwen2.5-0.5B)")
    p.add_argument("--layers", type=int, default=8, help="captured layers (default 8)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per batch (default 8)")
    p.add_argument("--seq", type=int, default=2048, help="row length (default 2048)")
    p.add_argument("--batches", type=int, default=12, help="batches fed to the host pipeline (default 12)")
    p.add_argument("--shard-size", default="256MB", help="shard size (default 256MB)")
    p.add_argument("--slots", type=int, default=moments.SLOTS,
                   help=f"pieces per row with device moments, as the job (default {moments.SLOTS})")
    p.add_argument("--keep", action="store_true",
                   help="keep every shard where it was written (default: delete each once committed, so that RAM "
                        "used as the storage recycles its pages as a page cache does; kept, a VM's first touch of "
                        "fresh memory is timed too)")
    p.add_argument("--vocab", type=int, default=150_000, help="BPE vocabulary to train (default 150000)")
    p.add_argument("--feeder-mb", type=float, default=20, help="MB of text through the feeder (default 20)")
    p.add_argument("--out", default=None,
                   help="directory the shards go to (default: a temp dir in /dev/shm, RAM, so the table measures "
                        "the host's own work; the local disk's raw write rate is printed beside it)")
    return p.parse_args()


# --- 1. host pipeline ----------------------------------------------------------------------------------------

class FakeDecoder:
    """What to_shards needs of a Decoder: the capture plan."""

    def __init__(self, plan):
        self.plan = plan


def synthetic_rows(args, count: int) -> list:
    """Packed rows of lognormal-length pieces (median 300 tokens), as the packer makes them."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(300), 1.0, count * args.seq // 250), 50, args.seq).astype(int)
    events = [Piece((i, 0), i, np.full(n, i % 1000, np.int32)) for i, n in enumerate(lengths)]
    return list(pack_stream([*events, StreamEnd(len(events))], args.seq))[:count]


def host_pipeline(args, root: Path) -> tuple[float, int]:
    """Seconds and capture bytes of --batches batches through to_shards + Committer."""
    plan = parse_points(f"resid_post:0-{args.layers - 1}", args.layers)
    widths = {fmt.tensor_name(p, layer): args.width for p, layer in plan.keys()}
    rows = synthetic_rows(args, args.batches * args.batch_size)
    rows[-1].end = rows[-1].end or StreamEnd(rows[-1].block[-1].pos[0] + 1 if rows[-1].block else 0)
    captures = {"resid_post": jnp.asarray(np.random.default_rng(1).normal(
        size=(args.layers, args.batch_size, args.seq, args.width)).astype(np.float32)).astype(jnp.bfloat16)}
    batches = []
    for at in range(0, len(rows), args.batch_size):  # the device's share (each batch's piece moments), done here
        chunk = rows[at : at + args.batch_size]
        batch = pipeline.Batch(np.stack([r.tokens for r in chunk]), np.stack([r.segments for r in chunk]),
                               [(0, r) for r in chunk])
        moments = {"resid_post": jax.block_until_ready(piece_moments(captures["resid_post"], batch.segments,
                                                                     args.slots))}
        batches.append((batch, captures, moments))
    out = Storage(str(root / "host"))
    dtype = np.dtype(fmt.DTYPES["bfloat16"])
    writers = {0: ShardWriter(0, widths, dtype, parse_size(args.shard_size, "--shard-size"), ResumePoint())}
    progress = Progress(out, {0: None}, {0: ResumePoint()}, worker="bench")

    def committed(manifest):
        progress.committed(manifest)
        if not args.keep:  # as a page cache reuses its pages once they are on disk
            out.delete(f"{fmt.stream_dir(manifest.stream)}/{manifest.file}")

    committer = Committer(out, on_commit=committed, attempt="0123456789abcdef")
    captured: queue.Queue = queue.Queue(maxsize=pipeline.QUEUE_DEPTH)
    failure: list[BaseException] = []
    t0 = time.perf_counter()
    host = pipeline.Stage(lambda: pipeline.to_shards(captured, FakeDecoder(plan), writers, committer, progress), failure)
    for item in batches:
        pipeline.put(captured, item, failure)
    pipeline.put(captured, None, failure)
    host.join(failure)
    committer.close()
    seconds = time.perf_counter() - t0
    return seconds, sum(r.used for r in rows) * args.layers * args.width * 2


ASIDE = "not the job's: "  # a stage timed for comparison only, left out of what limits the pipeline


def stage_rates(args, root: Path) -> dict[str, float]:
    """GB/s of each host stage alone, single-threaded, on one shard's worth of captures (pieces of 256 tokens)."""
    rng = np.random.default_rng(2)
    tokens = 64 * 1024
    names = [f"resid_post.{layer}" for layer in range(args.layers)]
    block = rng.normal(size=(args.layers, tokens, args.width)).astype(np.float32)
    block_bf16 = block.astype(fmt.DTYPES["bfloat16"])
    nbytes = block_bf16.nbytes
    lengths = np.full(tokens // 256, 256, np.int64)
    rates: dict[str, float] = {}

    def timed(name, fn):
        fn()  # warm
        t = time.perf_counter()
        result = fn()
        rates[name] = nbytes / (time.perf_counter() - t) / 1e9
        return result

    timed(ASIDE + "cast fp32 -> bf16 on the host (the job casts on device)", lambda: block.astype(fmt.DTYPES["bfloat16"]))
    tensors = {n: [block_bf16[j, a : a + 256] for a in range(0, tokens, 256)] for j, n in enumerate(names)}  # pieces
    # The device's share: each 256-token piece's mean and M2 (as rows of one piece each).
    mean, m2 = (np.asarray(a)[:, :, 0] for a in piece_moments(
        jnp.asarray(block_bf16.reshape(args.layers, -1, 256, args.width)), jnp.ones((len(lengths), 256), jnp.int32), 1))
    timed("stats: the pieces' device moments merged (fp64)",
          lambda: [fmt.RunningStats.of_pieces(v, list(mean[j]), list(m2[j])) for j, v in enumerate(tensors.values())])
    timed(ASIDE + "exact fp64 stats on the host (only a piece past its row's moment slots)",
          lambda: [fmt.RunningStats.of(block_bf16[j]) for j in range(args.layers)])
    parts = timed("safetensors header + parts (the pieces stay where they were captured)",
                  lambda: fmt.shard_parts(tensors, np.zeros(tokens, np.int32), lengths, np.arange(len(lengths)),
                                          np.zeros(len(lengths), np.int32), {"stream": "0", "shard": "0"}))
    timed("sha256", lambda: fmt.sha256(parts))
    storage = Storage(str(root / "stages"))
    files = itertools.count()  # a new file each time, as the job writes
    written: list[str] = []

    def write():
        if written and not args.keep:  # the previous one is deleted first, its pages reused (see --keep)
            storage.delete(written.pop())
        written.append(f"shard_{next(files)}.safetensors")
        storage.write_bytes(written[-1], parts)

    timed("write (atomic: temp file, fsync, rename)", write)
    return rates


def disk_rate(directory: Path, nbytes: int = 2**30) -> float:
    """GB/s of a raw sequential write with fsync to `directory` (what `dd conv=fsync` reports): the disk's bound."""
    block = np.random.default_rng(4).integers(0, 255, 16 * 2**20, dtype=np.uint8)
    path = directory / "disk-rate.bin"
    t = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(nbytes // block.nbytes):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t
    path.unlink()
    return nbytes / seconds / 1e9


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
    args = parse_args()
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    ram = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="harvest-host-", dir=args.out or ram) as tmp, \
            tempfile.TemporaryDirectory(prefix="harvest-host-disk-") as on_disk:
        root = Path(tmp)
        print("host pipeline ...", flush=True)
        seconds, nbytes = host_pipeline(args, root)
        rates = stage_rates(args, root)
        disk = disk_rate(Path(on_disk))
        print("training the BPE ...", flush=True)
        texts = corpus(args.feeder_mb)
        checkpoint, vocab, train_s = train_tokenizer(texts, args.vocab, root / "tokenizer")
        print("feeder ...", flush=True)
        feed_s, feed_tokens = feeder(texts, checkpoint, root, args.seq)
    limit = min((name for name in rates if not name.startswith(ASIDE)), key=rates.get)
    rows = [["host pipeline (to_shards + committer threads)", f"{nbytes / 1e9:.2f} GB", f"{seconds:.1f}",
             f"{nbytes / seconds / 1e9:.2f} GB/s", f"{nbytes / seconds / 1e9 / cores:.2f} GB/s"]]
    rows += [[f"  stage alone: {name}" + ("  <- limits" if name == limit else ""), "", "", f"{rate:.2f} GB/s", ""]
             for name, rate in rates.items()]
    rows.append([f"local disk ({on_disk}): raw sequential write + fsync, the storage bound", "1.07 GB", "",
                 f"{disk:.2f} GB/s", ""])
    rows.append([f"feeder: read, render, tokenize (BPE {vocab:,}), pack", f"{feed_tokens:,} tokens", f"{feed_s:.1f}",
                 f"{feed_tokens / feed_s:,.0f} tokens/s", f"{feed_tokens / feed_s / cores:,.0f} tokens/s"])
    footer = (f"captures: bf16, {args.layers} layers x width {args.width}, {args.batch_size} rows x {args.seq} per "
              f"batch, {args.batches} batches, lognormal pieces packed as the job packs them; shard size "
              f"{args.shard_size}; shards written to {root.parent}"
              f"{', each deleted once committed (--keep: kept)' if not args.keep else ', all kept'}; each batch's piece "
              f"moments ({args.slots} slots a row) made on the CPU device before the clock starts. GB/s count the real "
              f"tokens' capture bytes. Stages alone: "
              f"one thread on {args.layers} x 65,536 tokens. Feeder: {len(texts):,} generated jsonl texts, one "
              f"thread; the BPE trained in {train_s:.0f} s. {cores} cores; load average {load:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after (other work on the machine lowers every rate).")
    if not sys.stdout.isatty():
        os.environ.setdefault("COLUMNS", "140")
    show("harvest host side (no model)", ["what", "amount", "seconds", "rate", "per core"], rows, footer)


if __name__ == "__main__":
    main()
