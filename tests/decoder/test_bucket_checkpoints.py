"""Decoder checkpoints in s3:// and gs:// buckets resume on fresh machines (one process and two) to the
params of a run straight on a local path; status and export read the bucket. Checkpoint steps in storage on
their own: tests/training/test_checkpoints.py."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from extract_helpers import harvest_cmd
from processes import free_port, run_processes, two_process_env
from training_helpers import TINY_SHAPE, assert_trees_close, restored_params, train


BUCKET_RUN = dict(shape=TINY_SHAPE, seq_len=64, batch_size=8, lr=3e-3, warmup=1, schedule="constant", checkpoint_every=2,
                  keep=2, log_every=1, remat="none")


@pytest.fixture(scope="module")
def bucket_reference(text_data, tokenizer_dir, tmp_path_factory) -> dict:
    """The params of BUCKET_RUN's 4 steps straight, on a local path: what every bucket run must end with."""
    out = tmp_path_factory.mktemp("bucket-reference") / "run"
    train(**BUCKET_RUN, tokenizer=str(tokenizer_dir), data=str(text_data), out=str(out), steps=4)
    return restored_params(out)


def test_checkpoints_in_a_bucket_resume_on_a_fresh_machine_and_export(gcs_url, bucket_reference, text_data,
                                                                      tokenizer_dir, tmp_path, monkeypatch, capsys,
                                                                      caplog):
    """A run in a bucket (GCS; S3: the two-process test below): 2 steps on one "machine" (checkpoints 1 and
    2), then a byte of step 2 flipped: another machine, whose staging is empty, says so in one line, resumes
    from step 1 and goes on to 4, equal to 4 steps straight (fp32); status and export read the bucket;
    exporting a damaged step is one line, exit 2."""
    from rich.console import Console
    from safetensors.numpy import load_file

    from harvest.cli import main
    from harvest.model.config import ModelConfig
    from harvest.model.weights import to_hf
    from harvest.training import step_parts
    from harvest.storage import Storage
    from harvest.training.step_parts import CheckpointPart
    from harvest.training.status import training_status

    url = gcs_url
    settings = dict(BUCKET_RUN, tokenizer=str(tokenizer_dir), data=str(text_data))
    checkpoints = Storage(url).child("checkpoints")

    def a_params_chunk(step: int) -> tuple[Storage, str]:
        """The part of process 0 in `step`'s newest copy, and a params chunk in it."""
        attempt = next(a for s, a in step_parts.complete(checkpoints) if s == step)
        chunk = next(e["name"] for e in CheckpointPart.from_bytes(checkpoints.read_bytes(
            f"{step}/{attempt}/process_00000.json")).files if e["name"].startswith("state/params."))
        return checkpoints.child(f"{step}/{attempt}/process_00000"), chunk

    def flip(part: Storage, chunk: str) -> None:
        data = part.read_bytes(chunk)
        part.write_bytes(chunk, data[:-1] + bytes([data[-1] ^ 1]))

    for machine, steps, every in (("a", 2, 1), ("b", 4, 2)):  # each machine: its own, empty cache
        monkeypatch.setenv("HARVEST_CACHE", str(tmp_path / f"machine-{machine}"))
        assert train(**{**settings, "checkpoint_every": every}, out=url, steps=steps)["step"] == steps
        if machine == "a":
            assert step_parts.complete_steps(checkpoints) == [1, 2]
            part, chunk = a_params_chunk(2)
            flip(part, chunk)
    warned = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warned) == 1 and "step 2 is damaged, resuming from step 1" in warned[0] and chunk in warned[0], warned
    assert not any((tmp_path / "machine-b").rglob("*.zarray")), "the staging outlived the run"
    assert step_parts.steps_present(checkpoints) == step_parts.complete_steps(checkpoints) == [2, 4]
    ours = restored_params(url)
    assert_trees_close(ours, bucket_reference, rtol=1e-6)
    assert [json.loads(line)["step"] for line in Storage(url).read_bytes("metrics.jsonl").splitlines()] == [1, 2, 3, 4]
    console = Console(width=200, record=True)
    console.print(training_status(url))
    assert re.search(r"\b4/\d.* 4 ", console.export_text())  # step 4 of a run made for 2, then 4; checkpoint 4

    assert main(["train", "export", url, "--out", str(tmp_path / "export")]) == 0
    capsys.readouterr()
    model = ModelConfig.from_hf(TINY_SHAPE, "test")
    exported = load_file(str(tmp_path / "export/model.safetensors"))
    for name, value in to_hf(ours, model).items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)

    part, chunk = a_params_chunk(4)
    for damage, expected in ((lambda: flip(part, chunk), "differ from what process_00000.json recorded"),
                             (lambda: part.delete(chunk), "missing, though process_00000.json lists it")):
        damage()
        assert main(["train", "export", url, "--out", str(tmp_path / f"export-{len(expected)}")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0] and chunk in err[0], err


@pytest.mark.slow
def test_two_processes_checkpoint_into_s3_and_resume(s3_url, bucket_reference, text_data, tokenizer_dir, tmp_path):
    """2 processes x 4 devices that share no directory: 2 steps into s3://, then a rerun to 4 resumes from the
    bucket (both processes' parts); the params equal one process's 4 steps on 8 devices (fp32, 1e-5)."""
    from harvest.training import step_parts
    from harvest.storage import Storage

    flags = [f"--{k.replace('_', '-')}={json.dumps(v) if isinstance(v, dict) else v}" for k, v in BUCKET_RUN.items()]
    base = ["train", *flags, "--tokenizer", str(tokenizer_dir), "--data", str(text_data), "--out", s3_url,
            "--num-processes", "2"]
    for steps in (2, 4):
        address = f"127.0.0.1:{free_port()}"
        codes = run_processes([harvest_cmd(*base, "--steps", str(steps), "--coordinator", address, "--process-id",
                                           str(pid)) for pid in range(2)], two_process_env(tmp_path), tmp_path)
        logs = [(tmp_path / f"process{i}.log").read_text() for i in range(2)]
        assert codes == [0, 0], [log[-3000:] for log in logs]
    assert "step 3/4" in logs[0] and "step 2/4" not in logs[0], logs[0]  # resumed at 2
    checkpoints = Storage(s3_url).child("checkpoints")
    (step, attempt), _ = step_parts.complete(checkpoints)
    parts = step_parts.read_parts(checkpoints, step, attempt)
    assert step == 4 and [p.process for p in parts] == [0, 1] and all(p.files for p in parts)
    assert_trees_close(restored_params(s3_url), bucket_reference, rtol=1e-5)
