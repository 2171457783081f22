"""A child process under a time limit whose log says where it stood when it was stopped (bench/chip.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path


def run_limited(cmd: list[str], limit: float, log: Path, env: dict | None = None,
                group: bool = False) -> tuple[str, float]:
    """Run `cmd` with its output in `log` under `limit` seconds: ("0" or the exit code, or "stalled"), seconds.

    faulthandler is on in the child, so the SIGABRT it gets at the limit writes every thread's stack to the log.
    With `group` the child leads a new process group (a stage: what it starts stays in that group), and a stalled
    one's whole group is killed once its stacks are written (or 15 s after the SIGABRT)."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=group,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1", **(env or {})})
        try:
            code = str(proc.wait(limit))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
            if group:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
            code = "stalled"
    return code, time.perf_counter() - start


def failure(code: str, limit: float, log: Path) -> str:
    """A failed run's table cell: where its stacks are, or its exit code and last line."""
    if code == "stalled":
        return f"stalled at its {limit:.0f} s limit: every thread's stack is in {log}"
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
    return f"exit {code} ({log}): {tail[0][:160] if tail else 'no output'}"
