"""TRM's datasets (Sudoku, maze, ARC), built once into storage by `harvest puzzles build` and read by every
host: format.py (the layout, the commit marker and the reader), one module per kind, build.py (the command)."""

from harvest.puzzles.format import DatasetError, DatasetInfo, PuzzleDataset, open_puzzles

__all__ = ["DatasetError", "DatasetInfo", "PuzzleDataset", "open_puzzles"]
