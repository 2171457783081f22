"""bench/extract.py's harvest side: `run_extract` in this process, its pipeline rate and its steady rate (every
batch from the first one's dispatch), and whether the forward came from the compile cache."""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np

from harvest.config import ExtractConfig
from harvest.extract import job

CACHE_HITS: list[str] = []  # JAX's persistent compile cache hits so far


def listen_for_cache_hits() -> None:
    jax.monitoring.register_event_listener(
        lambda event, **_: CACHE_HITS.append(event) if event == "/jax/compilation_cache/cache_hits" else None)


class TimedDecoder:
    """Wraps the job's Decoder: timestamps each call's return and counts its real tokens (segment > 0)."""

    def __init__(self, decoder):
        self._decoder = decoder
        self.calls: list[tuple[float, int]] = []

    def __getattr__(self, name):
        return getattr(self._decoder, name)

    def step(self, tokens, segments):
        out = self._decoder.step(tokens, segments)
        self.calls.append((time.perf_counter(), int(np.count_nonzero(segments))))
        return out


def run_harvest(args, model_dir: Path, data: Path, out: Path, seq: int) -> dict:
    wrapped: list[TimedDecoder] = []
    original = job.load_decoder

    def load_timed(*a, **k):
        wrapped.append(TimedDecoder(original(*a, **k)))
        return wrapped[-1]

    cfg = ExtractConfig(model=str(model_dir), data=str(data), out=str(out), points=args.points,
                        max_seq_len=seq, batch_size=args.batch_size, long="truncate",
                        dtype="bfloat16", compute_dtype="float32", shard_size=args.shard_size,
                        overwrite=True).validate()
    job.load_decoder = load_timed
    hits = len(CACHE_HITS)
    try:
        t0 = time.perf_counter()
        summary = job.run_extract(cfg)
        t_end = time.perf_counter()
    finally:
        job.load_decoder = original
    calls = wrapped[0].calls
    return {"wall": t_end - t0, "tokens": summary["tokens_this_run"], "pipeline": summary["seconds"],
            "packing": summary["packing_efficiency"], "steady": t_end - calls[0][0],
            "steady_tokens": sum(n for _, n in calls), "cached": len(CACHE_HITS) > hits}
