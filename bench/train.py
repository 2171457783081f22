"""Training-step benchmark: tokens/s and MFU of harvest's jitted train step (AdamW, loss, backward) on a
random model, per remat policy, against the forward alone (the LM loss without gradients) measured in
the same run as the baseline.

MFU counts 6 x matmul params + attention per token (remat's recomputation not counted) against the
device's peak: the vendor's bf16 number on TPU/GPU (halved for fp32), a measured fp32 matmul rate on
CPU. Steps are warmed up (no compile in the timings) and the best of --iters is shown next to the median.

Run:  .venv/bin/python bench/train.py                  (small model on CPU, ~1-2 minutes on 2 cores)
      python bench/train.py --preset 0.5b --batch 16   (Qwen2.5-0.5B's shape in bf16, on a GPU or TPU)
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import jax
import numpy as np

from harvest.model import default_compute_dtype
from harvest.model.config import ModelConfig
from harvest.model.init import init_params
from harvest.runtime.mesh import describe, make_mesh
from harvest.train.config import TrainConfig
from harvest.train.loss import loss_sum
from harvest.runtime.chips import peak_flops_per_device
from harvest.model.flops import train_flops_per_token
from harvest.train.optimizer import learning_rate, make_optimizer
from harvest.train.step import batch_sharding, init_state, make_step, state_shardings

PRESETS = {
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=sorted(PRESETS), help="model shape (default small)")
    p.add_argument("--batch", type=int, default=4, help="rows per step (default 4)")
    p.add_argument("--seq", type=int, default=512, help="tokens per row (default 512)")
    p.add_argument("--remat", default="none,layer,dots", help="policies to time (default none,layer,dots)")
    p.add_argument("--dtype", default=None, help="compute dtype (default: float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--mesh", default=None, help="mesh (default: every device on fsdp)")
    p.add_argument("--iters", type=int, default=5, help="timed steps per row (default 5)")
    return p.parse_args()


def timed(fn, iters: int) -> list[float]:
    jax.block_until_ready(fn())  # compile and warm up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    args = parse_args()
    dtype = args.dtype or default_compute_dtype()
    shape = {"model_type": "qwen2", "rms_norm_eps": 1e-6, "rope_theta": 1e6, **PRESETS[args.preset]}
    model = ModelConfig.from_hf(shape, f"preset {args.preset}")
    mesh = make_mesh(args.mesh or f"fsdp={jax.device_count()}")
    batch = (args.batch, args.seq)
    cfg = TrainConfig(data="-", out="-", shape=shape, tokenizer="-", steps=1000, warmup=10)
    optimizer = make_optimizer(cfg)
    params = init_params(model, 0, mesh)
    shardings = state_shardings(optimizer, model, mesh, jax.eval_shape(lambda p: p, params))
    rng = np.random.default_rng(0)
    host = rng.integers(0, model.vocab_size, batch).astype(np.int32)
    sharding = batch_sharding(batch, mesh)
    tokens = jax.make_array_from_callback(batch, sharding, lambda i: host[i])
    segments = jax.make_array_from_callback(batch, sharding, lambda i: np.ones(batch, np.int32)[i])
    flops_per_step = train_flops_per_token(model, args.seq) * args.batch * args.seq
    peak = peak_flops_per_device(dtype) * jax.device_count()
    n_tokens = args.batch * args.seq

    forward = jax.jit(partial(loss_sum, cfg=model, compute_dtype=dtype, remat="none"))
    base = timed(lambda: forward(params, tokens, segments), args.iters)
    rows = [("forward only (baseline)", base, flops_per_step / 3)]
    for remat in args.remat.split(","):
        state = init_state(params, optimizer, shardings)
        step = make_step(model, mesh, optimizer, shardings, compute_dtype=dtype, remat=remat, grad_accum=1,
                         batch_shape=batch, lr_at=learning_rate(cfg))
        box = [state]

        def run(step=step, box=box):
            box[0], metrics = step(box[0], tokens, segments)
            return metrics["loss"]

        rows.append((f"train step, remat {remat}", timed(run, args.iters), flops_per_step))

    print(f"model {args.preset}: {model.num_layers} layers, d={model.hidden_size}, vocab {model.vocab_size}; "
          f"batch {args.batch} x {args.seq}, {dtype}, mesh {describe(mesh)} on {jax.device_count()} x "
          f"{jax.devices()[0].device_kind}; peak {peak / 1e12:.2f} TFLOP/s")
    print(f"{'':28} {'median tok/s':>13} {'best tok/s':>11} {'x forward':>10} {'MFU (best)':>11}")
    base_rate = n_tokens / min(base)
    for name, times, flops in rows:
        best, median = min(times), statistics.median(times)
        print(f"{name:28} {n_tokens / median:13,.0f} {n_tokens / best:11,.0f} {n_tokens / best / base_rate:10.2f} "
              f"{flops / best / peak:11.1%}")
    load = open("/proc/loadavg").read().split()[0] if jax.default_backend() == "cpu" else "-"
    print(f"load average {load} (CPU timings are noisy on a shared machine)")


if __name__ == "__main__":
    main()
