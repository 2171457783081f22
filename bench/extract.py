"""End-to-end extraction benchmark: harvest `run_extract` vs a plain HF-transformers loop, on CPU.

Same random Qwen2 model (with a byte-level tokenizer), same generated jsonl text dataset (record lengths
lognormal, clipped to --min-len..--max-len tokens: a FineWeb-like long tail), same capture points, same
max_seq_len (longer records truncated by both), same storage dtype (bf16). Prints one table:

  (a) harvest end-to-end: run_extract into a fresh temp dir. Wall time including tokenizer + model load,
      the summary's time (pipeline only: includes the jit compile), and a steady-state rate that also
      leaves out the first forward call (compile): the bench wraps the job's Decoder to timestamp calls.
  (b) HF as users write it today: read jsonl, tokenizer(padding="longest", truncation=True,
      max_length=max_seq_len) per batch of --hf-batch-size samples in file order, fp32 model(...,
      output_hidden_states=True) under no_grad, hidden_states[layer + 1] for each point, padding dropped,
      cast to bf16, safetensors.torch.save_file per batch (with input_ids and lengths, as harvest stores).
  (c) forward only, no I/O, compile excluded, on the first --forward-records records (default: half):
      harvest's Decoder on the packed rows harvest builds (data.batching) and HF's model(...) on (b)'s
      padded batches, calls interleaved so that both see the same background load.
  (d) padding: harvest's summary figure (rows that hold data), the share of all the token slots its
      forwards computed (idle rows of the last batch too), and HF's (pad tokens / batch slots).
  (a) and (b) run --rounds times each, alternated; the table shows each one's fastest round.

All tokens/s count real (non-padding) tokens; both pipelines see the same token count (checked). CPU
seconds (process CPU time; for (a) also per thread, sampled from /proc) show where harvest's time goes and
vary less than wall times when other work shares the machine. The caption also compares a stored
harvest sample with HF's values for it (bf16, layers before the last: HF's last hidden state has the
final norm applied, so it is not resid_post of the last layer).

Run:  .venv/bin/python bench/extract.py            (defaults: ~2 minutes on 2 idle CPU cores, ~4-5 busy)
      .venv/bin/python bench/extract.py --records 200 --layers 2   (a quick smoke run)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # for bench/forward.py: its model config, table printer
import jax
import torch
import transformers
from forward import hf_config, show

from harvest.config import ExtractConfig
from harvest.data import prompts, streams
from harvest.data.batching import pack_stream, stream_pieces
from harvest.demo import demo_checkpoint
from harvest.extract import job
from harvest.model import load_decoder, parse_points
from harvest.runtime.mesh import make_mesh

WORDS = ("the of and to in is was for on that with as by at from his her an which are this be or had it not "
         "were have but their one all also first new two has they more time after its been who other into "
         "would world between during under such most years over some city state university government "
         "national history people school system season several although including company number music")


class ThreadCpu:
    """CPU seconds per thread while running, read from /proc/self/task every `every` s (threads that end
    keep their last reading), grouped by what the thread does; `label(thread)` names Python threads."""

    def __init__(self, label, every: float = 0.5):
        self.label, self.every = label, every
        self.base: dict[int, float] = {}
        self.last: dict[int, tuple[str, float]] = {}
        self.names: dict[int, str] = {}
        self.stop = threading.Event()

    def _read(self) -> dict[int, tuple[str, float]]:
        for t in threading.enumerate():
            if t.native_id is not None and t.native_id not in self.names:
                self.names[t.native_id] = self.label(t)
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                stat = Path(f"/proc/self/task/{tid}/stat").read_text()
                comm = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            name = self.names.get(int(tid)) or ("XLA compute (Eigen pool)" if comm.startswith("tf_") else
                                                "other native (XLA runtime, tokenizer)")
            out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        return out

    def __enter__(self):
        self.base = {tid: cpu for tid, (_, cpu) in self._read().items()}
        self.thread = threading.Thread(target=self._run, daemon=True, name="bench-cpu-sampler")
        self.thread.start()
        return self

    def _run(self):
        while not self.stop.wait(self.every):
            self.last.update(self._read())

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self.last.update(self._read())

    def by_group(self) -> dict[str, float]:
        groups: dict[str, float] = {}
        for tid, (name, cpu) in self.last.items():
            if name != "bench-cpu-sampler":
                groups[name] = groups.get(name, 0.0) + cpu - self.base.get(tid, 0.0)
        return dict(sorted(groups.items(), key=lambda kv: -kv[1]))


def harvest_thread(t: threading.Thread) -> str:
    """What a thread of run_extract does (job._Stage threads are told apart by the function they run)."""
    names = getattr(getattr(t, "_target_fn", None), "__code__", None)
    names = names.co_names if names else ()
    if "_feed" in names:
        return "feeder: read, tokenize, pack"
    if "_to_shards" in names:
        return "host: to numpy, rows -> shards"
    if t.name.startswith("commit-"):
        return "commit: stats, encode, write"
    if t.name == "MainThread":
        return "main: dispatch, queues"
    return t.name if t.name == "bench-cpu-sampler" else "other Python threads"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--records", type=int, default=300, help="jsonl records (default 300)")
    d.add_argument("--median", type=float, default=300, help="median record length in tokens (default 300)")
    d.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the lengths (default 1.0)")
    d.add_argument("--min-len", type=int, default=50, help="shortest record, tokens (default 50)")
    d.add_argument("--max-len", type=int, default=2000, help="longest record, tokens (default 2000)")
    r = p.add_argument_group("run")
    r.add_argument("--max-seq-len", type=int, default=1024, help="harvest row length = HF max_length (default 1024)")
    r.add_argument("--batch-size", type=int, default=8, help="harvest packed rows per forward (default 8)")
    r.add_argument("--hf-batch-size", type=int, default=None, help="HF samples per forward (default: --batch-size)")
    r.add_argument("--points", default=None, help="capture points (default resid_post at every layer)")
    r.add_argument("--rounds", type=int, default=2,
                   help="end-to-end runs of each of (a) and (b), alternated; the table shows the fastest (default 2)")
    r.add_argument("--forward-records", type=int, default=None,
                   help="records of the forward-only comparison (c) (default: half of --records)")
    r.add_argument("--shard-size", default="128MB", help="harvest shard size (default 128MB)")
    r.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="HF attention (default sdpa)")
    r.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    r.add_argument("--keep", default=None, help="write model, data and outputs here and keep them (default: temp)")
    m = p.add_argument_group("model (Qwen2, random weights)")
    m.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    m.add_argument("--intermediate", type=int, default=768, help="MLP width (default 768)")
    m.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    m.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    m.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    m.add_argument("--vocab", type=int, default=320, help="vocabulary (>= 259: the byte tokenizer's ids; default 320)")
    args = p.parse_args()
    args.hf_batch_size = args.hf_batch_size or args.batch_size
    args.forward_records = min(args.forward_records or max(args.records // 2, 1), args.records)
    args.points = args.points or f"resid_post:0-{args.layers - 1}"
    args.shapes = [(args.batch_size, args.max_seq_len)]  # for forward.hf_config's max_position_embeddings
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.vocab < 259:
        p.error("--vocab must be >= 259 (256 bytes + 3 specials of the byte-level tokenizer)")
    return args


# --- setup (not timed) -------------------------------------------------------------------------------------

def build_model(args: argparse.Namespace, root: Path) -> Path:
    """A random Qwen2 checkpoint (non-zero biases, as forward.build_models) with harvest.demo's byte tokenizer."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(hf_config(args, args.layers)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.02)
    path = root / "model"
    model.save_pretrained(path)
    demo = demo_checkpoint(root / "demo")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, path / name)
    return path


def write_data(args: argparse.Namespace, root: Path) -> tuple[Path, np.ndarray]:
    """jsonl of {"text"} records; ASCII text, so with the byte tokenizer one character is one token."""
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(np.log(args.median), args.sigma, args.records), args.min_len, args.max_len)
    lengths = lengths.astype(int)
    words = rng.choice(WORDS.split(), size=int(lengths.sum()) // 3 + 100)
    text = " ".join(words)
    path = root / "data.jsonl"
    with path.open("w") as f:
        at = 0
        for i, n in enumerate(lengths):
            f.write(json.dumps({"id": i, "text": text[at : at + n]}) + "\n")
            at += n
    return path, lengths


# --- (a) harvest end-to-end ---------------------------------------------------------------------------------

class TimedDecoder:
    """Wraps the job's Decoder: timestamps each call's return and counts its real tokens (segment > 0)."""

    def __init__(self, decoder):
        self._decoder = decoder
        self.calls: list[tuple[float, int]] = []

    def __getattr__(self, name):
        return getattr(self._decoder, name)

    def __call__(self, tokens, segments):
        out = self._decoder(tokens, segments)
        self.calls.append((time.perf_counter(), int(np.count_nonzero(segments))))
        return out


def run_harvest(args, model_dir: Path, data: Path, out: Path) -> dict:
    wrapped: list[TimedDecoder] = []
    original = job.load_decoder

    def load_timed(*a, **k):
        wrapped.append(TimedDecoder(original(*a, **k)))
        return wrapped[-1]

    cfg = ExtractConfig(model=str(model_dir), data=str(data), out=str(out), points=args.points,
                        max_seq_len=args.max_seq_len, batch_size=args.batch_size, long="truncate",
                        dtype="bfloat16", compute_dtype="float32", shard_size=args.shard_size,
                        overwrite=True).validate()
    job.load_decoder = load_timed
    try:
        with ThreadCpu(harvest_thread) as cpu:
            t0, c0 = time.perf_counter(), time.process_time()
            summary = job.run_extract(cfg)
            t_end, c_end = time.perf_counter(), time.process_time()
    finally:
        job.load_decoder = original
    calls = wrapped[0].calls
    t_first, later = calls[0][0], sum(n for _, n in calls[1:])
    slots = len(calls) * args.batch_size * args.max_seq_len  # every forward's full shape, idle rows included
    return {"summary": summary, "wall": t_end - t0, "cpu": c_end - c0, "tokens": summary["tokens_this_run"],
            "padding": summary["padding"], "pipeline": summary["seconds"], "steady": t_end - t_first,
            "steady_tokens": later, "batches": len(calls), "threads": cpu.by_group(),
            "slot_padding": 1 - sum(n for _, n in calls) / slots}


# --- (b) HF transformers ----------------------------------------------------------------------------------

def run_hf(args, model_dir: Path, data: Path, out: Path, layers: list[int]) -> dict:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    t0, c0 = time.perf_counter(), time.process_time()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation=args.attn).eval()
    t_loaded = time.perf_counter()
    stages = {"read + tokenize": 0.0, "model(...)": 0.0, "select + bf16 + save": 0.0}
    real = slots = 0
    with data.open() as f:
        lines = f.readlines()
    for b, at in enumerate(range(0, len(lines), args.hf_batch_size)):
        t = time.perf_counter()
        texts = [json.loads(line)["text"] for line in lines[at : at + args.hf_batch_size]]
        enc = tokenizer(texts, padding="longest", truncation=True, max_length=args.max_seq_len, return_tensors="pt")
        t1 = time.perf_counter()
        with torch.no_grad():
            hidden = model(**enc, output_hidden_states=True).hidden_states
        t2 = time.perf_counter()
        keep = enc["attention_mask"].bool()
        tensors = {f"resid_post.{layer}": hidden[layer + 1][keep].to(torch.bfloat16) for layer in layers}
        tensors["input_ids"] = enc["input_ids"][keep]
        tensors["lengths"] = keep.sum(1)
        save_file(tensors, str(out / f"batch_{b:06d}.safetensors"))
        t3 = time.perf_counter()
        stages["read + tokenize"] += t1 - t
        stages["model(...)"] += t2 - t1
        stages["select + bf16 + save"] += t3 - t2
        real += int(keep.sum())
        slots += keep.numel()
    t_end, c_end = time.perf_counter(), time.process_time()
    return {"wall": t_end - t0, "cpu": c_end - c0, "pipeline": t_end - t_loaded, "tokens": real, "padding": 1 - real / slots,
            "stages": stages, "batches": b + 1}


# --- (c) forward only, interleaved ------------------------------------------------------------------------

def run_forward(args, model_dir: Path, data: Path) -> dict:
    """On the first --forward-records records: harvest's Decoder on the packed rows harvest builds
    (data.batching) and HF's model(...) on (b)'s padded batches, no I/O, interleaved so that both see the
    same background load; compile timed apart."""
    tokenizer = prompts.load_tokenizer(model_dir)
    records = itertools.islice(streams.open_data(str(data)).records(0), args.forward_records)
    events = stream_pieces(records, prompts.make_renderer("text", tokenizer),
                           prompts.encoder(tokenizer, "text"), first_index=0, max_seq_len=args.max_seq_len,
                           long="truncate", strict=False, sample_error=prompts.SampleError)
    rows = list(pack_stream(events, args.max_seq_len))
    B, S = args.batch_size, args.max_seq_len
    packed = []
    for at in range(0, len(rows), B):
        tokens, segments = np.zeros((B, S), np.int32), np.zeros((B, S), np.int32)
        for i, row in enumerate(rows[at : at + B]):
            tokens[i], segments[i] = row.tokens, row.segments
        packed.append((tokens, segments))
    with data.open() as f:
        texts = [json.loads(line)["text"] for line in itertools.islice(f, args.forward_records)]
    padded = [tokenizer(texts[at : at + args.hf_batch_size], padding="longest", truncation=True,
                        max_length=args.max_seq_len, return_tensors="pt")
              for at in range(0, len(texts), args.hf_batch_size)]

    decoder = load_decoder(model_dir, args.points, make_mesh("data=1"), "float32", out_dtype="bfloat16")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, attn_implementation=args.attn).eval()
    t0 = time.perf_counter()
    jax.block_until_ready(decoder(*packed[0]))
    compile_s = time.perf_counter() - t0

    def harvest_call(batch):
        jax.block_until_ready(decoder(*batch))

    @torch.no_grad()
    def hf_call(enc):
        model(**enc, output_hidden_states=True)

    work = [(harvest_call, packed), (hf_call, padded)]
    done, wall, cpu = [0, 0], [0.0, 0.0], [0.0, 0.0]
    while any(d < len(items) for d, (_, items) in zip(done, work)):
        # next: the engine that is least far through its batches
        e = min((k for k in (0, 1) if done[k] < len(work[k][1])), key=lambda k: done[k] / len(work[k][1]))
        fn, items = work[e]
        t, c = time.perf_counter(), time.process_time()
        fn(items[done[e]])
        wall[e] += time.perf_counter() - t
        cpu[e] += time.process_time() - c
        done[e] += 1
    h_real = sum(int(np.count_nonzero(s)) for _, s in packed)
    f_real = sum(int(enc["attention_mask"].sum()) for enc in padded)
    f_slots = sum(enc["attention_mask"].numel() for enc in padded)
    return {"harvest": {"seconds": wall[0], "cpu": cpu[0], "tokens": h_real, "batches": len(packed),
                        "padding": 1 - h_real / (len(packed) * B * S)},
            "hf": {"seconds": wall[1], "cpu": cpu[1], "tokens": f_real, "batches": len(padded),
                   "padding": 1 - f_real / f_slots},
            "compile": compile_s}


# --- check and table ---------------------------------------------------------------------------------------

def compare_sample(harvest_out: Path, hf_out: Path, layers: list[int], sample_id: int = 0) -> float:
    """Max |harvest - HF| (as float32 of the bf16 values) over one sample, layers before the model's last."""
    from safetensors.numpy import load_file

    import harvest

    got = harvest.open(str(harvest_out)).sample(sample_id).activations
    ref = load_file(str(hf_out / "batch_000000.safetensors"))  # bf16 arrays via ml_dtypes
    n = int(ref["lengths"][0])
    diffs = [np.abs(got[f"resid_post.{layer}"].astype(np.float32) - ref[f"resid_post.{layer}"][:n].astype(np.float32)).max()
             for layer in layers]
    return float(max(diffs)) if diffs else float("nan")


def main() -> None:
    args = parse_args()
    load = os.getloadavg()[0]
    torch.set_num_threads(args.threads)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="harvest-bench-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        model_dir = build_model(args, root)
        data, lengths = write_data(args, root)
        plan = parse_points(args.points, args.layers)
        resid = [layer for p, ls in plan.points if p == "resid_post" for layer in ls]
        if [p for p, _ in plan.points] != ["resid_post"]:
            sys.exit("--points: this bench compares resid_post only (HF hidden_states)")
        print(f"data: {args.records} records, {int(lengths.sum()):,} tokens before truncation "
              f"(median {int(np.median(lengths))}, mean {lengths.mean():.0f}, max {lengths.max()}); "
              f"{(lengths > args.max_seq_len).mean():.1%} longer than {args.max_seq_len}", flush=True)
        runs: dict[str, list[dict]] = {"a": [], "b": []}
        for k in range(args.rounds):  # alternated, so that a burst of other work does not hit one side only
            print(f"(a) harvest run_extract, round {k + 1}/{args.rounds} ...", flush=True)
            shutil.rmtree(root / "out-harvest", ignore_errors=True)
            runs["a"].append(run_harvest(args, model_dir, data, root / "out-harvest"))
            print(f"    {runs['a'][-1]['wall']:.1f} s", flush=True)
            print(f"(b) HF transformers loop, round {k + 1}/{args.rounds} ...", flush=True)
            shutil.rmtree(root / "out-hf", ignore_errors=True)
            runs["b"].append(run_hf(args, model_dir, data, root / "out-hf", resid))
            print(f"    {runs['b'][-1]['wall']:.1f} s", flush=True)
        a, b = (min(runs[x], key=lambda r: r["wall"]) for x in "ab")
        print("(c) forward only, harvest and HF interleaved ...", flush=True)
        c = run_forward(args, model_dir, data)
        print(f"    {c['harvest']['seconds'] + c['hf']['seconds'] + c['compile']:.1f} s", flush=True)
        diff = compare_sample(root / "out-harvest", root / "out-hf", [x for x in resid if x < args.layers - 1])
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    load_after = os.getloadavg()[0]

    pct = "{:.1%}".format

    def walls(x: str) -> str:
        return ", ".join(f"{r['wall']:.1f}" for r in runs[x])

    def row(pipeline, what, seconds, cpu, tokens, padding=None, vs=None):
        """vs: the HF (seconds, tokens) this row's tokens/s is compared with."""
        cells = [pipeline, what, f"{seconds:.1f}", f"{cpu:.1f}" if cpu is not None else ""]
        if tokens is None:
            return cells + ["", "", "", ""]
        ratio = f"{(tokens / seconds) / (vs[1] / vs[0]):.2f}x" if vs else ""
        return cells + [f"{tokens:,}", f"{tokens / seconds:,.0f}", pct(padding) if padding is not None else "", ratio]

    hc, fc = c["harvest"], c["hf"]
    hf_all, hf_run = (b["wall"], b["tokens"]), (b["pipeline"], b["tokens"])
    rows = [
        row("(a) harvest", "end to end, incl. model load + compile", a["wall"], a["cpu"], a["tokens"],
            a["padding"], hf_all),
        row("(a) harvest", "summary's time: pipeline incl. compile", a["pipeline"], None, a["tokens"], None, hf_run),
        row("(a) harvest", "steady: after the 1st forward returned", a["steady"], None, a["steady_tokens"], None,
            hf_run),
        *[["(a) harvest", f"  CPU: {name}", "", f"{cpu:.1f}", "", "", "", ""]
          for name, cpu in a["threads"].items() if cpu >= 0.05],
        row("(b) HF", "end to end, incl. model load", b["wall"], b["cpu"], b["tokens"], b["padding"]),
        row("(b) HF", "after model load", b["pipeline"], None, b["tokens"]),
        *[row("(b) HF", f"  stage: {name}", sec, None, None) for name, sec in b["stages"].items()],
        row("(c) harvest", "forward only: packed rows, no I/O", hc["seconds"], hc["cpu"], hc["tokens"],
            hc["padding"], (fc["seconds"], fc["tokens"])),
        row("(c) harvest", "  jit compile (first call, not above)", c["compile"], None, None),
        row("(c) HF", "forward only: model(...) on (b)'s batches", fc["seconds"], fc["cpu"], fc["tokens"],
            fc["padding"]),
        ["(d) padding", "harvest summary (rows with data) / HF", "", "", "", "",
         f"{pct(a['padding'])} / {pct(b['padding'])}", ""],
        ["(d) padding", "harvest, all computed slots (idle rows too)", "", "", "", "", pct(a["slot_padding"]), ""],
    ]
    same = "same" if a["tokens"] == b["tokens"] and hc["tokens"] == fc["tokens"] else "DIFFERENT"
    footer = (
        f"Qwen2, random weights: {args.layers} layers, hidden {args.hidden}, mlp {args.intermediate}, heads "
        f"{args.heads}/{args.kv_heads} kv, vocab {args.vocab} (byte tokenizer: 1 token per character); fp32 "
        f"compute, bf16 storage; points {args.points}. Data: {args.records} jsonl records, lengths lognormal "
        f"(median {args.median:g}, sigma {args.sigma:g}) clipped to {args.min_len}..{args.max_len}, truncated at "
        f"{args.max_seq_len}. harvest: {args.batch_size} packed rows x {args.max_seq_len} per forward "
        f"({a['batches']} forwards), shard size {args.shard_size}; HF: {args.hf_batch_size} samples per forward "
        f"padded to the longest, in file order ({b['batches']} forwards), {args.attn} attention, "
        f"AutoModelForCausalLM (LM head included). (a), (b): the fastest of {args.rounds} alternated rounds (wall s: "
        f"harvest {walls('a')}; HF {walls('b')}). "
        f"(c) covers the first {args.forward_records} records. Real "
        f"tokens: {same} in (a) and (b), and in (c). "
        f"tokens/s counts real tokens; harvest/HF is the ratio of tokens/s with the HF row below it "
        f"(>1: harvest faster; the summary and steady rows are compared with HF after load). CPU s: process "
        f"CPU time (all threads; (a) also per thread), less sensitive than wall time to other work on the "
        f"machine. Sample 0, max |harvest - HF| (bf16, resid_post below layer {args.layers - 1}): {diff:.3g}.\n"
        f"jax {jax.__version__} ({jax.default_backend()}, {jax.device_count()} device), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), transformers {transformers.__version__}, {os.cpu_count()} cores; "
        f"load average {load:.1f} before the run, {load_after:.1f} after (other work inflates wall times)"
    )
    if not sys.stdout.isatty():  # rich would wrap the table at 100 columns (forward.show's minimum)
        os.environ.setdefault("COLUMNS", "140")
    header = ["pipeline", "what", "seconds", "CPU s", "real tokens", "tokens/s", "padding", "harvest/HF"]
    show("harvest extraction vs HF transformers (CPU)", header, rows, footer)


if __name__ == "__main__":
    main()
