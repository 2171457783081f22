"""bench/chip.py, the device check: its --smoke mode runs every stage's code path on CPU (parity with HF,
forward and train per kernel, whole-process extraction against the HF script) and prints one table with a row
per case; a process that stalls is stopped at its limit with every thread's stack in its log."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
import limited  # noqa: E402


def table_rows(text: str) -> list[list[str]]:
    """The rich table's rows, cells joined across wrapped lines."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        if not line.startswith("│"):
            continue
        cells = [c.strip() for c in line.strip().strip("│").split("│")]
        if cells[0] or not rows:
            rows.append(cells)
        else:
            rows[-1] = [f"{a} {b}".strip() for a, b in zip(rows[-1], cells)]
    return rows


@pytest.mark.slow
def test_smoke_check_prints_a_row_per_case(tmp_path):
    """Over 30 s: the start-ups of the eight processes a smoke check runs (four stages, three `harvest extract`, the
    HF script), as on a chip."""
    env = {**os.environ, "COLUMNS": "400", "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    done = subprocess.run([sys.executable, str(BENCH / "chip.py"), "--smoke", "--logs", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = table_rows(done.stdout)
    assert not [r for r in rows if "FAILED" in r[2]], rows
    cases = {(r[0], r[1]) for r in rows}
    for dtype, kind in (("float32", "dense"), ("bfloat16", "auto")):
        result = next(r[2] for r in rows if r[:2] == ["parity", f"{dtype} {kind}"])
        assert result.endswith("(ok)"), result
    assert {("forward small", "2x128 dense"), ("forward small", "2x128 blocks"),
            ("train small", "2x128 dense, forward only"), ("train small", "2x128 dense, train step, remat layer"),
            ("forward-7b", "-"), ("extract", "harvest extract --attention auto"),
            ("extract", "HF script (float32, sdpa)"), ("extract", "harvest pipeline"),
            ("extract", "harvest / HF script")} <= cases, cases
    assert all("tokens/s" in r[2] for r in rows if r[0].startswith(("forward small", "train")))
    assert "% of the forward alone (2x128 blocks" in next(r[3] for r in rows if r[1] == "harvest pipeline")


def test_a_stalled_process_is_stopped_with_every_threads_stack(tmp_path):
    script = ("import threading, time\n"
              "threading.Thread(target=lambda: time.sleep(60), name='worker', daemon=True).start()\n"
              "print('started', flush=True)\n"
              "time.sleep(60)\n")
    log = tmp_path / "stall.log"
    code, seconds = limited.run_limited([sys.executable, "-c", script], 3, log, group=True)
    assert code == "stalled" and seconds < 30
    text = log.read_text()
    assert "started" in text and text.count("most recent call first") >= 2, text
    assert "stalled at its 3 s limit" in limited.failure(code, 3, log)
