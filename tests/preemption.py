"""The trainers' kill -> hold -> SIGTERM -> resume scenario, for `harvest train` (decoder and TRM) and
`harvest sae train` alike: a run SIGKILLed, the same command held at a step (HARVEST_TRAIN_HOLD_AT_STEP, so
no signal races the end of the run) and SIGTERMed there (it checkpoints and exits 75, retry later), then the
same command resuming to the end."""

from __future__ import annotations

import random
import re
import signal
import subprocess

from extract_helpers import harvest_cmd, run_harvest
from processes import read_until

from harvest.training.loop import HOLD_AT


def start(args: list[str], env: dict, hold_at: int | None = None) -> subprocess.Popen:
    """`harvest *args`, its output read line by line; held at step `hold_at` until a signal, if given."""
    env = env if hold_at is None else {**env, HOLD_AT: str(hold_at)}
    return subprocess.Popen(harvest_cmd(*args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)


def kill_at(proc: subprocess.Popen, step: int) -> None:
    """SIGKILL the run once it logs `step`."""
    read_until(proc, f"step {step}/")
    proc.kill()
    proc.wait()


def preempt(args: list[str], env: dict, hold_at: int) -> str:
    """The command held at `hold_at` and SIGTERMed there: it saves and exits 75, saying so; its output."""
    proc = start(args, env, hold_at)
    read_until(proc, f"holding at step {hold_at}")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, rest
    assert re.search(rf"step {hold_at}/\d+ \(stopped on SIGTERM", rest), rest
    return rest


def resume(args: list[str], env: dict, after: int) -> subprocess.CompletedProcess:
    """The command rerun: it goes on from the checkpoint at step `after`, to the end."""
    done = run_harvest(*args, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"step {after + 1}/" in done.stdout and f"step {after}/" not in done.stdout, done.stdout
    return done


def kill_hold_resume(args: list[str], env: dict, steps: int) -> None:
    """SIGKILL at a random step, then the same command held at steps-1 and SIGTERMed (a checkpoint at steps-1),
    then the same command to the end, which runs step `steps` alone."""
    kill_at(start(args, env), random.Random().randint(2, steps - 3))
    preempt(args, env, steps - 1)
    resume(args, env, after=steps - 1)
