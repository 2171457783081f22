"""`harvest sae features`' device step against the SAE training step at the same shape, on this machine.

The features pass encodes each batch (sae/features/running.make_encode) and updates its running state on
device (make_update: counts, sums, max, top-K and the hash sample merged by lax.top_k, the histogram by a
scatter-add); the training step (sae/step.make_step) runs the TopK SAE's forward, backward and Adam. Both on
random rows of one batch shape, timed over --steps steps after one warm-up step, best of --rounds; the table
shows tokens x latents per second, and the pass's step split into its encoding and its update.

Run:  .venv/bin/python bench/features.py                      # 256 wide, 4096 latents, k 32, batch 4096
      .venv/bin/python bench/features.py --width 512 --latents 16384
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402


def timed(step, steps: int, rounds: int) -> float:
    """Best seconds per step (after a warm-up step that compiles)."""
    import jax

    jax.block_until_ready(step())
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(steps):
            out = step()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / steps)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--latents", type=int, default=4096)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--sample", type=int, default=20, help="bins x per_bin")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp

    from harvest.runtime.mesh import make_mesh
    from harvest.sae import model as M
    from harvest.sae import step as S
    from harvest.sae.features import running as R
    from harvest.sae.features.state import TensorState
    from table import show

    spec = M.Spec("topk", args.width, args.latents, args.k, args.width // 2)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((args.batch, args.width)).astype(np.float32))
    params = M.init_params(jax.random.key(0), spec, jnp.zeros(args.width))

    mesh = R.device_mesh()
    encode, update = R.make_encode(spec, mesh), R.make_update(spec, mesh)
    params = R.place(params, spec, mesh)
    running = [R.start(TensorState.empty(args.latents, args.top, args.sample), mesh)]
    valid = jnp.ones(args.batch, bool)
    offsets = jnp.arange(args.batch, dtype=jnp.int32)
    acts = encode(params, x)

    def features_step():
        running[0] = update(running[0], encode(params, x), valid, np.int32(0), offsets)
        return running[0]

    def update_only():
        running[0] = update(running[0], acts, valid, np.int32(0), offsets)
        return running[0]

    train_mesh = make_mesh("data=1")
    optimizers = {"t": S.make_optimizer(1e-3, 2, 100, "linear")}
    shape = jax.eval_shape(lambda: {"t": params})
    shardings = S.state_shardings({"t": spec}, optimizers, train_mesh, shape)
    state = [S.init_state({"t": params}, optimizers, {"t": spec}, shardings)]
    train = S.make_step({"t": spec}, optimizers, shardings, train_mesh, dead_tokens=10**7, scales={"t": 1.0},
                        compute_dtype="float32")

    def train_step():
        state[0], metrics = train(state[0], {"t": x})
        return metrics

    seconds = {"features pass step (encode + update)": timed(features_step, args.steps, args.rounds),
               "  its encoding (make_encode)": timed(lambda: encode(params, x), args.steps, args.rounds),
               "  its update (counts, top-K, sample, histogram)": timed(update_only, args.steps, args.rounds),
               "SAE training step (harvest sae train)": timed(train_step, args.steps, args.rounds)}
    train_rate = args.batch * args.latents / seconds["SAE training step (harvest sae train)"]
    rows = [[name, f"{s * 1e3:,.1f}", f"{args.batch / s:,.0f}", f"{args.batch * args.latents / s / 1e6:,.1f}",
             f"{args.batch * args.latents / s / train_rate:.2f}"] for name, s in seconds.items()]
    show(f"features pass vs SAE training step: TopK, width {args.width}, {args.latents:,} latents, k {args.k}, "
         f"batch {args.batch:,}, top {args.top}, sample {args.sample}",
         ["step", "ms/step", "tokens/s", "M tokens x latents/s", "vs training"], rows,
         f"CPU, {os.cpu_count()} cores, {jax.device_count()} device(s); best of {args.rounds} x {args.steps} steps; "
         f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
