"""What the pass keeps per SAE tensor, on the host: the exact, mergeable state of `harvest sae features`.

Per latent: tokens fired (> 0), the sum of its activations, its max, its top-K (value, position), a uniform
sample of its firings (the bottom-m by a hash priority of (shard ordinal, offset, latent): the same tokens
whatever the split, the order or a resume), and an activation histogram over fixed log-spaced bins.
A position is (shard ordinal in the pass's list, token offset in the shard), two int32 (JAX runs without x64).

Sums are exact and associative: each shard's float32 partial sum is added as an integer number of 2^-32
(two int64 words), so ranks merged, or a pass resumed, give the bits one straight pass gives.
A rank's state is one safetensors file (its arrays, and its `Progress` as JSON in the header): one atomic write.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load, save as st_save

# Histogram: 4 bins per octave over [2^-20, 2^20), plus one below and one above. An SAE's activations (raw
# scale) lie well inside: ~1e-3 to ~1e3.
PER_OCTAVE = 4
EDGES = (2.0 ** (np.arange(-20 * PER_OCTAVE, 20 * PER_OCTAVE + 1) / PER_OCTAVE)).astype(np.float32)
NUM_BINS = len(EDGES) + 1  # counts[0]: below EDGES[0]; counts[i]: [EDGES[i-1], EDGES[i]); counts[-1]: above
FRACTION_BITS = 32  # sums are integers of 2^-32
NO_KEY = -1  # a sample slot holding no firing
KEY_FLOOR = 2**23  # the smallest normal float32's bits: keys lie in [KEY_FLOOR, KEY_FLOOR + 2^30)
STATE_VERSION = 1


def fmix32(xp, h):
    """murmur3's 32-bit finalizer, on uint32 arrays of numpy or jax.numpy (`xp`): the same bits in both."""
    h = h ^ (h >> xp.uint32(16))
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> xp.uint32(13))
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> xp.uint32(16))


def sample_key(xp, ordinal, offset, latent):
    """The sample's priority of a firing, as an int32 key (larger is kept first: the bottom of a uniform 30-bit
    hash), offset by KEY_FLOOR: every key's bits are a normal, finite float32 ordered as the key, so the device
    ranks keys with a float top-k (XLA's CPU top-k on int32 sorts, 40x slower). The token's and the latent's
    hashes are mixed once more per (token, latent): one mix per pair on the device. `xp` numpy or jax.numpy; the
    arguments broadcast."""
    u = xp.uint32
    token = fmix32(xp, xp.asarray(ordinal).astype(u) * u(0x9E3779B1) ^ fmix32(xp, xp.asarray(offset).astype(u)
                                                                              * u(0x85EBCA77) + u(0x27D4EB2F)))
    h = fmix32(xp, token ^ fmix32(xp, xp.asarray(latent).astype(u) * u(0xC2B2AE3D) + u(0x165667B1)))
    return (u(KEY_FLOOR + 2**30 - 1) - (h >> u(2))).astype(xp.int32)


def bin_index(xp, acts):
    """The histogram bin of each activation (> 0): how many EDGES are <= it, found from log2 and corrected by
    comparing with the edges themselves (the same bins in numpy and on device)."""
    edges = xp.asarray(EDGES)
    safe = xp.where(acts > 0, acts, 1.0)
    guess = xp.clip(xp.floor(xp.log2(safe) * PER_OCTAVE).astype(xp.int32) + 20 * PER_OCTAVE + 1, 0, len(EDGES))
    lower = edges[xp.clip(guess - 1, 0, len(EDGES) - 1)]
    upper = edges[xp.clip(guess, 0, len(EDGES) - 1)]
    guess = xp.where((guess > 0) & (safe < lower), guess - 1, guess)
    return xp.where((guess < len(EDGES)) & (safe >= upper), guess + 1, guess)


def add_exact(hi: np.ndarray, lo: np.ndarray, partial: np.ndarray) -> None:
    """hi, lo (int64, in place) += float32 `partial` as integers of 2^-FRACTION_BITS (rounded once per partial)."""
    units = np.rint(partial.astype(np.float64) * 2.0**FRACTION_BITS).astype(np.int64)
    hi += units >> FRACTION_BITS
    lo += units & (2**FRACTION_BITS - 1)
    hi += lo >> FRACTION_BITS
    lo &= 2**FRACTION_BITS - 1


def exact_value(hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
    return hi.astype(np.float64) + lo.astype(np.float64) / 2.0**FRACTION_BITS


@dataclasses.dataclass(frozen=True)
class Progress:
    """A rank's place in the pass: the settings that decide its state (a resume must match them), the shards
    listed (per run, {stream: shards}: a resume reads the same ones), how many of this rank's shards are done,
    and the tokens read."""

    settings: dict[str, Any]
    listing: list[dict[str, int]]
    done: int = 0
    tokens: int = 0
    version: int = STATE_VERSION

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "settings": self.settings, "listing": self.listing, "done": self.done,
                "tokens": self.tokens}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Progress:
        return cls(dict(data["settings"]), [{str(s): int(n) for s, n in r.items()} for r in data["listing"]],
                   int(data["done"]), int(data["tokens"]), int(data["version"]))


FIELDS = ("count", "sum_hi", "sum_lo", "max", "top_value", "top_pos", "sample_key", "sample_value", "sample_pos",
          "hist")


@dataclasses.dataclass
class TensorState:
    """One SAE tensor's arrays ([L] ... [L, K, 2]); see the module docstring."""

    count: np.ndarray
    sum_hi: np.ndarray
    sum_lo: np.ndarray
    max: np.ndarray
    top_value: np.ndarray
    top_pos: np.ndarray
    sample_key: np.ndarray
    sample_value: np.ndarray
    sample_pos: np.ndarray
    hist: np.ndarray

    @classmethod
    def empty(cls, latents: int, top: int, sample: int) -> TensorState:
        return cls(np.zeros(latents, np.int64), np.zeros(latents, np.int64), np.zeros(latents, np.int64),
                   np.zeros(latents, np.float32), np.full((latents, top), -np.inf, np.float32),
                   np.full((latents, top, 2), -1, np.int32), np.full((latents, sample), NO_KEY, np.int32),
                   np.zeros((latents, sample), np.float32), np.full((latents, sample, 2), -1, np.int32),
                   np.zeros((latents, NUM_BINS), np.int64))

    @property
    def mean(self) -> np.ndarray:
        """The mean activation over the tokens each latent fired on (0 where it never did)."""
        return exact_value(self.sum_hi, self.sum_lo) / np.maximum(self.count, 1)

    def arrays(self) -> dict[str, np.ndarray]:
        return {f: getattr(self, f) for f in FIELDS}


def save_bytes(states: dict[str, TensorState], progress: Progress) -> bytes:
    """One safetensors file: `{tensor}/{field}` arrays, the progress in its header."""
    arrays = {f"{t}/{f}": np.ascontiguousarray(a) for t, s in states.items() for f, a in s.arrays().items()}
    return st_save(arrays, metadata={"progress": json.dumps(progress.to_json(), sort_keys=True)})


def load_bytes(data: bytes) -> tuple[dict[str, TensorState], Progress]:
    """save_bytes' inverse. ValueError when the bytes are not a features state."""
    import struct

    try:
        (n,) = struct.unpack("<Q", data[:8])
        meta = json.loads(data[8:8 + n]).get("__metadata__") or {}
        progress = Progress.from_json(json.loads(meta["progress"]))
        arrays = st_load(data)
    except (ValueError, KeyError, TypeError, struct.error) as e:
        raise ValueError(f"not a features state ({e})") from None
    tensors = sorted({k.rsplit("/", 1)[0] for k in arrays})
    return {t: TensorState(**{f: arrays[f"{t}/{f}"] for f in FIELDS}) for t in tensors}, progress


def _first(values: np.ndarray, pos: np.ndarray, keep: int, descending: np.ndarray) -> tuple[np.ndarray, ...]:
    """Per latent, the `keep` entries first by `descending` (larger first), then position (earlier first)."""
    order = np.lexsort((pos[..., 1], pos[..., 0], -descending.astype(np.float64)), axis=-1)[:, :keep]
    return order


def merge(parts: list[dict[str, TensorState]]) -> dict[str, TensorState]:
    """The ranks' states as one: counts, sums and histograms added (exactly), max of maxes, top-K by value
    (larger first, then the earlier position), the sample by key (then position), as one rank reading every
    shard keeps them."""
    merged = {}
    for tensor in parts[0]:
        states = [p[tensor] for p in parts]
        hi, lo = sum(s.sum_hi for s in states), sum(s.sum_lo for s in states)
        hi = hi + (lo >> FRACTION_BITS)
        lo = lo & (2**FRACTION_BITS - 1)
        top_v = np.concatenate([s.top_value for s in states], 1)
        top_p = np.concatenate([s.top_pos for s in states], 1)
        key = np.concatenate([s.sample_key for s in states], 1)
        smp_v = np.concatenate([s.sample_value for s in states], 1)
        smp_p = np.concatenate([s.sample_pos for s in states], 1)
        k, m = states[0].top_value.shape[1], states[0].sample_key.shape[1]
        t = _first(top_v, top_p, k, top_v)
        o = _first(smp_v, smp_p, m, key)
        take = np.take_along_axis
        merged[tensor] = TensorState(
            sum(s.count for s in states), hi, lo, np.maximum.reduce([s.max for s in states]),
            take(top_v, t, 1), take(top_p, t[..., None], 1), take(key, o, 1), take(smp_v, o, 1),
            take(smp_p, o[..., None], 1), sum(s.hist for s in states))
    return merged
