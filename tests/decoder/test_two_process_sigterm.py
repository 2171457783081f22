"""A preemption notice on one process of a 2-process x 4-device `harvest train` stops both at the same step,
each having saved its part of it: the processes agree on the notice at common check steps
(harvest.runtime.distributed.StopAgreement), not with a collective every step."""

from __future__ import annotations

import json
import re
import signal
import subprocess

import pytest
from extract_helpers import harvest_cmd
from processes import free_port, read_until, two_process_env
from training_helpers import TINY_SHAPE

from harvest.training.loop import HOLD_AT

HOLD = 10  # past the first checks, a step apart (no pace measured yet)
STEPS = 5000  # far past where the agreed stop comes (a second of steps after HOLD)


@pytest.mark.slow
def test_sigterm_on_one_process_stops_both_at_the_same_step_with_both_parts_saved(text_data, tokenizer_dir,
                                                                                   tmp_path):
    """Process 1 is held at step HOLD and SIGTERMed there; process 0 gets no signal. Both stop at the same step
    (the next check, at or after HOLD), say so, and exit 75; that step's checkpoint holds both processes' parts,
    and no other checkpoint was written."""
    from harvest.storage import Storage
    from harvest.training import step_parts

    out = tmp_path / "run"
    address = f"127.0.0.1:{free_port()}"
    env = two_process_env(tmp_path)

    def cmd(pid: int) -> list[str]:
        return harvest_cmd("train", "--shape", json.dumps(TINY_SHAPE), "--tokenizer", str(tokenizer_dir), "--data",
                           str(text_data), "--out", str(out), "--seq-len", "64", "--batch-size", "8", "--steps",
                           str(STEPS), "--checkpoint-every", str(STEPS), "--coordinator", address,
                           "--num-processes", "2", "--process-id", str(pid))

    with open(tmp_path / "process0.log", "w") as log:
        first = subprocess.Popen(cmd(0), env=env, stdout=log, stderr=subprocess.STDOUT)
    held = subprocess.Popen(cmd(1), env={**env, HOLD_AT: str(HOLD)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        read_until(held, f"holding at step {HOLD}", timeout_s=180)
        held.send_signal(signal.SIGTERM)
        rest, _ = held.communicate(timeout=120)
        first.wait(timeout=60)
    finally:
        for proc in (first, held):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    logs = [(tmp_path / "process0.log").read_text(), rest]
    assert [first.returncode, held.returncode] == [75, 75], [log[-3000:] for log in logs]
    stopped = [re.findall(rf"step (\d+)/{STEPS} \(stopped on SIGTERM", log) for log in logs]
    assert len(stopped[0]) == 1 and stopped[0] == stopped[1], logs
    step = int(stopped[0][0])
    assert HOLD <= step < STEPS
    checkpoints = Storage(str(out)).child("checkpoints")
    assert step_parts.complete_steps(checkpoints) == [step]
    (_, attempt), = step_parts.complete(checkpoints)
    assert [p.process for p in step_parts.read_parts(checkpoints, step, attempt)] == [0, 1]
