"""--log-to: the metrics process 0 writes to metrics.jsonl also reach Weights & Biases (offline: its local run
files, read back) and TensorBoard (event files read back with tensorboard's own EventAccumulator), for the TRM
trainer, `harvest sae train` and the decoder trainer; a run preempted (SIGTERM, exit 75) and resumed continues
the same W&B run (one id, kept in run.json) and the same event file, each step once; a missing package is a
one-line refusal that writes nothing."""

from __future__ import annotations

import json
import signal
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from extract_helpers import harvest_cmd, harvest_env, run_harvest
from test_sae import source  # noqa: F401 (the SAE tests' extracted run, a fixture)
from test_sae import train_args as sae_args
from test_train import TINY_SHAPE, read_until
from test_trm_train import build_sudokus
from test_trm_train import train_args as trm_args

from harvest.train.runlog import HOLD_AT

STEPS = 12  # the SAE and TRM tests' runs


def records(out: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]


def preempted_then_resumed(args: list[str], env: dict, hold_at: int) -> None:
    """The command held at `hold_at` and SIGTERMed (exit 75), then rerun to the end."""
    proc = subprocess.Popen(harvest_cmd(*args), env={**env, HOLD_AT: str(hold_at)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    read_until(proc, f"holding at step {hold_at}")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, rest
    done = run_harvest(*args, env=env)
    assert done.returncode == 0, done.stderr[-3000:]


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


@pytest.fixture(scope="module")
def sudokus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("curves-trm")
    env = {**harvest_env(root / "cache"), "JAX_COMPILATION_CACHE_DIR": str(root / "xla-cache")}
    return {"data": build_sudokus(root / "sudoku4", 4, 200, 2, 50), "env": env}


@pytest.mark.slow
def test_a_preempted_trm_run_continues_its_wandb_run(sudokus, tmp_path):
    out = tmp_path / "run"
    env = {**sudokus["env"], "WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_PROJECT": "harvest-test"}
    preempted_then_resumed(trm_args(sudokus["data"], str(out), log_to="wandb"), env, hold_at=5)
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs), runs
    histories = [wandb_history(r / f"run-{run_id}.wandb") for r in runs]
    assert [h[0] for h in histories] == [run_id, run_id]
    rows = [row for _, h in histories for row in h]
    assert [r["_step"] for r in rows] == list(range(1, STEPS + 1))
    for row, record in zip(rows, records(out)):
        for key in ("loss", "exact_accuracy", "accuracy", "lr", "tokens_per_s"):
            assert row[key] == pytest.approx(record[key], rel=1e-12), key


@pytest.mark.slow
def test_a_preempted_sae_run_continues_its_event_file(source, tmp_path):  # noqa: F811
    out = tmp_path / "sae"
    preempted_then_resumed(sae_args(source, str(out), log_to="tensorboard"), source["env"], hold_at=7)
    assert [p.name for p in (out / "tensorboard").iterdir()] == ["events.out.tfevents.0.harvest"]
    curves, written = event_scalars(out / "tensorboard"), records(out)
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
        assert curves[key] == [(r["step"], pytest.approx(np.float32(r[key]), rel=1e-6)) for r in records(out)], key
