"""What a token costs: matmul FLOPs of the weights it meets plus attention's score and value products, for the
MFU that training logs, the benches and the on-paper model (docs/performance.md).

Attention costs 4 x heads x head_dim FLOPs per (query, key) pair a layer computes (q.k and the weighted sum of v,
2 FLOPs per multiply-add each). How many keys a query meets is the kernel's business: a dense [seq, seq] product
computes all seq of them; a packed row whose samples attend within themselves needs (len + 1) / 2 on average
per sample (`causal_context`), which block-sparse, splash and Pallas kernels approach up to their block size.
"""

from __future__ import annotations

import numpy as np

from harvest.model.config import ModelConfig


def matmul_params(cfg: ModelConfig, layers: int | None = None, *, head: bool = False) -> int:
    """Weights a token multiplies through in `layers` decoder layers (all by default), plus the LM head."""
    d, hd = cfg.hidden_size, cfg.head_dim
    per_layer = d * hd * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * d * cfg.intermediate_size
    return (cfg.num_layers if layers is None else layers) * per_layer + (d * cfg.vocab_size if head else 0)


def forward_flops_per_token(cfg: ModelConfig, context: float, layers: int | None = None, *,
                            head: bool = False) -> float:
    """Forward FLOPs of one token that meets `context` keys in each of `layers` layers."""
    n = cfg.num_layers if layers is None else layers
    return 2.0 * matmul_params(cfg, n, head=head) + 4.0 * n * cfg.num_heads * cfg.head_dim * context


def causal_context(lengths: np.ndarray) -> float:
    """Mean keys per query when each sample of these lengths attends causally within itself."""
    lengths = np.asarray(lengths, np.float64)
    return float((lengths * (lengths + 1) / 2).sum() / lengths.sum())


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """3 x the forward with the LM head (forward 1, backward 2), counting the whole [seq, seq] attention as the
    dense step computes it; remat's recomputation is not counted (MFU, not HFU)."""
    return 3.0 * forward_flops_per_token(cfg, seq_len, head=True)
