"""Forward-pass benchmark: harvest's attention kernels side by side on packed rows (any backend: tokens/s per
chip and MFU against the chip's published peak), and harvest (JAX) vs HF transformers (torch, where installed)
on the same random Qwen2 model.

Table 1, kernels: per shape [rows per chip x seq], harvest's jitted forward capturing --points over rows packed
with samples of lognormal length around --sample-len (as extraction packs them), on every device (data
parallel), for each --attention kind (default dense and the backend's best: splash on TPU, pallas-gpu on GPU,
blocks on CPU). tokens/s per chip counts real tokens; MFU is useful FLOPs (the layers run, attention within each
sample only: the same for every kernel) over the chips' peak (harvest.runtime.chips; a measured matmul rate on
CPU); "x dense" is the dense kernel's time over this one's.

Table 2, HF (when torch is installed; --no-hf skips it): per shape of random token ids (one sample per row),
tokens/s of harvest's forward capturing resid_post at every layer and of HF's base model (no LM head) called
with output_hidden_states=True, both fp32; "device" stops when the outputs exist, "+ host copy" also turns
them into one numpy array as the product needs. Then jit compile time at two depths of the same width, which
should stay flat because layers run under lax.scan. Calls are interleaved and warmed up (no compile in the
timings).

--pallas-blocks sweeps the pallas-gpu kernel's tiles (harvest.model.attention.pallas_blocks): one row per
choice, "table" being the table's own; a choice the chip cannot compile (Triton out of shared memory, say)
prints its error in its row and the sweep goes on.

Run:  .venv/bin/python bench/forward.py            (defaults take ~2-3 minutes on 2 CPU cores)
      python bench/forward.py --preset 0.5b --shapes 16x2048 --no-hf      (a TPU VM or a GPU node: dense vs
                                                                           splash / pallas-gpu, bf16)
      python bench/forward.py --preset 0.5b --shapes 16x2048 --no-hf --attention pallas-gpu --iters 3 \
          --pallas-blocks table,128x128w4s2,64x64w4s2,128x64w4s3,128x128w8s3      (a GPU: the tiles' sweep)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import transformers

try:  # HF's side of the comparison; a TPU VM may have no torch
    import torch
except ImportError:
    torch = None

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/shapes.py, bench/table.py
from shapes import PRESETS, mean_context, model_config, packed_segments
from table import show

from harvest.model import default_compute_dtype
from harvest.model.attention import (LANES, SPEC_HELP, AttentionError, blocks_override, pallas_blocks, parse_blocks,
                                     resolve, table_blocks)
from harvest.model.config import ModelConfig
from harvest.model.flops import forward_flops_per_token
from harvest.model.init import init_params
from harvest.model.points import parse_points
from harvest.model.transformer import forward
from harvest.model.weights import load_params, params_shape
from harvest.runtime.chips import peak_flops_per_device
from harvest.runtime.mesh import constrainer, make_mesh


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4x512,1x2048", help="BxS per forward, comma-separated (default 4x512,1x2048)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    p.add_argument("--intermediate", type=int, default=1536, help="MLP width (default 1536)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the throughput model (default 8)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    p.add_argument("--iters", type=int, default=7, help="timed calls of each (default 7)")
    p.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"], help="HF attention (default sdpa)")
    p.add_argument("--compile-depths", default="4,32", help="layer counts for the compile-time rows (default 4,32)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    k = p.add_argument_group("kernels table")
    k.add_argument("--preset", default=None, choices=sorted(PRESETS), help="a published shape instead of the "
                   "--hidden/--layers/... model (0.5b, 7b: Qwen2.5's)")
    k.add_argument("--attention", default="dense,auto", help="kernels side by side (default dense,auto)")
    k.add_argument("--sample-len", type=int, default=300, help="mean tokens per packed sample (default 300)")
    k.add_argument("--points", default="resid_post:all", help="capture points (default resid_post:all)")
    k.add_argument("--dtype", default=None, help="compute dtype (default: float32 on CPU, bfloat16 elsewhere)")
    k.add_argument("--no-hf", action="store_true", help="skip the HF table (skipped anyway without torch)")
    add_blocks_flag(k, "one row each")
    args = p.parse_args()
    args.shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    return args


def add_blocks_flag(parser, rows: str) -> None:
    """--pallas-blocks (here and in bench/train.py), each choice checked as it is parsed, before any work
    (argparse's one-line error for a bad one)."""
    parser.add_argument("--pallas-blocks", default="table", type=_checked_blocks,
                        help=f"pallas-gpu tiles, {rows}, comma-separated: 'table' (harvest's choice per head size "
                        f"and row) or {SPEC_HELP} (default table)")


def _checked_blocks(blocks: str) -> str:
    for spec in blocks.split(","):
        try:
            spec == "table" or parse_blocks(spec, table_blocks(64, 2048))
        except AttentionError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return blocks


def hf_config(args: argparse.Namespace, layers: int) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(s for _, s in args.shapes), rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False,
    )


def time_calls(fns: list, iters: int) -> list[tuple[float, float]]:
    """(median, best) seconds per call of each fn, after a warm-up call (compile, first allocations) of each.

    Calls are interleaved round-robin so that background load on the machine hits all of them alike.
    """
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(iters):
        for fn, ts in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [(statistics.median(ts), min(ts)) for ts in times]


def build_models(args: argparse.Namespace):
    """The HF base model and harvest's (params, cfg) of the same random checkpoint."""
    torch.manual_seed(0)
    config = hf_config(args, args.layers)
    config._attn_implementation = args.attn
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial biases (HF initializes them to zero)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.02)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        cfg = ModelConfig.from_dir(tmp)
        params = load_params(tmp, cfg, dtype=np.float32)
    return model.model, params, cfg


def bench_shape(args, hf_model, params, cfg, batch: int, seq: int) -> tuple[list[tuple[float, float]], float]:
    """(median, best) seconds of [harvest device, harvest + host, HF device, HF + host]; max |harvest - HF|."""
    tokens = np.random.default_rng(0).integers(0, args.vocab, (batch, seq), dtype=np.int64)
    plan = parse_points(f"resid_post:0-{cfg.num_layers - 1}", cfg.num_layers)
    fwd = jax.jit(forward, static_argnames=("cfg", "plan", "constrain"))
    tok = jnp.asarray(tokens, jnp.int32)
    seg = jnp.ones_like(tok)  # one sample per row
    ids = torch.from_numpy(tokens)

    def harvest_device():
        return jax.block_until_ready(fwd(params, tok, seg, cfg=cfg, plan=plan))

    def harvest_host():
        return np.asarray(fwd(params, tok, seg, cfg=cfg, plan=plan)["resid_post"])

    @torch.no_grad()
    def hf_device():
        return hf_model(ids, output_hidden_states=True).hidden_states

    def hf_host():  # hidden_states[0] is the embedding output
        return torch.stack(hf_device()[1:]).numpy()

    # HF's last hidden state has the final norm applied; compare the layers before it.
    diff = float(np.abs(harvest_host()[:-1] - hf_host()[:-1]).max())
    return time_calls([harvest_device, harvest_host, hf_device, hf_host], args.iters), diff


def compile_seconds(args: argparse.Namespace, layers: int) -> float:
    """Best of 3 trace + lower + compile times of forward capturing resid_post at the last layer (params as shapes)."""
    cfg = ModelConfig.from_hf(hf_config(args, layers).to_dict())
    params = params_shape(cfg, dtype=np.float32)
    plan = parse_points(f"resid_post:{layers - 1}", layers)
    tok = jax.ShapeDtypeStruct(args.shapes[0], jnp.int32)
    fn = jax.jit(forward, static_argnames=("cfg", "plan", "constrain"))
    times = []
    for _ in range(3):
        jax.clear_caches()  # else the trace and the executable come from jax's in-memory caches
        t0 = time.perf_counter()
        fn.lower(params, tok, tok, cfg=cfg, plan=plan).compile()
        times.append(time.perf_counter() - t0)
    return min(times)


KERNEL_HEADER = ["rows/chip x seq", "attention", "median ms", "best ms", "tokens/s/chip", "x dense", "MFU"]


def variants(kinds: list[str], blocks: str, head_dim: int, seq: int) -> list[tuple[str, str, str | None]]:
    """(row label, kernel, tiles spec or None for the table's) per row: pallas-gpu once per --pallas-blocks
    choice, labelled with the tiles it runs for rows of `seq` tokens (padded to LANES, as the kernel pads them)."""
    seq = -(-seq // LANES) * LANES
    out = []
    for kind in kinds:
        for spec in blocks.split(",") if kind == "pallas-gpu" else ["table"]:
            spec = None if spec == "table" else spec
            with blocks_override(spec):
                tiles = f"{pallas_blocks(head_dim, seq)}{' (table)' if spec is None else ''}"
            out.append((f"{kind} {tiles}" if kind == "pallas-gpu" else kind, kind, spec))
    return out


def attempt(fn):
    """fn(), or the one-line error that stopped it: a tiles choice the chip refuses (Triton out of shared
    memory, say) is a result of the sweep, shown in its row."""
    try:
        return fn()
    except Exception as e:
        return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:100]}"


def compiled_forward(cfg: ModelConfig, plan, kind: str, spec: str | None, mesh, args):
    """The jitted forward compiled for `args` with `spec`'s pallas-gpu tiles, or the error that stopped it."""
    one_device = mesh.devices.size == 1
    run = jax.jit(partial(forward, cfg=cfg, plan=plan, attention=kind, constrain=None if one_device
                          else constrainer(mesh), mesh=None if one_device else mesh))
    with blocks_override(spec):
        return attempt(lambda: run.lower(*args).compile())


def kernel_rows(cfg: ModelConfig, shapes: list[tuple[int, int]], attention: str, points: str, sample_len: int,
                dtype: str, iters: int, blocks: str = "table") -> list[list[str]]:
    """KERNEL_HEADER rows: the jitted forward capturing `points` over packed rows, per shape and kernel (and
    pallas-gpu tiles choice), on every device (data parallel), params drawn on the devices (harvest.model.init)."""
    chips = jax.device_count()
    mesh = make_mesh(f"data={chips}")
    params = init_params(cfg, 0, mesh, dtype=dtype)
    plan = parse_points(points, cfg.num_layers)
    kinds = list(dict.fromkeys(resolve(k, cfg.sliding_windows, max(s for _, s in shapes))
                               for k in attention.split(",")))
    peak = peak_flops_per_device(dtype)
    rows = []
    for per_chip, seq in shapes:
        batch = per_chip * chips
        host = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)
        segments = packed_segments(batch, seq, sample_len)
        tokens, segs = (jax.device_put(a, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data")))
                        for a in (host, segments))
        real = int(np.count_nonzero(segments))
        flops = forward_flops_per_token(cfg, mean_context(segments), plan.num_layers) * real
        built = {label: compiled_forward(cfg, plan, kind, spec, mesh, (params, tokens, segs))
                 for label, kind, spec in variants(kinds, blocks, cfg.head_dim, seq)}
        ran = {label: fn for label, fn in built.items() if not isinstance(fn, str)}
        calls = [lambda fn=fn: jax.block_until_ready(fn(params, tokens, segs)) for fn in ran.values()]
        timings = dict(zip(ran, time_calls(calls, iters)))
        for label, fn in built.items():
            if label not in timings:
                rows.append([f"{per_chip}x{seq}", label, "failed", fn, "", "", ""])
                continue
            median, best = timings[label]
            ratio = f"{timings['dense'][1] / best:.2f}x" if "dense" in timings else ""
            rows.append([f"{per_chip}x{seq}", label, f"{median * 1e3:,.1f}", f"{best * 1e3:,.1f}",
                         f"{real / best / chips:,.0f}", ratio, f"{flops / best / (peak * chips):.1%}"])
    return rows


def kernels_table(args: argparse.Namespace, load: float) -> None:
    cfg = model_config(args.preset) if args.preset else ModelConfig.from_hf(hf_config(args, args.layers).to_dict())
    dtype = args.dtype or default_compute_dtype()
    rows = kernel_rows(cfg, args.shapes, args.attention, args.points, args.sample_len, dtype, args.iters,
                       args.pallas_blocks)
    chips = jax.device_count()
    footer = (f"{args.preset or 'custom'}: {cfg.num_layers} layers, d={cfg.hidden_size}, heads {cfg.num_heads}/"
              f"{cfg.num_kv_heads} kv; capturing {args.points}; rows packed with samples ~{args.sample_len} tokens; "
              f"{dtype}; data={chips} on {chips} x {jax.devices()[0].device_kind} (peak "
              f"{peak_flops_per_device(dtype) / 1e12:.2f} TFLOP/s per chip). Median and best of {args.iters}; "
              f"tokens/s per chip (real tokens) and MFU from the best. jax {jax.__version__} "
              f"({jax.default_backend()}); load average {load:.1f} before the run.")
    show("harvest forward by attention kernel, packed rows", KERNEL_HEADER, rows, footer)


def hf_table(args: argparse.Namespace, load: float) -> None:
    torch.set_num_threads(args.threads)
    hf_model, params, cfg = build_models(args)
    hf = f"HF {args.attn}"
    rows, diffs = [], []
    for batch, seq in args.shapes:
        (h_dev, h_host, t_dev, t_host), diff = bench_shape(args, hf_model, params, cfg, batch, seq)
        diffs.append(diff)
        for engine, what, (s, best), theirs in (("harvest", "device", h_dev, t_dev),
                                                 ("harvest", "+ host copy", h_host, t_host),
                                                 (hf, "device", t_dev, None), (hf, "+ host copy", t_host, None)):
            ratios = [f"{t / o:.2f}x" for t, o in zip(theirs, (s, best))] if theirs else ["", ""]
            rows.append([f"{batch}x{seq}", engine, what, f"{s * 1e3:.0f} ms", f"{best * 1e3:.0f} ms",
                         f"{batch * seq / s:,.0f}", *ratios])
    batch, seq = args.shapes[0]
    for layers in (int(d) for d in args.compile_depths.split(",")):
        rows.append([f"{batch}x{seq}", "harvest jit", f"compile, {layers} layers",
                     "", f"{compile_seconds(args, layers):.2f} s", "", "", ""])

    footer = (f"Qwen2, random weights: {args.layers} layers, hidden {args.hidden}, mlp {args.intermediate}, "
              f"heads {args.heads}/{args.kv_heads} kv, vocab {args.vocab}; fp32. harvest captures "
              f"resid_post:0-{args.layers - 1}; HF returns hidden_states. Times per forward, median and best of "
              f"{args.iters}; tokens/s from the median. On CPU, jax's host copy is zero-copy. "
              f"Max |harvest - HF| (layers 0-{args.layers - 2}): {max(diffs):.1e}. Compile: best of 3.\n"
              f"jax {jax.__version__} ({jax.default_backend()}, {jax.device_count()} device), "
              f"torch {torch.__version__} ({torch.get_num_threads()} threads), {os.cpu_count()} cores; "
              f"load average {load:.1f} before the run (other work inflates medians more than bests)")
    header = ["shape", "engine", "what", "median", "best", "tokens/s", "harvest/HF", "(best)"]
    show("harvest forward vs HF transformers", header, rows, footer)


def main() -> None:
    args = parse_args()
    load = os.getloadavg()[0]
    kernels_table(args, load)
    if not args.no_hf and torch is not None:
        hf_table(args, load)


if __name__ == "__main__":
    main()
