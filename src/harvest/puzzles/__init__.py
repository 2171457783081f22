"""TRM's datasets (Sudoku, maze, ARC), built once into storage by `harvest puzzles build` and read by every
host. format.py: the layout, the commit marker and the reader (`open_puzzles(URL)`, what the trainer and
the evaluator use); one module per kind (sudoku.py with sudoku_gen.py, maze.py, arc.py); common.py: what
they share; config.py and build.py: the command. Nothing is imported here, so the CLI's parser stays light."""
