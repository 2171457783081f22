"""SAE training: `harvest sae train` against sparsify's own trainer on the same activations, one run.

The activations: a harvest run of synthetic rows (sparse combinations of a random dictionary plus noise,
so that an SAE has something to find), --width wide, written shard by shard as harvest writes them. Both
trainers then train a TopK SAE of --expansion x width latents, k --k, --batch rows a step, Adam (lr, warmup
2, linear decay), AuxK off, for --steps steps: harvest through `run_sae_train` (its reader, its jitted step,
checkpoints at the end), sparsify through `sparsify.Trainer` on the same rows in harvest's order. Both
rates leave out the first SKIP steps and cover the same steps after them (harvest: its metrics' intervals,
the reader included; sparsify: the time of each step's forward, to the end of fit); the two alternate for
--rounds rounds and the table shows each one's best. The FVU is each SAE's on all the run's tokens.

Run:  .venv/bin/python bench/sae.py               # 256 wide, 4096 latents, 2 rounds: ~4 minutes on 2 CPU cores
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import numpy as np  # noqa: E402

TENSOR = "resid_post.6"
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
        x = np.einsum("nk,nkd->nd", weights, atoms[picks]) + 0.1 * rng.standard_normal((n, width))
        return x.astype(ml_dtypes.bfloat16)

    writer.rng = type("Rng", (), {"normal": staticmethod(lambda size: activations(size[0])),
                                  "choice": rng.choice})()
    per_shard = 32768
    for k in range(max(tokens // per_shard, 2)):
        writer.shard(k % 2, [per_shard // 64] * 64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--expansion", type=int, default=16)
    parser.add_argument("--k", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--rounds", type=int, default=2, help="harvest then sparsify, this many times; best of each")
    args = parser.parse_args()

    from sae_reference import sparsify_fvu_and_dead, train_sparsify

    from harvest.read.run import open_run
    from harvest.sae import model as M
    from harvest.sae.config import SaeConfig
    from harvest.sae.export import load_sae_run, spec_of
    from harvest.training.run import train as run_sae_train

    root = Path(tempfile.mkdtemp(prefix="bench-sae-"))
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
