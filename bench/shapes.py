"""What the benches run on: model shapes (config.json fields; Qwen2.5's as published) and packed rows whose
samples have the lengths users' data has."""

from __future__ import annotations

import numpy as np

from harvest.model.config import ModelConfig

# huggingface.co/Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-7B config.json; "small" fits a CPU.
PRESETS = {
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=2),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}
NAMES = {"0.5b": "Qwen2.5-0.5B", "7b": "Qwen2.5-7B", "small": "small"}


def hf_fields(preset: str) -> dict:
    return {"model_type": "qwen2", "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 32768,
            **PRESETS[preset]}


def model_config(preset: str) -> ModelConfig:
    return ModelConfig.from_hf(hf_fields(preset), f"preset {preset}")


def packed_segments(rows: int, seq: int, mean_len: int, seed: int = 0) -> np.ndarray:
    """Segment ids [rows, seq] (1, 2, ... per sample, 0 for padding) of rows packed with samples whose lengths
    are lognormal (sigma 1) around `mean_len`, as extraction packs them; mean_len 0: one sample per row."""
    if mean_len <= 0:
        return np.ones((rows, seq), np.int32)
    rng = np.random.default_rng(seed)
    segments = np.zeros((rows, seq), np.int32)
    for row in range(rows):
        at, sample = 0, 1
        while at < seq:
            length = int(np.clip(rng.lognormal(np.log(mean_len), 1.0), 8, seq))
            if at + length > seq:
                break  # the packer starts a new row rather than split a sample: the rest is padding
            segments[row, at : at + length] = sample
            at, sample = at + length, sample + 1
    return segments


def mean_context(segments: np.ndarray) -> float:
    """Mean keys per real query when each sample attends causally within itself (harvest.model.flops)."""
    from harvest.model.flops import causal_context

    lengths = np.concatenate([np.bincount(row[row > 0])[1:] for row in segments])
    return causal_context(lengths[lengths > 0])
