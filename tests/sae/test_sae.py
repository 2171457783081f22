"""harvest sae: SAEs trained on a run harvest extracted from a tiny model. Bad input is one line, exit 2,
nothing written; a run SIGKILLed at a random step and then SIGTERMed (exit 75) resumes to the params of a
run never interrupted; checkpoints in gs:// and s3:// resume on a fresh machine; 2 processes x 4 devices
with the latents over `model` equal one device; exports load in sparsify and SAELens with harvest's
latents and reconstructions; a TopK SAE reaches sparsify's FVU (same activations, tokens, latents, k,
batch, Adam, AuxK off); eval reads held-out streams; status shows the run. Latents over `model` take the
top-k in two stages (equal to lax.top_k, no [rows, latents] all-gather in the compiled step); --eval-every
logs held-out metrics; run and tensors are YAML lists."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from extract_helpers import harvest_cmd, run_harvest, text_streams
from test_distributed import free_port
from test_train import read_until, run_processes, two_process_env

TENSOR = "resid_post.1"
# 64 rows a step over 8 or 2 devices, 256 latents on the 64-wide demo model, k 8.
BASE = {"tensors": TENSOR, "expansion": 4, "k": 8, "batch_tokens": 64, "warmup": 2, "lr": 3e-3,
        "checkpoint_every": 3, "log_every": 1, "holdout_streams": 1}
STEPS = 12


def flags(settings: dict) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in settings.items()]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> dict:
    """One run made by `harvest extract` (demo model, 300 texts in 4 streams, resid_post at layers 1-2,
    float32), its checkpoint, and an env for harvest subprocesses (2 devices) sharing a compile cache."""
    from harvest.config import ExtractConfig
    from harvest.extract.job import run_extract

    root = tmp_path_factory.mktemp("sae-source")
    checkpoint, env, streams = text_streams(root, 4, n=300)
    out = root / "run"
    run_extract(ExtractConfig(model=str(checkpoint), data=str(streams), out=str(out), points="resid_post:1-2",
                              dtype="float32", max_seq_len=128, batch_size=4, shard_size="64KB").validate())
    env = {**env, "JAX_COMPILATION_CACHE_DIR": str(root / "xla-cache")}
    return {"run": str(out), "checkpoint": checkpoint, "env": env, "root": root}


def restored(out: str, step: int | None = None) -> dict:
    import jax

    from harvest.train.checkpoint import CHECKPOINTS, Checkpoints

    checkpoints = Checkpoints(f"{out}/{CHECKPOINTS}", every=1, keep=1, read_only=True)
    params = jax.device_get(checkpoints.restore_params(step if step is not None else checkpoints.steps()[-1]))
    checkpoints.close()
    return params


def assert_close(ours: dict, theirs: dict, rtol: float) -> None:
    import jax

    flat_ours, flat_theirs = jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs)
    assert len(flat_ours) == len(flat_theirs)
    for (path, a), b in zip(flat_ours, flat_theirs):
        scale = float(np.max(np.abs(b))) or 1.0
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * scale, err_msg=jax.tree_util.keystr(path))


def train_args(source: dict, out: str, **more) -> list[str]:
    return ["sae", "train", "--run", source["run"], "--out", out,
            *flags({**BASE, "tokens": 64 * STEPS, **more})]


@pytest.fixture(scope="module")
def straight(source) -> str:
    """STEPS steps straight, on 2 devices (a subprocess, as every run it is compared with), evaluating on the
    held-out stream every 4 steps (which leaves the params alone)."""
    out = str(source["root"] / "straight")
    done = run_harvest(*train_args(source, out), "--eval-every", "4", env=source["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_two_stage_top_k_equals_the_global_one():
    """Latents over model=4 (rows over data=2): the two-stage top-k gives lax.top_k's values and ids, ties
    (values on a coarse grid) broken alike, and the bisected batch threshold lax.top_k's n-th value."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from harvest.runtime.mesh import make_mesh
    from harvest.sae.topk import kth_largest, top_k

    mesh = make_mesh("data=2,model=4")
    x = jnp.round(jax.nn.relu(jax.random.normal(jax.random.key(0), (16, 64))) * 4) / 4  # many ties, many zeros
    placed = jax.device_put(x, NamedSharding(mesh, PartitionSpec(("data", "fsdp"), "model")))
    for k in (1, 5, 16, 20):
        values, ids = jax.jit(lambda a, k=k: top_k(a, k, mesh))(placed)
        want_values, want_ids = jax.lax.top_k(x, k)
        np.testing.assert_array_equal(values, want_values)
        np.testing.assert_array_equal(ids, want_ids)
    for n in (1, 37, 16 * 8, 16 * 64):
        got = float(jax.jit(lambda a, n=n: kth_largest(a, n, mesh))(placed))
        assert got == float(jax.lax.top_k(x.ravel(), n)[0][-1]), n


@pytest.mark.parametrize("architecture", ["topk", "batchtopk"])
def test_latents_over_model_give_the_one_device_loss_and_gradients(architecture):
    """One process, 8 devices, latents over model (data=2 x model=4): the loss, metrics and gradients of the
    masked formulation with the two-stage top-k equal one device's (topk: its sparse backward), AuxK on."""
    import jax
    import jax.numpy as jnp

    from harvest.runtime.mesh import make_mesh
    from harvest.sae import model as M

    spec = M.Spec(architecture, 16, 128, 4, 8, 1 / 32)
    x = jax.random.normal(jax.random.key(1), (64, 16))
    params = {**M.init_params(jax.random.key(0), spec, x.mean(0)),
              "b_enc": 0.1 * jax.random.normal(jax.random.key(2), (128,))}
    dead = jnp.arange(128) % 3 == 0
    results = [jax.jit(jax.value_and_grad(lambda p, m=m: M.loss(p, x, spec, dead, m), has_aux=True))(params)
               for m in (None, make_mesh("data=2,model=4"))]
    assert_close(results[1], results[0], rtol=1e-5)


def test_latents_over_model_gather_no_rows_by_latents_array():
    """The compiled step (topk and batchtopk, AuxK on, data=2 x model=4) all-gathers nothing the size of the
    [rows, latents] pre-activations, not even one data slot's share: only the k x model candidates per row."""
    import re

    import jax
    import jax.numpy as jnp

    from harvest.runtime.mesh import make_mesh
    from harvest.sae import model as M
    from harvest.sae.step import make_optimizer, make_step, state_shardings

    mesh = make_mesh("data=2,model=4")
    rows, latents = 64, 1024
    specs = {a: M.Spec(a, 16, latents, 4, 8, 1 / 32) for a in ("topk", "batchtopk")}
    optimizers = {a: make_optimizer(1e-3, 1, 10, "linear") for a in specs}
    shapes = {a: jax.eval_shape(lambda s=s: M.init_params(jax.random.key(0), s, jnp.zeros(16)))
              for a, s in specs.items()}
    shardings = state_shardings(specs, optimizers, mesh, shapes)
    step = make_step(specs, optimizers, shardings, mesh, dead_tokens=100, scales=dict.fromkeys(specs, 1.0),
                     compute_dtype="float32")
    state = jax.eval_shape(lambda p: {"step": jnp.zeros((), jnp.int32), "params": p,
                                      "opt_state": {a: optimizers[a].init(p[a]) for a in specs},
                                      "idle": {a: jnp.zeros(latents, jnp.int32) for a in specs}}, shapes)
    batch = {a: jax.ShapeDtypeStruct((rows, 16), jnp.float32) for a in specs}
    hlo = step.lower(state, batch).compile().as_text()
    gathered = [math.prod(int(d) for d in dims.split(",") if d) for dims in
                re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", hlo)]
    assert gathered, "expected the candidates' all-gathers"
    assert max(gathered) < rows // 2 * latents // 4, sorted(gathered)[-5:]


def test_run_and_tensors_are_yaml_lists_or_comma_separated_flags(tmp_path):
    """`run` and `tensors` as YAML lists give the config their comma-separated flags give (flags win), whose
    run settings survive run.json's JSON (a rerun resumes); anything but strings is a one-line error."""
    from harvest.config import ConfigError, build
    from harvest.sae.config import SaeConfig

    listed = tmp_path / "sae.yaml"
    listed.write_text("run: [gs://b/run1, s3://b/run2]\ntensors:\n  - resid_post.1\n  - resid_post.2\nout: o\n")
    from_yaml = build(SaeConfig, str(listed), {})
    from_flags = build(SaeConfig, None, {"run": "gs://b/run1,s3://b/run2", "tensors": "resid_post.1, resid_post.2",
                                         "out": "o"})
    assert from_yaml == from_flags and from_yaml.tensor_names == ("resid_post.1", "resid_post.2")
    assert json.loads(json.dumps(from_yaml.run_settings())) == from_flags.run_settings()
    assert build(SaeConfig, str(listed), {"tensors": "resid_post.2"}).tensors == ["resid_post.2"]
    listed.write_text("run: [gs://b/run1, {a: 1}]\ntensors: resid_post.1\nout: o\n")
    with pytest.raises(ConfigError, match="run must be a list of strings or a comma-separated string"):
        build(SaeConfig, str(listed), {})


def test_bad_input_is_one_line_exit_2_and_nothing_written(source, tmp_path, capsys):
    from reader_helpers import RunWriter

    from harvest.cli import main
    from harvest.storage import Storage

    empty = tmp_path / "empty"
    Storage(str(empty)).write_bytes("run.json", Path(source["run"], "run.json").read_bytes())
    narrow = RunWriter(str(tmp_path / "narrow"), tensors={TENSOR: 32})
    narrow.shard(0, [10, 12])
    out = tmp_path / "out"
    base = ["sae", "train", "--out", str(out), "--tokens", "640", "--batch-tokens", "64", "--tensors", TENSOR]
    cases = [
        (["--run", source["run"], "--tensors", "resid_post.9"], "holds no resid_post.9"),
        (["--run", source["run"], "--latents", "64", "--k", "64"], "--k 64 must be smaller than the 64 latents"),
        (["--run", str(empty)], "has no committed shards"),
        (["--run", source["run"], "--batch-tokens", "12"], "not a multiple of the mesh's 8 data slots"),
        (["--run", f"{source['run']},{tmp_path / 'narrow'}"], "is 64 wide in"),
        (["--run", source["run"], "--architecture", "gated"], "--architecture 'gated': choose one of"),
        (["--run", source["run"], "--eval-every", "5"], "--eval-every needs held-out streams"),
    ]
    for args, message in cases:
        assert main(base + args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("harvest: error:") and message in err[0], (args, err)
        assert not out.exists(), args


def test_killed_and_preempted_runs_resume_to_the_uninterrupted_params(source, straight, tmp_path):
    """SIGKILL at a random step, then the same command held at STEPS-1 and SIGTERMed (exit 75, a checkpoint
    at STEPS-1), then the same command to the end: the params equal the straight run's (1e-6)."""
    from harvest.train.runlog import HOLD_AT

    out = str(tmp_path / "run")
    cmd = harvest_cmd(*train_args(source, out))
    kill_at = random.Random().randint(2, STEPS - 3)
    proc = subprocess.Popen(cmd, env=source["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    read_until(proc, f"step {kill_at}/{STEPS}")
    proc.kill()
    proc.wait()
    held = {**source["env"], HOLD_AT: str(STEPS - 1)}
    proc = subprocess.Popen(cmd, env=held, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    read_until(proc, f"holding at step {STEPS - 1}")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, rest
    assert f"step {STEPS - 1}/{STEPS} (stopped on SIGTERM" in rest, rest
    done = run_harvest(*train_args(source, out), env=source["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"step {STEPS}/{STEPS}" in done.stdout and f"step {STEPS - 1}/" not in done.stdout, (kill_at, done.stdout)
    assert_close(restored(out), restored(straight), rtol=1e-6)
    records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert {"fvu", "l0", "dead_fraction", "aux_loss", "tokens_per_s"} <= set(records[-1])


@pytest.mark.parametrize("bucket", ["gcs_url", "s3_url"])
def test_checkpoints_in_a_bucket_resume_on_a_fresh_machine(bucket, source, straight, tmp_path, request):
    """SIGTERMed at step 5 with --out in a bucket, then rerun on a "machine" with an empty cache (no staging):
    it resumes from the bucket to the straight run's params."""
    from harvest.train.runlog import HOLD_AT

    url = request.getfixturevalue(bucket)
    cmd = harvest_cmd(*train_args(source, url))
    servers = {k: v for k, v in os.environ.items() if k not in source["env"]}  # the emulators' endpoints
    env = {**source["env"], **servers, HOLD_AT: "5"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    read_until(proc, "holding at step 5")
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, rest
    fresh = {**env, "HARVEST_CACHE": str(tmp_path / "another-machine")}
    fresh.pop(HOLD_AT)
    done = run_harvest(*train_args(source, url), env=fresh)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "step 6/" in done.stdout and "step 5/" not in done.stdout, done.stdout
    assert_close(restored(url), restored(straight), rtol=1e-6)


def test_two_processes_with_latents_over_model_equal_one_device(source, tmp_path):
    """2 processes x 4 devices, mesh model=8 (latents split 8 ways: masked matmuls, the two-stage top-k) against
    one device (the gathered sparse decode): the params after 4 steps agree to 1e-5, and so do the held-out
    metrics (--eval-every 2)."""
    settings = ["--tokens", str(64 * 4), "--checkpoint-every", "100", "--eval-every", "2"]
    address = f"127.0.0.1:{free_port()}"
    two = str(tmp_path / "two")
    codes = run_processes([harvest_cmd(*train_args(source, two), *settings, "--mesh", "model=8", "--coordinator",
                                       address, "--num-processes", "2", "--process-id", str(pid))
                           for pid in range(2)], two_process_env(tmp_path), tmp_path)
    assert codes == [0, 0], [(tmp_path / f"process{i}.log").read_text()[-3000:] for i in range(2)]
    one = str(tmp_path / "one")
    done = run_harvest(*train_args(source, one), *settings, env={**source["env"], "XLA_FLAGS":
                                                                 "--xla_force_host_platform_device_count=1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert_close(restored(two), restored(one), rtol=1e-5)
    evals = [{r["step"]: [r[k] for k in ("eval_fvu", "eval_l0", "eval_dead_fraction")]
              for r in map(json.loads, Path(out, "metrics.jsonl").read_text().splitlines()) if "eval_fvu" in r}
             for out in (two, one)]
    assert list(evals[0]) == [2, 4]
    np.testing.assert_allclose(np.array(list(evals[0].values())), np.array(list(evals[1].values())), rtol=1e-5)


def test_exports_load_in_sparsify_and_saelens_with_harvests_outputs(source, straight, tmp_path):
    import torch
    from sae_lens import SAE
    from sparsify import SparseCoder

    from harvest.read.run import open_run
    from harvest.sae import model as M
    from harvest.sae.export import load_sae_run, spec_of

    info, _, params = load_sae_run(straight)
    spec = spec_of(info["saes"][TENSOR])
    x = next(iter(open_run(source["run"]).token_batches(256, [TENSOR], dtype="float32")))[TENSOR]
    latents, recon = (np.asarray(a) for a in M.infer(params[TENSOR], x, spec))
    for fmt in ("sparsify", "saelens"):
        done = run_harvest("sae", "export", straight, "--format", fmt, "--out", str(tmp_path / fmt), env=source["env"])
        assert done.returncode == 0, done.stderr[-3000:]
    coder = SparseCoder.load_from_disk(tmp_path / "sparsify" / TENSOR)
    lens = SAE.load_from_disk(str(tmp_path / "saelens" / TENSOR))
    assert lens.cfg.metadata.hook_name == "blocks.1.hook_resid_post"  # the TransformerLens name of resid_post.1
    with torch.no_grad():
        xt = torch.from_numpy(x)
        top = coder.encode(xt)
        dense = torch.zeros(len(x), spec.latents).scatter_(1, top.top_indices, top.top_acts).numpy()
        theirs = {"sparsify": (dense, coder.decode(top.top_acts, top.top_indices).numpy()),
                  "saelens": (lens.encode(xt).numpy(), lens.decode(lens.encode(xt)).numpy())}
    for fmt, (their_latents, their_recon) in theirs.items():
        np.testing.assert_allclose(their_latents, latents, rtol=1e-5, atol=1e-5, err_msg=fmt)
        np.testing.assert_allclose(their_recon, recon, rtol=1e-5, atol=1e-5, err_msg=fmt)
        assert (their_latents > 0).sum(1).max() <= spec.k


def test_eval_every_logs_the_held_out_metrics(source, straight):
    """--eval-every 4: steps 4, 8, 12 log eval_fvu, eval_l0, eval_dead_fraction; at step 12 they are the
    final SAE's on the first 8 batches of the held-out stream."""
    from harvest.read.run import open_run
    from harvest.sae import model as M
    from harvest.sae.export import load_sae_run, spec_of

    records = {r["step"]: r for r in map(json.loads, Path(straight, "metrics.jsonl").read_text().splitlines())}
    assert [s for s, r in records.items() if "eval_fvu" in r] == [4, 8, 12]
    info, _, params = load_sae_run(straight)
    sae = info["saes"][TENSOR]
    held = open_run(source["run"]).token_batches(64, [TENSOR], dtype="float32", seed=0, epochs=1, drop_last=True,
                                                 streams=sae["holdout_streams"][0])
    x = np.concatenate([b[TENSOR] for _, b in zip(range(8), held)])
    latents, recon = (np.asarray(a) for a in M.infer(params[TENSOR], x, spec_of(sae)))
    want = {"eval_fvu": np.sum((x - recon) ** 2) / np.sum((x - x.mean(0)) ** 2), "eval_l0": (latents > 0).sum(1).mean(),
            "eval_dead_fraction": np.mean(~(latents > 0).any(0))}
    got = records[STEPS]["tensors"][TENSOR]
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-4 * max(1, abs(value)), (key, got[key], value)
    assert records[STEPS]["eval_fvu"] == got["eval_fvu"]


def test_eval_reads_the_held_out_stream_and_status_shows_the_run(source, straight):
    from rich.console import Console

    from harvest.train.status import training_status

    done = run_harvest("sae", "eval", straight, "--tokens", "2000", env=source["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)["tensors"][TENSOR]
    assert 0 < result["fvu"] < 1 and 0 < result["l0"] <= BASE["k"] and result["tokens"] >= 1000
    assert sum(result["firing_histogram"].values()) == round(256 * (1 - result["dead_fraction"]))
    console = Console(width=200, record=True)
    console.print(training_status(straight))
    text = console.export_text()
    assert f"{STEPS}/{STEPS}" in text and TENSOR in text and "topk" in text, text


def test_eval_with_the_model_gives_ce_loss_recovered(source, straight, tmp_path):
    """`sae eval --model --data`: the clean CE equals transformers' loss on the same texts; the trained SAE
    recovers between 0 and 1 of the zero-ablation gap; a zero SAE recovers 0. The demo model is random: its
    one skill is that a token repeats (tied embeddings), so the texts are runs of repeated letters, where the
    clean model beats the zero-ablated one."""
    import torch
    import transformers

    from harvest.sae.export import load_sae_run, spec_of
    from harvest.sae.splice import ce_loss_recovered, text_batches

    rng = np.random.default_rng(0)
    texts = tmp_path / "repeats.jsonl"
    texts.write_text("".join(json.dumps({"text": "".join(chr(rng.integers(97, 123)) * int(rng.integers(2, 9))
                                                         for _ in range(12))}) + "\n" for _ in range(40)))
    texts = str(texts)
    done = run_harvest("sae", "eval", straight, "--tokens", "1500", "--model", str(source["checkpoint"]),
                       "--data", texts, "--max-seq-len", "64", env=source["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    ce = json.loads(done.stdout)["tensors"][TENSOR]["downstream"]
    assert ce["ce_clean"] < ce["ce_sae"] < ce["ce_zero"] and 0 < ce["ce_loss_recovered"] < 1, ce
    hf = transformers.AutoModelForCausalLM.from_pretrained(source["checkpoint"], torch_dtype=torch.float32)
    total = count = 0.0
    for tokens, segments in text_batches(source["checkpoint"], texts, "text", 8, 64, 1500):
        for row, seg in zip(tokens, segments):
            ids = torch.from_numpy(row[seg > 0][None].astype(np.int64))
            if ids.shape[1] > 1:
                with torch.no_grad():
                    total += float(hf(ids, labels=ids).loss) * (ids.shape[1] - 1)
                count += ids.shape[1] - 1
    assert ce["tokens"] == count and abs(ce["ce_clean"] - total / count) < 1e-4, (ce, total / count)

    info, _, params = load_sae_run(straight)
    zero = {k: np.zeros_like(v) for k, v in params[TENSOR].items()}
    spec = spec_of(info["saes"][TENSOR])
    none = ce_loss_recovered(str(source["checkpoint"]), texts, TENSOR, zero, spec, tokens=300, max_seq_len=64)
    assert abs(none["ce_loss_recovered"]) < 1e-6 and none["ce_zero"] > none["ce_clean"], none


def test_topk_reaches_sparsifys_fvu_on_the_same_activations(source, tmp_path):
    """Same rows in the same order, 256 latents, k 8, batch 64, Adam (lr 3e-3, warmup 2, linear to 0), AuxK
    off, 40 steps: harvest's final FVU on all the run's tokens is within 2% of sparsify's, with no more dead
    latents (never firing on those tokens)."""
    from sae_reference import sparsify_fvu_and_dead, train_sparsify

    from harvest.read.run import open_run
    from harvest.sae import model as M
    from harvest.sae.config import SaeConfig
    from harvest.sae.export import load_sae_run, spec_of
    from harvest.sae.job import run_sae_train

    steps = 40
    out = str(tmp_path / "harvest")
    settings = {**BASE, "holdout_streams": 0, "tokens": 64 * steps, "checkpoint_every": 100, "log_every": 10}
    run_sae_train(SaeConfig(run=source["run"], out=out, mesh="data=1,model=8", **settings).validate())
    run = open_run(source["run"])
    everything = np.concatenate([b[TENSOR] for b in run.token_batches(4096, [TENSOR], dtype="float32")])
    ordered = np.concatenate([b[TENSOR] for _, b in zip(range(steps), run.token_batches(
        64, [TENSOR], dtype="float32", seed=0, epochs=None, drop_last=True))])
    coder = train_sparsify(ordered, latents=256, k=8, batch=64, lr=3e-3, warmup=2)
    theirs_fvu, theirs_dead = sparsify_fvu_and_dead(coder, everything)
    info, _, params = load_sae_run(out)
    latents, recon = (np.asarray(a) for a in M.infer(params[TENSOR], everything, spec_of(info["saes"][TENSOR])))
    ours_fvu = float(np.sum((everything - recon) ** 2) / np.sum((everything - everything.mean(0)) ** 2))
    ours_dead = int(np.sum(~(latents > 0).any(0)))
    print(f"FVU harvest {ours_fvu:.4f} sparsify {theirs_fvu:.4f}; dead latents {ours_dead} vs {theirs_dead}")
    assert ours_fvu <= theirs_fvu * 1.02 and ours_dead <= theirs_dead, (ours_fvu, theirs_fvu, ours_dead, theirs_dead)


def test_relu_reaches_saelens_fvu_on_the_same_activations(source, tmp_path):
    """ReLU + L1 (weighted by decoder norms), 256 latents, l1 1.0, batch 64, Adam at a constant lr 3e-3, zero
    b_dec, 40 steps, the same rows in the same order: harvest's FVU on all the run's tokens is within 2% of
    SAELens's SAETrainer's, with no more dead latents. (SAELens also clips the gradient norm at 1; harvest
    does not.)"""
    import torch
    from sae_reference import train_saelens_relu

    from harvest.read.run import open_run
    from harvest.sae import model as M
    from harvest.sae.config import SaeConfig
    from harvest.sae.export import load_sae_run, spec_of
    from harvest.sae.job import run_sae_train

    steps, batch, lr, l1 = 40, 64, 3e-3, 1.0
    out = str(tmp_path / "harvest")
    run_sae_train(SaeConfig(run=source["run"], out=out, tensors=TENSOR, architecture="relu", expansion=4, l1_coeff=l1,
                            batch_tokens=batch, tokens=batch * steps, lr=lr, warmup=0, schedule="constant",
                            b_dec_init="zeros", checkpoint_every=100, log_every=10, mesh="data=8").validate())
    run = open_run(source["run"])
    everything = np.concatenate([b[TENSOR] for b in run.token_batches(4096, [TENSOR], dtype="float32")])
    ordered = [b[TENSOR] for _, b in zip(range(steps), run.token_batches(batch, [TENSOR], dtype="float32", seed=0,
                                                                         epochs=None, drop_last=True))]
    lens = train_saelens_relu(ordered, latents=256, l1=l1, lr=lr)
    with torch.no_grad():
        x = torch.from_numpy(everything)
        their_latents = lens.encode(x)
        their_recon = lens.decode(their_latents).numpy()
    info, _, params = load_sae_run(out)
    latents, recon = (np.asarray(a) for a in M.infer(params[TENSOR], everything, spec_of(info["saes"][TENSOR])))
    variance = np.sum((everything - everything.mean(0)) ** 2)
    ours, theirs = np.sum((everything - recon) ** 2) / variance, np.sum((everything - their_recon) ** 2) / variance
    ours_dead, theirs_dead = int(np.sum(~(latents > 0).any(0))), int(np.sum(~(their_latents.numpy() > 0).any(0)))
    print(f"FVU harvest {ours:.4f} SAELens {theirs:.4f}; L0 {(latents > 0).sum(1).mean():.1f} vs "
          f"{(their_latents.numpy() > 0).sum(1).mean():.1f}; dead {ours_dead} vs {theirs_dead}")
    assert ours <= theirs * 1.02 and ours_dead <= theirs_dead, (ours, theirs, ours_dead, theirs_dead)
