"""SAE training: `harvest sae train` against sparsify's own trainer on the same activations, one run.

The activations: a harvest run of synthetic rows (sparse combinations of a random dictionary plus noise,
so that an SAE has something to find), --width wide, written shard by shard as harvest writes them. Both
trainers then train a TopK SAE of --expansion x width latents, k --k, --batch rows a step, Adam (lr, warmup
2, linear decay), AuxK off, for --steps steps: harvest through `run_sae_train` (its reader, its jitted step,
checkpoints at the end), sparsify through `sparsify.Trainer` on the same rows in harvest's order. Both
rates leave out the first SKIP steps and cover the same steps after them (harvest: its metrics' intervals,
the reader included; sparsify: the time of each step's forward, to the end of fit); the two alternate for
--rounds rounds and the table shows each one's best. The FVU is each SAE's on all the run's tokens.

First, where a step's time goes (`parts`), at the bench's shape and the real one (Qwen2.5-0.5B's residual): the
reader's batch, encode, top-k, decode, the forward with its loss, the backward, the optimizer, the host sync,
each a separately jitted function timed alone. Parts fused in one step can cost less than alone.

Run:  .venv/bin/python bench/sae.py               # 256 wide, 4096 latents, 2 rounds: ~5 minutes on 2 CPU cores
      .venv/bin/python bench/sae.py --parts-only  # the per-part table alone: ~1 minute
      .venv/bin/python bench/sae.py --parts none --scaling --parts-only  # the scaling rows alone: ~2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import numpy as np  # noqa: E402

TENSOR = "resid_post.6"
REAL = (896, 16, 64)  # Qwen2.5-0.5B's residual: width, expansion, k
SKIP = 5  # steps of warm-up (compilation, first allocations) left out of both trainers' tokens/s


def write_run(url: str, width: int, tokens: int, seed: int = 0) -> None:
    """Synthetic activations as a harvest run (reader_helpers.RunWriter writes shards as harvest does)."""
    import ml_dtypes
    from reader_helpers import RunWriter

    rng = np.random.default_rng(seed)
    atoms = rng.standard_normal((width * 8, width)).astype(np.float32)
    atoms /= np.linalg.norm(atoms, axis=1, keepdims=True)
    writer = RunWriter(url, tensors={TENSOR: width}, streams=2, seed=seed, special=False)

    def activations(n: int) -> np.ndarray:
        picks = rng.integers(0, len(atoms), (n, 16))
        weights = rng.exponential(1.0, (n, 16)).astype(np.float32)
        x = 0.1 * rng.standard_normal((n, width))
        for at in range(0, n, 4096):  # [4096, 16, width] at a time
            x[at:at + 4096] += np.einsum("nk,nkd->nd", weights[at:at + 4096], atoms[picks[at:at + 4096]])
        return x.astype(ml_dtypes.bfloat16)

    writer.rng = type("Rng", (), {"normal": staticmethod(lambda size: activations(size[0])),
                                  "choice": rng.choice})()
    per_shard = 32768
    for k in range(max(tokens // per_shard, 2)):
        writer.shard(k % 2, [per_shard // 64] * 64)


def best_ms(fn, *args, reps: int) -> float:
    """The best of `reps` timed calls of jitted `fn` (after one to compile), in ms."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)


def stepper(spec, params: dict, optimizer, mesh):
    """{TENSOR: rows} -> (state, metrics): sae/step.make_step on `mesh`, its state (donated) kept between calls."""
    import jax

    from harvest.sae.step import init_state, make_step, state_shardings

    optimizers = {TENSOR: optimizer}
    shardings = state_shardings({TENSOR: spec}, optimizers, mesh, {TENSOR: jax.eval_shape(lambda: params)})
    step = make_step({TENSOR: spec}, optimizers, shardings, mesh, dead_tokens=10**7, scales={TENSOR: 1.0},
                     compute_dtype="float32")
    state = [init_state({TENSOR: params}, optimizers, {TENSOR: spec}, shardings)]

    def one(batch):
        state[0], metrics = step(state[0], batch)
        return state[0], metrics

    return one


def parts(url: str, width: int, latents: int, k: int, batch: int, lr: float, reps: int) -> dict[str, float]:
    """ms of each part of a TopK training step on the run at `url`: each part a jitted function timed alone (best of
    `reps`), then the whole step (sae/step.make_step, state donated), the metrics' copy to the host, and the reader's
    batch (sae/data.next_batch over the run)."""
    import jax
    import jax.numpy as jnp
    import optax

    from harvest.runtime.mesh import make_mesh
    from harvest.sae import cpu_kernels
    from harvest.sae import data as D
    from harvest.sae import model as M
    from harvest.sae.step import make_optimizer

    spec = M.Spec("topk", width, latents, k, width // 2)
    mesh = make_mesh("1d")
    inputs = D.open_inputs((url,), (TENSOR,), 0, 0)
    readers = D.readers(inputs, [TENSOR], batch, mesh, 0)
    batches = [D.next_batch(readers, [TENSOR]) for _ in range(2)]
    x = batches[0][TENSOR]
    params = jax.jit(lambda x: M.init_params(jax.random.key(0), spec, jnp.mean(x, 0)))(x)
    dead = jnp.zeros(latents, bool)
    kernels = mesh if cpu_kernels.usable(mesh, "float32") else None
    centred = x - params["b_dec"]
    pre = jax.jit(lambda c, w: c @ w)(centred, params["W_enc"])
    if kernels is not None:
        top_k = jax.jit(lambda a, b: cpu_kernels.top_k_relu(a, b, k))
        values, indices = top_k(pre, params["b_enc"])
        out = {"encode ([B, d] @ [d, L])": best_ms(jax.jit(lambda c, w: c @ w), centred, params["W_enc"], reps=reps),
               "top-k (kernel, ReLU + bias in it)": best_ms(top_k, pre, params["b_enc"], reps=reps),
               "encode + top-k (in blocks of rows)": best_ms(jax.jit(lambda c, p: cpu_kernels.encode_blocks(
                   c, p["W_enc"], p["b_enc"], k)), centred, params, reps=reps),
               "decode (k rows gathered and added)": best_ms(jax.jit(cpu_kernels.gather_sum), params["W_dec"],
                                                             indices, values, reps=reps)}
    else:
        top_k = jax.jit(lambda a, b: jax.lax.top_k(jax.nn.relu(a + b), k))
        values, indices = top_k(pre, params["b_enc"])
        out = {"encode ([B, d] @ [d, L])": best_ms(jax.jit(lambda c, w: c @ w), centred, params["W_enc"], reps=reps),
               "top-k (lax.top_k, ReLU + bias)": best_ms(top_k, pre, params["b_enc"], reps=reps),
               "decode (k rows gathered)": best_ms(jax.jit(M.decode_sparse), params, values, indices, reps=reps)}
    out["forward and loss"] = best_ms(jax.jit(lambda p, x: M.loss(p, x, spec, dead, None, kernels)), params, x,
                                      reps=reps)
    out["forward and backward"] = best_ms(jax.jit(jax.value_and_grad(
        lambda p, x: M.loss(p, x, spec, dead, None, kernels), has_aux=True)), params, x, reps=reps)
    _, backward = jax.vjp(lambda p: M.loss(p, x, spec, dead, None, kernels)[0], params)
    out["backward (the vjp alone, its residuals kept)"] = best_ms(jax.jit(lambda b, t: b(t)), backward,
                                                                   jnp.ones((), jnp.float32), reps=reps)
    optimizer = make_optimizer(lr, 2, 10**6, "linear")
    grads = jax.jit(jax.grad(lambda p, x: M.loss(p, x, spec, dead, None, kernels)[0]))(params, x)

    def update(g, s, p):
        updates, s = optimizer.update(g, s, p)
        p = optax.apply_updates(p, updates)
        return {**p, "W_dec": M.unit_rows(p["W_dec"])}, s

    out["optimizer (Adam, unit decoder rows)"] = best_ms(jax.jit(update), grads, optimizer.init(params), params,
                                                         reps=reps)
    one = stepper(spec, params, optimizer, mesh)
    out["whole step (sae/step.make_step)"] = best_ms(one, batches[1], reps=reps)
    reader_ms = []
    for _ in range(reps):  # last: the reader's threads read ahead after each batch, and would slow the parts timed
        start = time.perf_counter()
        jax.block_until_ready(D.next_batch(readers, [TENSOR]))
        reader_ms.append(1e3 * (time.perf_counter() - start))
    out["reader batch (sae/data.next_batch)"] = min(reader_ms)
    _, metrics = jax.block_until_ready(one(batches[1]))
    start = time.perf_counter()
    jax.device_get(metrics)
    out["metrics to the host (the trainer: at log lines only)"] = 1e3 * (time.perf_counter() - start)
    return out


def scaling_one(devices: int, axis: str, width: int, latents: int, k: int, batch: int, reps: int) -> dict:
    """ms of the whole step (sae/step.make_step) on `devices` CPU devices, the batch over `data` or the latents over
    `model`, and of its top-k alone: the kernel's on each device's rows, or sae/topk's two stages over the latents."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from harvest.runtime.mesh import make_mesh
    from harvest.sae import cpu_kernels
    from harvest.sae import model as M
    from harvest.sae.step import batch_sharding, make_optimizer
    from harvest.sae.topk import DATA_AXES, top_k

    mesh = make_mesh(f"{axis}={devices}")
    spec = M.Spec("topk", width, latents, k, width // 2)
    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((batch, width)).astype(np.float32), batch_sharding(mesh))
    params = jax.jit(lambda x: M.init_params(jax.random.key(0), spec, jnp.mean(x, 0)))(x)
    one = stepper(spec, params, make_optimizer(1e-3, 2, 10**6, "linear"), mesh)

    pre = jax.device_put(rng.random((batch, latents), np.float32),
                         NamedSharding(mesh, PartitionSpec(DATA_AXES, "model" if axis == "model" else None)))
    if axis == "data" and cpu_kernels.usable(mesh, "float32"):
        rows = PartitionSpec(DATA_AXES)
        select = jax.jit(jax.shard_map(lambda a: cpu_kernels.top_k_relu(a, jnp.zeros(latents), k), mesh=mesh,
                                       in_specs=rows, out_specs=(rows, rows), check_vma=False))
    else:
        select = jax.jit(lambda a: top_k(a, k, mesh))
    return {"step_ms": best_ms(one, {TENSOR: x}, reps=reps), "top_k_ms": best_ms(select, pre, reps=reps)}


def scaling(width: int, latents: int, k: int, batch: int, reps: int) -> None:
    """The scaling rows: scaling_one in a process of its own for each device count and axis."""
    import subprocess

    print(f"\nThe same TopK step on 1-8 CPU devices ({os.cpu_count()} cores), {width} wide, {latents} latents, k {k}, "
          f"batch {batch}; best of {reps}")
    print(f"{'devices':>8}{'mesh':>10}{'ms/step':>10}{'tokens/s':>11}{'per device':>12}{'top-k ms':>10}")
    for devices in (1, 2, 4, 8):
        for axis in ("data", "model") if devices > 1 else ("data",):
            env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
            done = subprocess.run([sys.executable, __file__, "--scaling-one", f"{axis}={devices}", "--width",
                                   str(width), "--expansion", str(latents // width), "--k", str(k), "--batch",
                                   str(batch), "--parts-reps", str(reps)], env=env, capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(done.stderr[-3000:])
            row = json.loads(done.stdout.strip().splitlines()[-1])
            rate = batch / row["step_ms"] * 1e3
            print(f"{devices:>8}{f'{axis}={devices}':>10}{row['step_ms']:>10.1f}{rate:>11,.0f}{rate / devices:>12,.0f}"
                  f"{row['top_k_ms']:>10.1f}")
    print(f"load average: {os.getloadavg()[0]:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--expansion", type=int, default=16)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rounds", type=int, default=2, help="harvest then sparsify, this many times; best of each")
    parser.add_argument("--parts", choices=("both", "bench", "none"), default="both",
                        help="the per-part table: at the bench's shape and the real one (896 wide, 16x, k 64), "
                             "at the bench's alone, or none")
    parser.add_argument("--parts-reps", type=int, default=3, help="timed calls per part (best of them)")
    parser.add_argument("--parts-only", action="store_true", help="the per-part table alone, no trainers compared")
    parser.add_argument("--scaling", action="store_true", help="then the scaling rows: the step on 1, 2, 4 and 8 "
                        "CPU devices, the batch over data or the latents over model (~2 minutes)")
    parser.add_argument("--scaling-one", help=argparse.SUPPRESS)  # AXIS=N: one scaling row, in its own process
    args = parser.parse_args()
    if args.scaling_one:
        axis, devices = args.scaling_one.split("=")
        print(json.dumps(scaling_one(int(devices), axis, args.width, args.width * args.expansion, args.k, args.batch,
                                     args.parts_reps)))
        return
    root = Path(tempfile.mkdtemp(prefix="bench-sae-"))
    if args.parts != "none":
        shapes = [(args.width, args.expansion, args.k)] + ([REAL] if args.parts == "both" else [])
        table = {}
        for width, expansion, k in shapes:
            url = str(root / f"parts-{width}")
            write_run(url, width, args.batch * (2 * args.parts_reps + 2))
            table[(width, expansion, k)] = parts(url, width, width * expansion, k, args.batch, args.lr,
                                                 args.parts_reps)
        print(f"\nms per TopK step, batch {args.batch} tokens, each part jitted and timed alone (best of "
              f"{args.parts_reps}); CPU, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
        print(f"{'part':<54}" + "".join(f"{f'{w} wide, {w * e} latents, k {k}':>32}" for w, e, k in table))
        for name in next(iter(table.values())):
            print(f"{name:<54}" + "".join(f"{t[name]:>32.1f}" for t in table.values()))
    if args.scaling:
        scaling(args.width, args.width * args.expansion, args.k, args.batch, args.parts_reps)
    if args.parts_only:
        return

    from sae_reference import sparsify_fvu_and_dead, train_sparsify

    from harvest.read.run import open_run
    from harvest.sae import model as M
    from harvest.sae.config import SaeConfig
    from harvest.sae.export import load_sae_run, spec_of
    from harvest.training.run import train as run_sae_train

    tokens = args.batch * args.steps
    write_run(str(root / "run"), args.width, tokens)
    latents = args.width * args.expansion

    run = open_run(str(root / "run"))
    rows = np.concatenate([b[TENSOR] for _, b in zip(range(args.steps), run.token_batches(
        args.batch, [TENSOR], dtype="float32", seed=0, epochs=None, drop_last=True))])
    rates: dict[str, list[float]] = {"harvest": [], "sparsify": []}
    for round_ in range(args.rounds):
        out = str(root / f"harvest-{round_}")
        run_sae_train(SaeConfig(run=str(root / "run"), tensors=TENSOR, out=out, expansion=args.expansion, k=args.k,
                                batch_tokens=args.batch, tokens=tokens, lr=args.lr, warmup=2, log_every=SKIP,
                                checkpoint_every=10**6).validate())
        records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
        seconds = sum((r["step"] - p["step"]) * args.batch / r["tokens_per_s"] for p, r in zip(records, records[1:]))
        rates["harvest"].append((records[-1]["step"] - records[0]["step"]) * args.batch / seconds)
        clock: list[float] = []
        coder = train_sparsify(rows, latents=latents, k=args.k, batch=args.batch, lr=args.lr, warmup=2, clock=clock)
        starts = clock[-(args.steps + 1):]  # each step's start, then the end
        rates["sparsify"].append((args.steps - SKIP) * args.batch / (starts[-1] - starts[SKIP]))
    harvest_rate, sparsify_rate = max(rates["harvest"]), max(rates["sparsify"])

    everything = np.concatenate([b[TENSOR] for b in run.token_batches(65536, [TENSOR], dtype="float32")])
    theirs_fvu, theirs_dead = sparsify_fvu_and_dead(coder, everything)
    info, _, params = load_sae_run(out)
    lat, recon = (np.asarray(a) for a in M.infer(params[TENSOR], everything, spec_of(info["saes"][TENSOR])))
    ours_fvu = float(np.sum((everything - recon) ** 2) / np.sum((everything - everything.mean(0)) ** 2))
    ours_dead = int(np.sum(~(lat > 0).any(0)))

    print(f"\nTopK SAE: width {args.width}, {latents} latents, k {args.k}, batch {args.batch} tokens, "
          f"{args.steps} steps ({tokens:,} tokens), Adam lr {args.lr}, AuxK off; CPU, {os.cpu_count()} cores")
    print(f"tokens/s per round: harvest {', '.join(f'{r:,.0f}' for r in rates['harvest'])}; "
          f"sparsify {', '.join(f'{r:,.0f}' for r in rates['sparsify'])}")
    print(f"{'trainer':<22}{'tokens/s':>12}{'ratio':>8}{'FVU':>9}{'dead':>7}")
    print(f"{'harvest sae train':<22}{harvest_rate:>12,.0f}{harvest_rate / sparsify_rate:>8.2f}{ours_fvu:>9.4f}"
          f"{ours_dead:>7}")
    print(f"{'sparsify Trainer':<22}{sparsify_rate:>12,.0f}{1.0:>8.2f}{theirs_fvu:>9.4f}{theirs_dead:>7}")
    print(f"load average: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
