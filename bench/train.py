"""Training-step benchmark: tokens/s per chip and MFU of harvest's jitted train step (AdamW, loss, backward) on a
random model over packed rows, per attention kernel and remat policy, side by side with the dense kernel and
with the forward alone (the LM loss without gradients), all measured in the same run.

Rows are packed as extraction and training pack them: samples of lognormal length around --sample-len, each
attending causally within itself (--sample-len 0: one sample per row). Tokens count real tokens only. MFU is
useful model FLOPs (3 x the forward: matmuls with the LM head, plus attention within each sample, the same for
every kernel, so that a kernel that computes cross-sample scores shows it as a lower MFU) over the peak of the
chips in harvest.runtime.chips (bf16; halved for fp32), or a measured fp32 matmul rate on CPU. Steps are warmed
up (no compile in the timings); the best of --iters is shown next to the median.

Run:  .venv/bin/python bench/train.py                        (small model on CPU, dense only, ~1-2 minutes)
      python bench/train.py --preset 0.5b --batch 16 --seq 2048                 (on a TPU VM or a GPU node:
                                                   dense vs the backend's kernel, splash or pallas-gpu)
      python bench/train.py --preset 7b --batch 8 --seq 2048 --mesh fsdp=8 --remat layer
      python bench/train.py --preset 0.5b --batch 16 --seq 2048 --attention pallas-gpu --iters 3 \
          --pallas-blocks table,128x128w4s2b32x32         (a GPU: the tiles' sweep, as bench/forward.py's)
On CPU the kernels run only in Pallas interpret mode (a test device, not a speed): `auto` resolves to dense.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/shapes.py, bench/table.py
from forward import add_blocks_flag, attempt, variants
from shapes import PRESETS, hf_fields, mean_context, model_config, packed_segments
from table import show

from harvest.model import default_compute_dtype
from harvest.model.attention import blocks_override, resolve
from harvest.model.flops import forward_flops_per_token
from harvest.model.init import init_params
from harvest.runtime.chips import peak_flops_per_device
from harvest.runtime.mesh import describe, make_mesh
from harvest.decoder.config import TrainConfig
from harvest.decoder.loss import loss_sum
from harvest.decoder.optimizer import learning_rate, make_optimizer
from harvest.decoder.step import batch_sharding, init_state, make_step, state_shardings


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=sorted(PRESETS), help="model shape (default small)")
    p.add_argument("--batch", type=int, default=4, help="global rows per step (default 4)")
    p.add_argument("--seq", type=int, default=512, help="tokens per row (default 512)")
    p.add_argument("--sample-len", type=int, default=300, help="mean tokens per packed sample (default 300)")
    p.add_argument("--attention", default="dense,auto", help="kernels to time, side by side (default dense,auto)")
    p.add_argument("--remat", default="layer", help="policies to time (default layer; also none, dots)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--mesh", default=None, help="mesh (default: every device on fsdp)")
    p.add_argument("--iters", type=int, default=5, help="timed steps per row (default 5)")
    add_blocks_flag(p, "rows for each")
    return p.parse_args()


def timed(fn, iters: int) -> list[float]:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


STEP_HEADER = ["attention", "what", "median ms", "best ms", "tokens/s/chip", "x dense", "MFU"]


def step_rows(preset: str, batch_rows: int, seq: int, sample_len: int, attention: str, remat: str, dtype: str,
              mesh_spec: str | None, iters: int, blocks: str = "table") -> tuple[list[list[str]], str]:
    """STEP_HEADER rows (forward-only loss and a train step per remat policy, per kernel and pallas-gpu tiles
    choice) and the table's footer."""
    model = model_config(preset)
    mesh = make_mesh(mesh_spec or f"fsdp={jax.device_count()}")
    batch = (batch_rows, seq)
    cfg = TrainConfig(data="-", out="-", shape=hf_fields(preset), tokenizer="-", steps=1000, warmup=10)
    optimizer = make_optimizer(cfg)
    params = init_params(model, 0, mesh)
    shardings = state_shardings(optimizer, model, mesh, jax.eval_shape(lambda p: p, params))
    host = np.random.default_rng(0).integers(0, model.vocab_size, batch).astype(np.int32)
    segments_host = packed_segments(batch_rows, seq, sample_len)
    sharding = batch_sharding(batch, mesh)
    tokens = jax.make_array_from_callback(batch, sharding, lambda i: host[i])
    segments = jax.make_array_from_callback(batch, sharding, lambda i: segments_host[i])
    real = int(np.count_nonzero(segments_host))
    useful = 3 * forward_flops_per_token(model, mean_context(segments_host), head=True) * real  # per step
    peak = peak_flops_per_device(dtype)
    chips = jax.device_count()
    kinds = list(dict.fromkeys(resolve(k, model.sliding_windows, seq, backward=True)
                               for k in attention.split(",")))

    results = []  # (kind, what, seconds per step or the error that stopped it, FLOPs per step)
    for label, kind, spec in variants(kinds, blocks, model.head_dim, seq):
        with blocks_override(spec):  # programs trace (so take their tiles) in their first, warm-up call
            forward = jax.jit(partial(loss_sum, cfg=model, compute_dtype=dtype, remat="none", attention=kind,
                                      mesh=mesh))
            results.append((label, "forward only",
                            attempt(lambda f=forward: timed(lambda: f(params, tokens, segments), iters)), useful / 3))
            for policy in remat.split(","):
                step = make_step(model, mesh, optimizer, shardings, compute_dtype=dtype, remat=policy, grad_accum=1,
                                 batch_shape=batch, lr_at=learning_rate(cfg), attention=kind)
                box = [init_state(params, optimizer, shardings)]

                def run(step=step, box=box):
                    box[0], metrics = step(box[0], tokens, segments)
                    return metrics["loss"]

                results.append((label, f"train step, remat {policy}", attempt(lambda: timed(run, iters)), useful))

    dense_best = {what: min(times) for kind, what, times, _ in results if kind == "dense"}
    rows = []
    for kind, what, times, flops in results:
        if isinstance(times, str):
            rows.append([kind, what, "failed", times, "", "", ""])
            continue
        best, median = min(times), statistics.median(times)
        ratio = f"{dense_best[what] / best:.2f}x" if what in dense_best else ""
        rows.append([kind, what, f"{median * 1e3:,.1f}", f"{best * 1e3:,.1f}", f"{real / best / chips:,.0f}", ratio,
                     f"{flops / best / (peak * chips):.1%}"])
    load = open("/proc/loadavg").read().split()[0] if jax.default_backend() == "cpu" else "-"
    footer = (f"{preset}: {model.num_layers} layers, d={model.hidden_size}, vocab {model.vocab_size}; "
              f"{batch_rows} rows x {seq}, samples ~{sample_len} tokens ({real:,} real tokens a step); "
              f"{dtype}; mesh {describe(mesh)} on {chips} x {jax.devices()[0].device_kind}, peak "
              f"{peak / 1e12:.2f} TFLOP/s per chip. tokens/s per chip from the best step; x dense: the dense kernel's "
              f"best time over this one's; MFU: useful FLOPs (same for every kernel) / peak. Load average {load}.")
    return rows, footer


def main() -> None:
    args = parse_args()
    rows, footer = step_rows(args.preset, args.batch, args.seq, args.sample_len, args.attention, args.remat,
                             args.dtype or default_compute_dtype(), args.mesh, args.iters, args.pallas_blocks)
    show("harvest train step: tokens/s per chip by attention kernel", STEP_HEADER, rows, footer)


if __name__ == "__main__":
    main()
