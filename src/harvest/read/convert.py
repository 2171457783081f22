"""A gathered batch on its way out: normalized by the run's own stats, handed as numpy or torch (without a copy);
and which DataLoader worker is reading, where torch runs the reader."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from harvest.errors import UserError
from harvest.store.stats import RunningStats

NORMALIZE = (None, "standardize", "norm")


def normalization(stats: RunningStats, how: str, name: str, url: str) -> tuple[np.ndarray, np.ndarray]:
    """(shift, scale) with out = (x - shift) * scale, from a tensor's merged stats ("standardize": per dimension,
    "norm": E||x||^2 = d)."""
    if stats.count == 0:
        raise UserError(f"{url}: normalize={how!r} needs statistics, and {name} has no token yet")
    if how == "standardize":
        return stats.mean.astype(np.float32), (1 / np.sqrt(np.maximum(stats.var, 1e-12))).astype(np.float32)
    mean_sq_norm = float(np.sum(stats.m2 / stats.count + stats.mean**2))  # E ||x||^2 over the run
    scale = np.sqrt(len(stats.mean) / max(mean_sq_norm, 1e-12))
    return np.zeros(len(stats.mean), np.float32), np.full(len(stats.mean), scale, np.float32)


def torch_converter() -> Callable[[np.ndarray], Any]:
    """numpy -> torch without a copy (bf16 through its bits)."""
    try:
        import torch
    except ImportError:
        raise UserError("token_batches(as_torch=True) needs torch: pip install torch") from None

    def convert(arr: np.ndarray):
        arr = np.ascontiguousarray(arr)
        if arr.dtype == np.dtype(ml_dtypes.bfloat16):
            return torch.from_numpy(arr.view(np.uint16)).view(torch.bfloat16)
        return torch.from_numpy(arr)

    return convert


def torch_worker() -> tuple[int, int]:
    """(worker id, number of workers) inside a torch DataLoader worker, else (0, 1)."""
    torch = sys.modules.get("torch")
    info = torch.utils.data.get_worker_info() if torch is not None else None
    return (0, 1) if info is None else (int(info.id), int(info.num_workers))
