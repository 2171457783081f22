"""What a step costs and how fast it went: model FLOPs per token, the devices' peak, MFU, and the
metrics log (metrics.jsonl in the run)."""

from __future__ import annotations

import time

import jax
import numpy as np

from harvest.model.config import ModelConfig

# Dense bf16 peak FLOP/s per JAX device, from the vendors' spec sheets (TPU: one device per chip).
PEAK_FLOPS = {
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
    "NVIDIA H100": 989e12,
    "NVIDIA H200": 989e12,
    "NVIDIA A100": 312e12,
}


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """6 x the matmul params a token meets (forward 2, backward 4) plus attention's score and value
    products (12 x seq x heads x head_dim per layer); remat's recomputation is not counted (MFU, not HFU)."""
    D, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    attn = D * cfg.head_dim * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    matmul = cfg.num_layers * (attn + 3 * D * I) + D * V
    return 6.0 * matmul + 12.0 * cfg.num_layers * seq_len * cfg.num_heads * cfg.head_dim


def peak_flops_per_device(dtype: str) -> float:
    """The table's number for this accelerator; on CPU (or an unknown one) a measured fp32 matmul rate."""
    kind = jax.devices()[0].device_kind
    for name, peak in PEAK_FLOPS.items():
        if kind.startswith(name):
            return peak if dtype == "bfloat16" else peak / 2
    return _measured_matmul_flops()


def _measured_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    device = jax.local_devices()[0]
    a = jax.device_put(np.random.default_rng(0).standard_normal((n, n), np.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        matmul(a).block_until_ready()
    return 2 * n**3 * repeats / (time.perf_counter() - start)
