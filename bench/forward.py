"""Forward-pass benchmark: harvest (JAX) vs HF transformers (torch) on the same random Qwen2 model.

Prints one table. Per shape [batch x seq] of random token ids: tokens/s of harvest's jitted forward
capturing resid_post at every layer, and of HF's base model (no LM head) called with
output_hidden_states=True, both fp32; "device" stops when the outputs exist, "+ host copy" also
turns them into one numpy array [layers, batch, seq, width] as the product needs. Calls are
interleaved and warmed up (no compile in the timings). Then jit compile time
(trace + lower + compile) at two depths of the same width, which should stay flat because layers
run under lax.scan.

Run:  .venv/bin/python bench/forward.py            (defaults take ~2-3 minutes on 2 CPU cores)
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from table import show

from harvest.model.config import ModelConfig
from harvest.model.points import parse_points
from harvest.model.transformer import forward
from harvest.model.weights import load_params, param_specs


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
    args = p.parse_args()
    args.shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    return args


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
    params: dict = {}
    for path, spec in param_specs(cfg).items():
        *parents, leaf = path.split("/")
        node = params
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = jax.ShapeDtypeStruct(((layers,) if spec.layered else ()) + spec.shape, jnp.float32)
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


def main() -> None:
    args = parse_args()
    load = os.getloadavg()[0]
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


if __name__ == "__main__":
    main()
