"""The tokens each latent's decoder direction promotes and suppresses: (W_dec[l] * final-norm weight) @ W_U
(W_U the LM head, or the embedding's transpose where tied), its `count` largest and smallest, computed on the
device a block of latents at a time. Read through harvest's checkpoint loader (the head only, no layer)."""

from __future__ import annotations

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from harvest.sae.features.writer import BLOCK
from harvest.sae.features.vocab import Vocab

log = logging.getLogger(__name__)


class Logits:
    def __init__(self, checkpoint: Path, count: int, vocab: Vocab):
        from harvest.model.config import ModelConfig
        from harvest.model.transformer import final_norm_scale, lm_head
        from harvest.model.weights import load_params

        self.cfg = ModelConfig.from_dir(checkpoint)
        params = load_params(checkpoint, self.cfg, dtype=np.float32, num_layers=1, head=True)  # the head (and layer 0: it reads no fewer)
        self.unembed = lm_head(params, self.cfg)
        self.norm = final_norm_scale(params, self.cfg)
        self.count, self.vocab = min(count, self.cfg.vocab_size), vocab

        def ends(w: jax.Array) -> tuple[jax.Array, ...]:
            scores = (w * self.norm) @ self.unembed
            top, top_ids = jax.lax.top_k(scores, self.count)
            low, low_ids = jax.lax.top_k(-scores, self.count)
            return top, top_ids, -low, low_ids

        self._ends = jax.jit(ends)

    def fits(self, tensor: str, width: int) -> bool:
        """Whether the tensor lives in the residual basis the unembedding reads (said once when not)."""
        if width == self.cfg.hidden_size:
            return True
        log.warning("features: %s is %d wide, the model's residual stream %d: no logits for it", tensor, width,
                    self.cfg.hidden_size)
        return False

    def of(self, w_dec: np.ndarray) -> list[tuple[list[tuple[str, float]], list[tuple[str, float]]]]:
        """Per row of `w_dec` (a block of latents' decoder rows): (top, bottom) as (token, logit) pairs."""
        out = []
        for lo in range(0, len(w_dec), BLOCK):
            rows = np.zeros((BLOCK, w_dec.shape[1]), np.float32)
            part = w_dec[lo:lo + BLOCK]
            rows[:len(part)] = part
            top, top_ids, low, low_ids = jax.device_get(self._ends(jnp.asarray(rows)))
            for j in range(len(part)):
                out.append((list(zip(self.vocab(top_ids[j]), map(float, top[j]))),
                            list(zip(self.vocab(low_ids[j]), map(float, low[j])))))
        return out

