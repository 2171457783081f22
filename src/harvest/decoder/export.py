"""`harvest train export RUN --out DIR [--step N]`: a checkpoint of a training run as a HF checkpoint
(config.json + safetensors, sharded with an index above 5 GB, the tokenizer's files) that transformers
loads as it loads any hub model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from harvest.errors import UserError
from harvest.model.config import ModelConfig
from harvest.model.families import family
from harvest.model.weights import to_hf
from harvest.storage import Storage
from harvest.training.checkpoint import CHECKPOINTS, Checkpoints
from harvest.training.record import read_run

MAX_SHARD_BYTES = 5 * 10**9
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "chat_template.jinja", "generation_config.json")


def export(run_url: str, out_dir: str | Path, step: int | None = None,
           max_shard_bytes: int = MAX_SHARD_BYTES) -> dict[str, Any]:
    """Write step `step` (default: the newest) of the run as a HF checkpoint in out_dir."""
    run = Storage(run_url)
    record = read_run(run, "train", "a training run")
    if record is None:
        raise UserError(f"{run.url}: no run.json; not a harvest training run")
    info = record.details
    checkpoints = Checkpoints(run.url_of(CHECKPOINTS), every=1, keep=1, read_only=True)
    try:
        steps = checkpoints.steps()
        if not steps:
            raise UserError(f"{run.url}: no checkpoint yet")
        if step is None:
            step = steps[-1]
        elif step not in steps:
            raise UserError(f"--step {step}: {run.url} holds checkpoints of steps {', '.join(map(str, steps))}")
        out = Path(out_dir)
        if out.exists() and any(out.iterdir()):
            raise UserError(f"--out {out}: exists and is not empty; give a new directory")
        model = ModelConfig.from_hf(info.hf_config, "run.json hf_config")
        params = jax.device_get(checkpoints.restore_params(step))
    finally:
        checkpoints.close()
    tensors = to_hf(params, model)
    out.mkdir(parents=True, exist_ok=True)
    files = _write_safetensors(tensors, out, max_shard_bytes)
    dtype = str(next(iter(tensors.values())).dtype)
    hf_config = {**info.hf_config, "architectures": [family(model.model_type).architecture],
                 "tie_word_embeddings": model.tie_word_embeddings, "torch_dtype": dtype}
    hf_config.pop("dtype", None)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    tokenizer = Path(info.tokenizer or "")
    copied = [name for name in TOKENIZER_FILES if (tokenizer / name).is_file()]
    for name in copied:
        shutil.copyfile(tokenizer / name, out / name)
    return {"out": str(out), "step": step, "files": files, "tensors": len(tensors), "tokenizer_files": copied}


def _write_safetensors(tensors: dict[str, np.ndarray], out: Path, max_shard_bytes: int) -> list[str]:
    """One model.safetensors, or HF's model-0000i-of-0000n.safetensors + index when above max_shard_bytes."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, str(out / name), metadata={"format": "pt"})
    index = {"metadata": {"total_size": int(sum(a.nbytes for a in tensors.values()))},
             "weight_map": {t: name for name, shard in zip(names, shards) for t in shard}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names
