"""SIGTERM, the preemption notice of a spot VM or a job manager, as a flag a long loop polls: the loop stops at
its next step with its work saved (training: a checkpoint; extraction: the closed shards committed), and the
command exits 75 (retry later), so that rerunning it resumes. Used as a context manager around the loop.

A wait inside such a loop that may last (a reader following a run waits for shards that an extraction, itself
preempted, may never commit) sleeps with `sleep`, which the notice ends at once by raising `Interrupted`: the
loop then saves and stops as at a step, within the notice's ~30 s."""

from __future__ import annotations

import signal
import threading

_NOTICE = threading.Event()  # set by SIGTERM inside a SigtermFlag


class Interrupted(Exception):
    """A `sleep` ended by SIGTERM: the loop around it saves what it reached and stops."""


def sleep(seconds: float) -> None:
    """time.sleep, ended at once (raising Interrupted) by SIGTERM inside a SigtermFlag."""
    if _NOTICE.wait(seconds):
        raise Interrupted("stopped on SIGTERM while waiting")


class SigtermFlag:
    """SIGTERM only raises `raised` (and ends `sleep`s); the previous handler comes back on exit."""

    def __enter__(self):
        self.raised = False
        _NOTICE.clear()
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.raised = True
        _NOTICE.set()

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self._previous)
        _NOTICE.clear()
