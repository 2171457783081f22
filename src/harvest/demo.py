"""The embedded default: a deterministic tiny Qwen2-architecture checkpoint, written offline.

Weights come from a fixed numpy seed and the config is in the transformers-v4 dialect that hub Qwen2.5
checkpoints carry, so the demo exercises the same loading path as a real model, with no download.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

DEMO_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 176,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "sliding_window": 32768,
    "use_sliding_window": False,
    "max_window_layers": 4,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}
DEMO_SEED = 20261121


def cache_dir() -> Path:
    return Path(os.environ.get("HARVEST_CACHE", Path.home() / ".cache" / "harvest"))


def demo_checkpoint(root: Path | None = None) -> Path:
    """Write (once) and return the demo checkpoint directory; the same bytes on every machine."""
    path = (root or cache_dir()) / "demo-qwen2"
    if (path / "model.safetensors").exists():
        return path
    path.mkdir(parents=True, exist_ok=True)
    c = DEMO_CONFIG
    D, I, V = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = D // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    rng = np.random.default_rng(DEMO_SEED)

    def normal(*shape, std=0.08):
        return rng.normal(0.0, std, shape).astype(np.float32)

    tensors = {"model.embed_tokens.weight": normal(V, D, std=0.5), "model.norm.weight": 1 + normal(D, std=0.05)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": 1 + normal(D, std=0.05),
            p + "post_attention_layernorm.weight": 1 + normal(D, std=0.05),
            p + "self_attn.q_proj.weight": normal(q, D), p + "self_attn.q_proj.bias": normal(q, std=0.02),
            p + "self_attn.k_proj.weight": normal(kv, D), p + "self_attn.k_proj.bias": normal(kv, std=0.02),
            p + "self_attn.v_proj.weight": normal(kv, D), p + "self_attn.v_proj.bias": normal(kv, std=0.02),
            p + "self_attn.o_proj.weight": normal(D, q),
            p + "mlp.gate_proj.weight": normal(I, D), p + "mlp.up_proj.weight": normal(I, D),
            p + "mlp.down_proj.weight": normal(D, I),
        }
    tmp = path / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(c, indent=2))
    tmp.rename(path / "model.safetensors")
    return path
