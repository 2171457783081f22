"""The loop every trainer on the runtime runs (`harvest train`, its TRM model, `harvest sae train`): steps to the
end, a checkpoint every N steps and at the end, and a preemption notice (SIGTERM on any process) agreed on by
all of them (at checks about a second apart: harvest.runtime.distributed.StopAgreement) so that they save the same
step together and stop. One copy, so the three resume alike."""

from __future__ import annotations

import os
import time
from typing import Callable

from harvest.runtime import distributed, sigterm
from harvest.runtime.sigterm import Interrupted
from harvest.training.checkpoint import Checkpoints

# Tests: after this step the loop waits for SIGTERM, so a test's signal lands short of the end by construction.
HOLD_AT = "HARVEST_TRAIN_HOLD_AT_STEP"


class SigtermFlag(sigterm.SigtermFlag):
    """harvest.runtime.sigterm's flag (the loop saves and stops at the next step), and the tests' hold."""

    def __enter__(self):
        self._hold_at = int(os.environ.get(HOLD_AT, -1))
        return super().__enter__()

    def hold(self, step: int) -> None:
        """At the step HARVEST_TRAIN_HOLD_AT_STEP names, wait for SIGTERM (tests)."""
        if step == self._hold_at:
            print(f"holding at step {step} until SIGTERM ({HOLD_AT})", flush=True)
            while not self.raised:
                time.sleep(0.02)


def run_steps(step: int, steps: int, advance: Callable[[int], None], save: Callable[[int], None], *,
              checkpoints: Checkpoints, every: int, saved_at: int | None, name: str) -> int:
    """From `step` to `steps`: `advance(n)` runs (and logs) the step that ends at n; `save(n)` checkpoints step
    n, every `every` steps, at `steps`, and when any process got SIGTERM, at the processes' next check (each step
    in one process; distributed.StopAgreement), after which the loop stops short. A SIGTERM while `advance` waits
    for data (harvest.runtime.sigterm.sleep) saves the step reached before it.
    A starting point no checkpoint holds (`saved_at` differs, e.g. --steps 0) is saved too. Then the saves are
    waited for and every process meets at the barrier `name`. Returns the step reached."""
    agreement = distributed.StopAgreement(step, steps)
    with SigtermFlag() as flag, distributed.peers_watched():
        while step < steps:
            try:
                advance(step + 1)
            except Interrupted:  # SIGTERM while the data was waited for: that step did not run
                agreement.stop(step, True)  # the collective the other processes call at their next check
                if step not in checkpoints.steps():  # the waiting reader's trainer may have saved it already
                    save(step)
                saved_at = step
                break
            step += 1
            flag.hold(step)
            preempted = agreement.due(step) and agreement.stop(step, flag.raised)
            if preempted or step % every == 0 or step == steps:
                save(step)
                saved_at = step
            if preempted:
                break
        if saved_at != step:
            save(step)
        checkpoints.wait()
        checkpoints.close()
        distributed.barrier(name)
    return step
