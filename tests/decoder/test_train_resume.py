"""A decoder run killed, then preempted (exit 75), then resumed past a damaged newest checkpoint ends with the
params of a run never interrupted."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from extract_helpers import harvest_cmd, harvest_env, run_harvest
from preemption import kill_at, preempt, start
from processes import read_until
from training_helpers import TINY_SHAPE, assert_trees_close, metrics, restored_params


STEPS = 6  # N; the runs go on to 2N


def checkpoint_steps(out: Path) -> list[int]:
    root = out / "checkpoints"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []


def flip_a_params_byte(out: Path, step: int) -> str:
    """Flip the last byte of a params chunk of `step` (its newest copy); the chunk's name."""
    from harvest.training.step_parts import CheckpointPart

    part = sorted((out / "checkpoints" / str(step)).glob("*/process_00000.json"))[-1]
    name = next(e["name"] for e in CheckpointPart.from_bytes(part.read_bytes()).files
                if e["name"].startswith("state/params."))
    chunk = part.with_suffix("") / name
    data = chunk.read_bytes()
    chunk.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    return name


@pytest.mark.slow
def test_killed_and_preempted_runs_resume_to_the_uninterrupted_params(text_data, tokenizer_dir, tmp_path):
    """A run to 2N, SIGKILLed as step N+2's checkpoint starts to save (step N's upload may still be under way);
    the same command, SIGTERMed short of the end, saves and exits 75 (retry later); then, with a byte of that
    newest checkpoint flipped, the same command says so in one line, resumes from the one before and goes to
    the end. The params equal those of a run straight to 2N (remat layer, the default). The interrupted runs
    hold at step 2N-1 until a signal (HARVEST_TRAIN_HOLD_AT_STEP), so no signal races the end of its run."""
    env = harvest_env(tmp_path / "cache", devices=2)

    def args(out: Path, steps: int) -> list[str]:
        return ["train", "--shape", json.dumps(TINY_SHAPE), "--tokenizer", str(tokenizer_dir), "--data",
                str(text_data), "--out", str(out), "--seq-len", "64", "--batch-size", "4", "--steps", str(steps),
                "--lr", "0.003", "--warmup", "2", "--schedule", "constant", "--checkpoint-every", "2", "--log-every", "1"]

    reference, out = tmp_path / "reference", tmp_path / "run"
    proc = start(args(out, 2 * STEPS), env, hold_at=2 * STEPS - 1)
    read_until(proc, f"step 1/{2 * STEPS}")  # compiled: the straight run, alongside the others, reuses it
    with open(tmp_path / "straight.log", "w") as log:
        straight = subprocess.Popen(harvest_cmd(*args(reference, 2 * STEPS)), env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
    kill_at(proc, STEPS + 2)
    preempt(args(out, 2 * STEPS), env, hold_at=2 * STEPS - 1)
    assert checkpoint_steps(out)[-1] == 2 * STEPS - 1
    chunk = flip_a_params_byte(out, 2 * STEPS - 1)
    resumed = run_harvest(*args(out, 2 * STEPS), env=env)
    assert resumed.returncode == 0, resumed.stderr
    damaged = [line for line in resumed.stderr.splitlines() if "damaged" in line]
    assert len(damaged) == 1 and f"step {2 * STEPS - 1} is damaged, resuming from step {2 * STEPS - 2}" in damaged[0] \
        and chunk in damaged[0], resumed.stderr
    assert checkpoint_steps(out)[-1] == 2 * STEPS
    assert straight.wait(timeout=120) == 0, (tmp_path / "straight.log").read_text()
    assert_trees_close(restored_params(out), restored_params(reference), rtol=1e-6)
    assert [r["step"] for r in metrics(out)] == list(range(1, 2 * STEPS + 1))
