"""The SAE tests' run: `harvest extract` of the demo model (the run SAEs train on) and the flags of a small
`harvest sae train` on it."""

from __future__ import annotations

from pathlib import Path

from extract_helpers import text_streams

TENSOR = "resid_post.1"
# 64 rows a step over 8 or 2 devices, 256 latents on the 64-wide demo model, k 8.
BASE = {"tensors": TENSOR, "expansion": 4, "k": 8, "batch_tokens": 64, "warmup": 2, "lr": 3e-3,
        "checkpoint_every": 3, "log_every": 1, "holdout_streams": 1}
STEPS = 12


def flags(settings: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]


def extracted_source(root: Path) -> dict:
    """One run made by `harvest extract` (demo model, 300 texts in 4 streams, resid_post at layers 1-2,
    float32), its checkpoint, and an env for harvest subprocesses (2 devices) sharing a compile cache."""
    from harvest.config import ExtractConfig
    from harvest.extract.job import run_extract

    checkpoint, env, streams = text_streams(root, 4, n=300)
    out = root / "run"
    run_extract(ExtractConfig(model=str(checkpoint), data=str(streams), out=str(out), points="resid_post:1-2",
                              dtype="float32", max_seq_len=128, batch_size=4, shard_size="64KB").validate())
    env = {**env, "JAX_COMPILATION_CACHE_DIR": str(root / "xla-cache")}
    return {"run": str(out), "checkpoint": checkpoint, "env": env, "root": root}


def train_args(source: dict, out: str, **more) -> list[str]:
    """`harvest sae train` on the source run, STEPS steps of BASE, `more` settings on top."""
    return ["sae", "train", "--run", source["run"], "--out", out,
            *flags({**BASE, "tokens": 64 * STEPS, **more})]


def against_sparsify(source: dict, out: str, steps: int) -> dict[str, float]:
    """The TopK SAE at `out` (trained on BASE's settings for `steps` steps, AuxK off) and sparsify's trainer on the
    same rows in the same order: each one's FVU and dead latents (never firing) on all the run's tokens."""
    import numpy as np
    from sae_reference import sparsify_fvu_and_dead, train_sparsify

    from harvest.read.run import open_run
    from harvest.sae import model as M
    from harvest.sae.export import load_sae_run, spec_of

    run = open_run(source["run"])
    everything = np.concatenate([b[TENSOR] for b in run.token_batches(4096, [TENSOR], dtype="float32")])
    ordered = np.concatenate([b[TENSOR] for _, b in zip(range(steps), run.token_batches(
        BASE["batch_tokens"], [TENSOR], dtype="float32", seed=0, epochs=None, drop_last=True))])
    coder = train_sparsify(ordered, latents=BASE["expansion"] * run.tensors[TENSOR], k=BASE["k"],
                           batch=BASE["batch_tokens"], lr=BASE["lr"], warmup=BASE["warmup"])
    theirs_fvu, theirs_dead = sparsify_fvu_and_dead(coder, everything)
    info, _, params = load_sae_run(out)
    latents, recon = (np.asarray(a) for a in M.infer(params[TENSOR], everything, spec_of(info["saes"][TENSOR])))
    return {"ours_fvu": float(np.sum((everything - recon) ** 2) / np.sum((everything - everything.mean(0)) ** 2)),
            "ours_dead": int(np.sum(~(latents > 0).any(0))), "theirs_fvu": theirs_fvu, "theirs_dead": theirs_dead}
