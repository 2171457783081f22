"""The clocks that harvest's protocols read, behind one object so that a simulation can run the real lease,
commit and retry code on simulated time (tests/store/test_simulation.py).

`monotonic()` measures every duration a decision rests on (retry backoff, lease TTLs); it never jumps and
is only ever compared with itself, never with another host's. `wall()` is for display (progress,
`harvest status`) and nothing else.
"""

from __future__ import annotations

import time

from harvest.runtime import sigterm


class Clock:
    """The real clocks of this process."""

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)

    def wall(self) -> float:
        return time.time()


class StoppableClock(Clock):
    """The real clocks, whose sleeps SIGTERM ends at once inside a SigtermFlag (raising
    harvest.runtime.sigterm.Interrupted): for a command whose every wait must end with a preemption notice
    (extraction: a lease's wait-out, storage's back-offs). A trainer's storage keeps SYSTEM: its save on
    SIGTERM still retries a transient error."""

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            sigterm.sleep(seconds)


SYSTEM = Clock()
STOPPABLE = StoppableClock()
