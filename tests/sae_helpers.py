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
