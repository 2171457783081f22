"""SIGTERM, the preemption notice of a spot VM or a job manager, as a flag a long loop polls: the loop stops at
its next step with its work saved (training: a checkpoint; extraction: the closed shards committed), and the
command exits 75 (retry later), so that rerunning it resumes. Used as a context manager around the loop."""

from __future__ import annotations

import signal


class SigtermFlag:
    """SIGTERM only raises `raised`; the previous handler comes back on exit."""

    def __enter__(self):
        self.raised = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame):
        self.raised = True

    def __exit__(self, *exc):
        signal.signal(signal.SIGTERM, self._previous)
