"""The TRM tests' data and command: generated sudokus, a tiny TRM and the flags of `harvest train` for it."""

from __future__ import annotations

import json
from pathlib import Path

from extract_helpers import harvest_env

# A tiny TRM on 4x4 sudokus: 3 supervision steps at most (the carry lives across steps, halting explores), EMA on.
TINY = {"type": "trm", "preset": "trm-sudoku-mlp", "hidden": 16, "expansion": 2, "H_cycles": 2, "L_cycles": 1,
        "halt_max_steps": 3, "puzzle_emb_ndim": 16, "puzzle_emb_len": 1, "lr": 3e-3, "warmup": 2,
        "puzzle_emb_lr": 1e-2, "ema_rate": 0.9}
STEPS = 12


def train_args(data: str, out: str, model: dict = TINY, **more) -> list[str]:
    settings = {"batch_size": 16, "steps": STEPS, "checkpoint_every": 3, "log_every": 1, **more}
    return ["train", "--model", json.dumps(model), "--data", data, "--out", out,
            *(f"--{k.replace('_', '-')}={v}" for k, v in settings.items())]


def build_sudokus(out: Path, size: int, count: int, augment: int, test_size: int) -> str:
    from harvest.puzzles.build import build_puzzles
    from harvest.puzzles.config import PuzzlesConfig

    build_puzzles("sudoku", PuzzlesConfig(out=str(out), generate=count, size=size, augment=augment,
                                          test_size=test_size))
    return str(out)


def small_sudokus(root: Path) -> dict:
    """200 generated 4x4 sudokus (x3 with augmentations) and an env for harvest subprocesses (2 devices)
    sharing a compile cache."""
    env = {**harvest_env(root / "cache"), "JAX_COMPILATION_CACHE_DIR": str(root / "xla-cache")}
    return {"data": build_sudokus(root / "sudoku4", 4, 200, 2, 50), "env": env, "root": root}
