"""`harvest puzzles build sudoku|maze|arc --out URL`: the build and its summary line.

Everything a build could refuse (kind, flags, an existing dataset) is checked before anything is read or
written; a build is made in memory and written by harvest.puzzles.format (arrays first, marker last).
"""

from __future__ import annotations

import dataclasses
import time

from harvest.puzzles.common import Skips
from harvest.puzzles.config import OWN, PuzzlesConfig, builder
from harvest.puzzles.format import DatasetInfo, check_absent, write_dataset


def build_puzzles(kind: str, config: PuzzlesConfig) -> dict:
    """Build and commit the dataset; the summary as a dict (see summary_line)."""
    start = time.monotonic()
    config.check(kind)
    check_absent(config.out, config.overwrite)
    skips = Skips()
    built = builder(kind).build(config, skips)
    settings = {"kind": kind, **{k: v for k, v in dataclasses.asdict(config).items() if k in OWN[kind] | {"seed"}}}
    info = write_dataset(config.out, built, settings=settings, skipped=dict(sorted(skips.counts.items())),
                         skipped_examples=skips.examples, overwrite=config.overwrite)
    return {"url": config.out, "info": info, "skipped": skips.total, "seconds": time.monotonic() - start}


def summary_line(summary: dict) -> str:
    info: DatasetInfo = summary["info"]
    splits = ", ".join(f"{name} {s['groups']} groups / {s['puzzles']} puzzles / {s['examples']} examples"
                       for name, s in info.splits.items())
    skipped = "; ".join(f"{count} {reason}" for reason, count in info.skipped.items())
    return (f"wrote {info.kind} puzzles to {summary['url']}: {splits}; seq_len {info.seq_len}, "
            f"vocab {info.vocab_size}, {info.num_puzzle_identifiers} identifiers; skipped {summary['skipped']}"
            f"{' (' + skipped + ')' if skipped else ''}; {summary['seconds']:.1f}s")
