"""Where `harvest extract`'s start goes: each start-up stage's seconds and the time from the process's own start
(the command, interpreter start-up included) to the first batch's forward, as one stable log line:

  start-up: 9.8 s to the first batch (imports 2.1, backend 1.0, tokenizer 0.3, weights 2.2, compile 4.0, rows 0.5)

Stages run side by side (the tokenizer and the compile in threads, beside the backend's start and the weights'
load), so their seconds add up to more than the total; the one that ends last before the first batch sets it.
  imports    from the process's start to the job's first line (interpreter, harvest, jax and their imports)
  backend    the backend's start: joining the other processes, the devices, the mesh
  tokenizer  loading the checkpoint's tokenizer
  weights    reading the weights onto the devices
  compile    compiling the forward (or loading it from the compile cache)
  rows       the feeder's first batch: reading, rendering, tokenizing and packing its rows
"""

from __future__ import annotations

import os
import threading
import time

STAGES = ("imports", "backend", "tokenizer", "weights", "compile", "rows")


def _process_age() -> float | None:
    """Seconds since this process started, from /proc (Linux), or None."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


_age = _process_age()
# The process's start on the monotonic clock: where /proc cannot say, when harvest's start-up clock was imported.
PROCESS_START = time.monotonic() - max(_age or 0.0, 0.0)


def since_start() -> float:
    return time.monotonic() - PROCESS_START


class Startup:
    """The stages' (start, end) in seconds from the process's start, recorded from any thread."""

    def __init__(self):
        self._lock = threading.Lock()
        self.spans: dict[str, tuple[float, float]] = {}
        self.first_batch: float | None = None

    def span(self, stage: str, start: float) -> None:
        """The stage ran from `start` until now (its first record stands)."""
        with self._lock:
            self.spans.setdefault(stage, (start, since_start()))

    def timed(self, stage: str, fn, *args, **kwargs):
        """fn(*args, **kwargs), its seconds recorded as `stage`."""
        start = since_start()
        try:
            return fn(*args, **kwargs)
        finally:
            self.span(stage, start)

    def batch_started(self) -> bool:
        """Record the first batch's dispatch; True the first time."""
        with self._lock:
            if self.first_batch is not None:
                return False
            self.first_batch = since_start()
            return True

    def line(self) -> str:
        with self._lock:
            spans = dict(self.spans)
            total = self.first_batch
        parts = ", ".join(f"{stage} {end - start:.1f}" for stage in STAGES if stage in spans
                          for start, end in [spans[stage]])
        if total is None:  # every stream was done already
            return f"start-up: no batch to run ({parts})"
        return f"start-up: {total:.1f} s to the first batch ({parts})"
