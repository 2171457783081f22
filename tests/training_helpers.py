"""What the trainers' tests share: a tiny decoder shape, a run's metrics log and newest params, and trees
of params compared leaf by leaf."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# A llama small enough to train in seconds on CPU: 320 tokens, 2 layers 32 wide, 4 heads over 2 KV heads.
TINY_SHAPE = {"model_type": "llama", "vocab_size": 320, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "tie_word_embeddings": False}


def metrics(out: str | Path) -> list[dict]:
    """The run's metrics.jsonl, a record a logged step."""
    return [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines()]


def restored_params(out: str | Path, step: int | None = None) -> dict:
    """The params of checkpoint `step` (the newest if None) of a decoder or SAE run."""
    import jax

    from harvest.training.checkpoint import CHECKPOINTS, Checkpoints

    checkpoints = Checkpoints(f"{out}/{CHECKPOINTS}", every=1, keep=1, read_only=True)
    params = jax.device_get(checkpoints.restore_params(step if step is not None else checkpoints.steps()[-1]))
    checkpoints.close()
    return params


def assert_trees_close(ours: dict, theirs: dict, rtol: float) -> None:
    """Same tree structure, each leaf within rtol, and within rtol of the leaf's largest magnitude."""
    import jax

    flat_ours, flat_theirs = jax.tree_util.tree_leaves_with_path(ours), jax.tree.leaves(theirs)
    assert len(flat_ours) == len(flat_theirs)
    for (path, a), b in zip(flat_ours, flat_theirs):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        scale = float(np.max(np.abs(b))) if b.size else 1.0
        np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * (scale or 1.0), err_msg=jax.tree_util.keystr(path))


def train(**settings) -> dict:
    """`harvest train` of a decoder in this process; its summary."""
    from harvest.decoder.config import TrainConfig
    from harvest.training.run import train as run_train

    return run_train(TrainConfig(**settings).validate())
