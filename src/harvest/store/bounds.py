"""What bounds an extraction, from where its stages wait: so that a user sees what to change.

The pipeline's stages hand work along bounded queues (harvest.extract.pipeline), so the slowest sets the pace
and the others wait on it. The waits are timed where they happen:
  feeder   the forward loop waits for a batch: reading, tokenizing and packing are behind;
  chip     the host stage waits for a capture or for its values: the forward (or the feeder before it);
  storage  the host stage waits for the Committer to take a shard: the writes are behind.
The host stage's own work (copies to numpy, cutting shards) is the time its thread spends in none of its waits.
The forward is dispatched asynchronously, so the forward loop also waits to hand captures on when the chip
binds (their values are not computed yet): which side binds is told by the host thread's split, not by that.
Each stage's share is of the window from the first wait that ends with its item (the forward's first batch,
after the compile and the first rows, which the start-up line reports) to the last wait's end (or now, live);
the stage with the largest share binds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from typing import Callable, Iterator

TIMED = ("feeder", "chip", "storage")  # the waits timed; "host" is the host thread's time outside its waits
ADVICE = {
    "chip": "the forward sets the pace, as it should: more or faster chips, or fewer layers run (--points)",
    "host": "the host stage (copies to numpy, cutting shards) sets the pace: more host cores per chip, fewer "
            "bytes per token (--dtype float8_e4m3fn or int8 where it stores 16 or 32 bits), fewer capture points",
    "storage": "storage sets the pace: fewer bytes per token (--dtype float8_e4m3fn or int8 where it stores 16 or "
               "32 bits), larger shards (--shard-size), a faster disk or a bucket in the chips' region",
    "feeder": "reading and tokenizing set the pace: pre-tokenized streams (harvest streams create), a closer "
              "or faster source, longer records per row",
}
# Data slots with no stream to take compute padding rows: a waste no stage's share shows (the chip looks busy).
IDLE_SLOTS_ADVICE = ("split the data into at least as many streams as the mesh has data slots (harvest streams "
                     "create --num-streams N), or give --mesh fewer data slots (data x fsdp)")


@dataclasses.dataclass(frozen=True)
class Shares:
    """Each stage's share of the window (they add up to 1), and the window's length in seconds."""

    window_s: float
    chip: float
    host: float
    storage: float
    feeder: float

    @property
    def bound(self) -> str:
        """The stage that binds ("" before the window opens)."""
        if self.window_s <= 0:
            return ""
        return max(ADVICE, key=lambda stage: getattr(self, stage))

    @property
    def bound_share(self) -> float:
        return getattr(self, self.bound) if self.bound else 0.0

    def line(self) -> str:
        """One line for the summary: the bound, every share, and what to change."""
        if not self.bound:
            return "bound: not measured (no batch went through the forward)"
        split = ", ".join(f"{stage} {getattr(self, stage):.0%}" for stage in ADVICE)
        return f"bound: {self.bound} ({split} of {self.window_s:.1f} s): {ADVICE[self.bound]}"


class Waits:
    """Seconds each stage waited, from the threads that wait (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(TIMED, 0.0)
        self._opened: float | None = None
        self._last: float | None = None

    @contextlib.contextmanager
    def on(self, stage: str) -> Iterator[None]:
        """Time the block as a wait of `stage`; one that ends with its item (no exception) opens the window."""
        if stage not in self._seconds:
            raise ValueError(f"unknown stage {stage!r}: one of {', '.join(TIMED)}")
        start = self._clock()
        done = False
        try:
            yield
            done = True
        finally:
            self._add(stage, start, self._clock(), done)

    def queue(self, stage: str, maxsize: int) -> TimedQueue:
        """A queue whose every get is timed as a wait of `stage` (its consumer waits on that stage)."""
        return TimedQueue(self, stage, maxsize)

    def _add(self, stage: str, start: float, end: float, done: bool) -> None:
        with self._lock:
            if self._opened is None:
                if done:
                    self._opened = self._last = end
                return
            self._seconds[stage] += end - max(start, self._opened)
            self._last = max(self._last or end, end)

    def shares(self, live: bool = False) -> Shares:
        """The stages' shares of the window, to the last wait's end (or, `live`, to now)."""
        with self._lock:
            if self._opened is None:
                return Shares(0.0, 0.0, 0.0, 0.0, 0.0)
            end = self._clock() if live else self._last or self._opened
            feeder, chip, storage = (self._seconds[stage] for stage in TIMED)
            window = max(end - self._opened, chip + storage, 1e-9)
        fed = min(feeder, chip)  # the host waited on the feeder through the forward loop
        return Shares(window_s=window, chip=(chip - fed) / window,
                      host=(window - chip - storage) / window, storage=storage / window, feeder=fed / window)


class TimedQueue(queue.Queue):
    """queue.Queue whose gets are timed as a stage's waits (Waits.queue)."""

    def __init__(self, waits: Waits, stage: str, maxsize: int):
        super().__init__(maxsize=maxsize)
        self._waits, self._stage = waits, stage

    def get(self, block: bool = True, timeout: float | None = None):
        with self._waits.on(self._stage):
            return super().get(block, timeout)
