"""Host-side benchmark: how fast the host absorbs captures, and how fast the feeder makes rows. No model.

1. Host stage (bench/host_stage.py). Synthetic captures [layers, batch, seq, width] as the jitted step hands
   them (bf16 values, or int8 / float8_e4m3fn codes with float32 per-token scales), with each batch's moments
   made before the clock starts, go through the job's own host stage: extract.pipeline.to_shards and the
   Committer (stats, safetensors encoding, checksums of each tensor and each 1 MiB chunk, writes with fsync,
   sidecars); bf16 once with each checksum a sidecar may name, each 8-bit dtype with the default, so that
   tokens/s compare side by side. Then each step alone on the bf16 shards, one thread: cutting, stats,
   encoding, the checksums, the sidecars, writing (the largest share bounds the stage); and the Committer alone.
2. The floor (bench/host_floor.py): the work no host stage can skip, one checksum pass and one write (+ fsync)
   of every byte, measured here in the same run on the same shards (a thread per core hashing, one per core
   writing). The host stage's ratio to the floor of its own checksum is the figure of merit.
3. Feeder (bench/feeder.py): jsonl text -> render -> tokenize -> pack (the job's data.batching), with a
   byte-level BPE of ~150k tokens like Qwen2.5's, trained here on generated text: tokens/s, and per core.

`--cores N` pins the whole process (its threads, numpy's, the tokenizer's) to N cores.

Run:  .venv/bin/python bench/host.py --cores 1      (~2-3 minutes on 2 CPU cores)
      .venv/bin/python bench/host.py --out /dev/shm (into memory: the host stage's own bound, not the disk's)
      .venv/bin/python bench/host.py --help         (widths, layers, batches, dtypes, vocabulary, where to write)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import tempfile
import time
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
    p.add_argument("--dtypes", default="bfloat16,int8,float8_e4m3fn",
                   help="storage dtypes side by side, comma-separated (bfloat16 always; default all three)")
    p.add_argument("--out", default=None,
                   help="directory the shards go to (default: a temp dir on the local disk, $TMPDIR or /tmp)")
    args = p.parse_args()
    args.dtypes = ["bfloat16", *[d for d in args.dtypes.split(",") if d and d != "bfloat16"]]
    return args


ARGS = parse_args()
if ARGS.cores:  # before jax, numpy or the tokenizer start their threads: they all inherit it
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: ARGS.cores])

sys.path.insert(0, str(Path(__file__).resolve().parent))  # table.py, host_stage.py, host_floor.py, feeder.py
import host_floor  # noqa: E402
import host_stage  # noqa: E402
from feeder import corpus, feeder, train_tokenizer  # noqa: E402
from table import show  # noqa: E402

from harvest.model import moments  # noqa: E402
from harvest.store import encoding  # noqa: E402

CHUNKED = "xxh3_128 of each 1 MiB chunk, each tensor's derived (the sidecar's: one hash a byte)"


# --- 1. host stage -------------------------------------------------------------------------------------------

def host(args, directory: Path) -> tuple[list, list, str, str]:
    """The bf16 table (the stage per checksum, each step alone, the floors) and the storage dtypes' table."""
    works = host_stage.workloads(args, args.dtypes)
    cores = len(os.sched_getaffinity(0))
    for work in works.values():  # first touches, imports, thread pools, each writer's first shard
        host_stage.whole_stage(args, dataclasses.replace(work, batches=work.batches[:2]), directory / f"warm-{work.dtype}")
    bf16, default = works["bfloat16"], encoding.default_checksum()
    collect = host_stage.Collect()
    t = time.perf_counter()
    host_stage.cut(args, bf16, collect)
    cut_s = time.perf_counter() - t
    shards = list(collect.shards)
    parts = [host_stage.shard_parts(s) for s in shards]

    def committer_alone(r: int) -> float:
        committer = host_stage.committer_for(args, directory / f"committer{r}")
        t = time.perf_counter()
        for shard in shards:
            committer.submit(shard)
        committer.close()
        return time.perf_counter() - t

    def stage(dtype, checksum, r):
        return host_stage.whole_stage(args, works[dtype], directory / f"stage-{dtype}-{checksum}{r}", checksum)

    # Each round times everything once, one after another: load from other work on a shared machine slows
    # rounds, never speeds one up, and the best of rounds taken side by side compares like with like.
    runs: dict[str, Callable[[int], float]] = {
        **{f"stage bfloat16 {c}": functools.partial(stage, "bfloat16", c) for c in encoding.CHECKSUMS},
        **{f"stage {d} {default}": functools.partial(stage, d, default) for d in works if d != "bfloat16"},
        "committer": committer_alone,
        **{f"floor {name}": functools.partial(lambda h, r: host_floor.floor(parts, directory, h, cores, args.keep), h)
           for name, h in {**host_floor.checksums(), CHUNKED: host_floor.WithChunks,
                           "write only": host_floor.NoHash}.items()}}
    best = {name: float("inf") for name in runs}
    for r in range(args.repeats):
        for name, run in runs.items():
            best[name] = min(best[name], run(r))
        print(f"  round {r + 1}: {', '.join(f'{n} {t:.1f} s' for n, t in best.items())}", flush=True)
    alone = host_stage.steps_alone(args, shards, directory)
    nbytes = bf16.nbytes
    floors = {name: nbytes / best[f"floor {name}"] / 1e9 for name in host_floor.checksums()}
    rows = []
    for checksum in encoding.CHECKSUMS:
        t = best[f"stage bfloat16 {checksum}"]
        rate = nbytes / t / 1e9
        rows.append([f"host stage, {checksum}{' (default)' if checksum == default else ''} "
                     f"(to_shards + Committer, {len(shards)} shards)", f"{nbytes / 1e9:.2f} GB", f"{t:.2f}",
                     f"{rate:.2f}", f"{rate / cores:.2f}", f"{rate / floors[checksum]:.0%} of {checksum}'s"])
    steps = [("cutting shards (to_shards, ShardWriter)", cut_s)] + [
        (name, t) for name, checksum, t in alone if checksum in (None, default)]
    total = sum(t for _, t in steps)
    rows += [[f"  alone: {name}", f"{t / total:.0%} of the steps" if checksum in (None, default) else "",
              f"{t:.2f}", f"{nbytes / t / 1e9:.2f}", "", ""]
             for name, checksum, t in [(steps[0][0], None, cut_s), *alone]]
    committer_rate = nbytes / best["committer"] / 1e9
    rows.append([f"  alone: the Committer ({default}; stats, encoding, checksums, writes, sidecars; its threads)",
                 "", f"{best['committer']:.2f}", f"{committer_rate:.2f}", f"{committer_rate / cores:.2f}",
                 f"{committer_rate / floors[default]:.0%}"])
    rows += [[f"floor: one {name} pass + one write (+fsync) of every byte", "", f"{best[f'floor {name}']:.2f}",
              f"{rate:.2f}", f"{rate / cores:.2f}", "100%" if name in encoding.CHECKSUMS else ""]
             for name, rate in floors.items()]
    chunked = nbytes / best[f"floor {CHUNKED}"] / 1e9
    stage_rate = nbytes / best[f"stage bfloat16 {default}"] / 1e9
    rows.append([f"floor: {CHUNKED} + one write (+fsync) of every byte", "", f"{best[f'floor {CHUNKED}']:.2f}",
                 f"{chunked:.2f}", f"{chunked / cores:.2f}", f"the stage: {stage_rate / chunked:.0%} of it"])
    write_only = nbytes / best["floor write only"] / 1e9
    rows.append(["floor: write (+fsync) only, no checksum", "", f"{best['floor write only']:.2f}",
                 f"{write_only:.2f}", f"{write_only / cores:.2f}", ""])
    first, second, third = [(name.split(":")[0], t / total) for name, t in sorted(steps, key=lambda step: -step[1])][:3]
    bound = (f"What bounds the stage (bf16, {default}): {first[0]} ({first[1]:.0%} of the steps' time alone on one "
             f"thread), then {second[0]} ({second[1]:.0%}) and {third[0]} ({third[1]:.0%}).")
    return rows, dtype_rows(works, best, floors[default], cores), f"{len(shards)} shards", bound


def dtype_rows(works: dict, best: dict, floor: float, cores: int) -> list:
    """Tokens/s through the host stage per storage dtype, against bf16's and the floor (of bf16's bytes)."""
    default = encoding.default_checksum()
    rate = {d: w.tokens / best[f"stage {d} {default}"] for d, w in works.items()}
    rows = []
    for dtype, work in works.items():
        t = best[f"stage {dtype} {default}"]
        gbs = work.nbytes / t / 1e9
        rows.append([f"host stage, {dtype}", f"{work.nbytes / work.tokens:,.0f}", f"{t:.2f}", f"{gbs:.2f}",
                     f"{rate[dtype]:,.0f}", f"{rate[dtype] / cores:,.0f}", f"{rate[dtype] / rate['bfloat16']:.2f}x",
                     f"{gbs / floor:.0%}"])
    return rows


def main() -> None:
    args = ARGS
    args.slots = moments.SLOTS
    load = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="harvest-host-", dir=args.out) as tmp:
        root = Path(tmp)
        print(f"host stage on {cores} core(s), writing to {root} ...", flush=True)
        rows, dtypes, shards, bound = host(args, root)
        print("training the BPE ...", flush=True)
        texts = corpus(args.feeder_mb)
        checkpoint, vocab, train_s = train_tokenizer(texts, args.vocab, root / "tokenizer")
        print("feeder ...", flush=True)
        feed_s, feed_tokens = feeder(texts, checkpoint, root, args.seq)
    rows.append([f"feeder: read, render, tokenize (BPE {vocab:,}), pack (tokens/s)", f"{feed_tokens:,} tokens",
                 f"{feed_s:.1f}", f"{feed_tokens / feed_s:,.0f}", f"{feed_tokens / feed_s / cores:,.0f}", ""])
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    machine = (f"{cores} core(s) ({model}); load average {load:.1f} before, {os.getloadavg()[0]:.1f} after (other "
               f"work on the machine lowers every rate)")
    where = f"{Path(tmp).parent}{' and kept' if args.keep else ', each file deleted once written'}"
    footer = (f"GB/s of the real tokens' capture bytes (bf16, {args.layers} layers x width {args.width}, "
              f"{args.batch_size} rows x {args.seq} a batch, {args.batches} batches of lognormal pieces packed as the "
              f"job packs them; shard size {args.shard_size}, {shards}), written to {where}. 'vs floor': the rate "
              f"over the floor of the same checksum measured in this run. Best of {args.repeats} rounds (each times "
              f"the host stage per checksum and dtype, the Committer and the floors in turn); steps alone: one run, "
              f"one thread (seconds of each). Feeder: {len(texts):,} generated jsonl texts; the BPE trained in "
              f"{train_s:.0f} s. {machine}. {bound}")
    show("harvest host side (no model)", ["what", "amount", "seconds", "GB/s", "per core", "vs floor"], rows, footer,
         columns=150)
    show("host stage by storage dtype", ["what", "bytes/token", "seconds", "GB/s", "tokens/s", "per core", "vs bf16",
                                         "vs floor"], dtypes,
         f"tokens/s through the host stage ({encoding.default_checksum()}), bf16 values against 8-bit codes with a "
         f"float32 scale per token as the device hands them, of the same values, about the same bytes (8-bit: ~2x "
         f"the rows, as many shards, so the last shard's write on one thread weighs alike); 'vs floor': GB/s over the "
         f"{encoding.default_checksum()} floor above (per byte). Best of {args.repeats} rounds. {machine}.",
         columns=150)


if __name__ == "__main__":
    main()
