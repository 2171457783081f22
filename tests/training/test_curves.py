"""--log-to: the metrics process 0 writes to metrics.jsonl also reach Weights & Biases (offline: its local run
files, read back) and TensorBoard (event files read back with tensorboard's own EventAccumulator), for the TRM
trainer, `harvest sae train` and the decoder trainer; a run preempted (SIGTERM, exit 75) and resumed continues
the same W&B run (one id, kept in run.json) and the same event file, each step once; a missing package is a
one-line refusal that writes nothing."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from extract_helpers import harvest_env, run_harvest
from preemption import preempt, resume
from sae_helpers import train_args as sae_args
from training_helpers import TINY_SHAPE, metrics
from trm_helpers import train_args as trm_args

STEPS = 12  # the SAE and TRM tests' runs


def wandb_history(run_file: Path) -> tuple[str, list[dict]]:
    """(run id, history rows) of an offline run's .wandb file: a LevelDB-style log (a 7-byte ':W&B' header, then
    32 KiB blocks of records, each a 7-byte header of crc, length, type) of wandb's protobuf Records."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, part, run_id, rows = run_file.read_bytes(), 7, b"", None, []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if left < 7 or (length == 0 and kind == 0):
            pos += left
            continue
        part, pos = part + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(part)
            part = b""
            if record.WhichOneof("record_type") == "run":
                run_id = record.run.run_id
            elif record.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    return run_id, rows


def event_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(logdir))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


@pytest.mark.slow
def test_a_preempted_trm_run_continues_its_wandb_run(sudokus, tmp_path):
    out = tmp_path / "run"
    env = {**sudokus["env"], "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_PROJECT": "harvest-test"}
    args = trm_args(sudokus["data"], str(out), log_to="wandb")
    preempt(args, env, hold_at=5)
    resume(args, env, after=5)
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), runs
    histories = [wandb_history(r / f"run-{run_id}.wandb") for r in runs]
    assert [h[0] for h in histories] == [run_id, run_id]
    rows = [row for _, h in histories for row in h]
    assert [r["_step"] for r in rows] == list(range(1, STEPS + 1))
    for row, record in zip(rows, metrics(out)):
        for key in ("loss", "exact_accuracy", "accuracy", "lr", "tokens_per_s"):
            assert row[key] == pytest.approx(record[key], rel=1e-12), key


@pytest.mark.slow
def test_a_preempted_sae_run_continues_its_event_file(sae_source, tmp_path):
    out = tmp_path / "sae"
    args = sae_args(sae_source, str(out), log_to="tensorboard")
    preempt(args, sae_source["env"], hold_at=7)
    resume(args, sae_source["env"], after=7)
    assert [p.name for p in (out / "tensorboard").iterdir()] == ["events.out.tfevents.0.harvest"]
    curves, written = event_scalars(out / "tensorboard"), metrics(out)
    for key in ("fvu", "l0", "dead_fraction", "aux_loss", "tokens_per_s", "tensors/resid_post.1/fvu"):
        steps, values = zip(*curves[key])
        assert list(steps) == list(range(1, STEPS + 1)), key
        want = [r["tensors"]["resid_post.1"]["fvu"] if key.startswith("tensors/") else r[key] for r in written]
        np.testing.assert_allclose(values, np.float32(want), rtol=1e-6, err_msg=key)


@pytest.mark.slow
def test_the_decoder_trainer_logs_to_tensorboard_and_a_missing_package_is_refused(tmp_path):
    from harvest.demo import demo_checkpoint

    tokenizer = demo_checkpoint(tmp_path / "demo")
    data = tmp_path / "text.jsonl"
    data.write_text("".join(json.dumps({"text": f"sample {i} " * 20}) + "\n" for i in range(40)))
    env = harvest_env(tmp_path / "cache")
    args = ["train", "--shape", json.dumps(TINY_SHAPE), "--tokenizer", str(tokenizer), "--data", str(data),
            "--seq-len", "64", "--batch-size", "4", "--steps", "3", "--log-every", "1", "--log-to", "tensorboard"]
    shadow = tmp_path / "no-tensorboard"
    (shadow / "tensorboard").mkdir(parents=True)
    (shadow / "tensorboard" / "__init__.py").write_text("raise ImportError('not installed')\n")
    refused = run_harvest(*args, "--out", str(tmp_path / "refused"),
                          env={**env, "PYTHONPATH": f"{shadow}:{env.get('PYTHONPATH', '')}"})
    assert refused.returncode == 2 and refused.stderr.strip().count("\n") == 0, refused.stderr
    assert "--log-to tensorboard" in refused.stderr and "'.[logging]'" in refused.stderr
    assert not (tmp_path / "refused").exists()
    out = tmp_path / "run"
    done = run_harvest(*args, "--out", str(out), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    curves = event_scalars(out / "tensorboard")
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu"):
        assert curves[key] == [(r["step"], pytest.approx(np.float32(r[key]), rel=1e-6)) for r in metrics(out)], key
