"""What the 8-bit storage tests share (tests/store/test_quant.py, tests/extract/test_device_quant.py): the
codes, the tensors they extract, the documented error bound, texts to extract and the stats check."""

from __future__ import annotations

import numpy as np

CODES = ("int8", "float8_e4m3fn")
NAMES = ("resid_pre.0", "resid_post.1")


def bound(x: np.ndarray, scale: np.ndarray, dtype: str) -> np.ndarray:
    """The documented bound (harvest.store.quant) per element, plus float32 rounding of the product."""
    s = scale[:, None]
    per = s / 2 if dtype == "int8" else np.maximum(np.abs(x) / 16, s * 2.0**-10)
    return per + np.abs(x) * 2.0**-22


def texts(n: int = 40) -> list[dict]:
    rng = np.random.default_rng(3)
    words = "the residual stream holds sparse features that an autoencoder reads back out".split()
    return [{"text": " ".join(rng.choice(words, int(rng.integers(3, 40))))} for _ in range(n)]


def assert_float32_stats(ref, run) -> None:
    """`run`'s stats (of every token, of each sample's first) are those of the float32 run `ref`, to float64
    merge order."""
    for name in NAMES:
        for a, b in ((ref.stats(name), run.stats(name)),
                     (ref.view.first_token_stats(name), run.view.first_token_stats(name))):
            assert a.count == b.count
            np.testing.assert_allclose(b.mean, a.mean, rtol=1e-12, atol=1e-12 * np.abs(a.mean).max())
            np.testing.assert_allclose(b.m2, a.m2, rtol=1e-12)
        assert run.view.first_token_stats(name).count == ref.num_samples
