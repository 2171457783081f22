"""What the device check's stages share: how a stage's rows reach the check (JSON lines in the stage's log,
which survive a stage that dies later) and the random checkpoints the stages build."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROW = "CHIP-ROW "  # a stage's stdout lines that carry a table row (JSON)


def emit(*row: str) -> None:
    print(ROW + json.dumps(list(row)), flush=True)


def rows_in(log: Path) -> list[list[str]]:
    """The rows a stage emitted, from its log."""
    return [json.loads(line[len(ROW):]) for line in log.read_text(errors="replace").splitlines()
            if line.startswith(ROW)]


def hf_model_args(smoke: bool, small: bool) -> argparse.Namespace:
    """bench/workloads.build_model's fields: tiny, a small realistic one (head size 64, GQA) or the 0.5B shape."""
    from workloads import model_fields

    if smoke:
        dims = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, layers=3)
    elif small:
        dims = dict(hidden=256, intermediate=512, heads=4, kv_heads=2, layers=4)
    else:
        dims = dict(hidden=896, intermediate=4864, heads=14, kv_heads=2, layers=24)
    return model_fields([(16, 2048)], **dims)
