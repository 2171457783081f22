"""What checking a whole-shard read costs: `read_shard` (Run.sample, iter_samples, inspect) with each tensor
hashed against the sidecar's checksums as it is decoded, against the same read unchecked (decode only, as it
was before reads were checked).

Writes one synthetic shard (bf16, `--tensors` tensors of width `--width`, `--tokens` tokens) to a local temp
dir, then times both reads in alternating rounds (page cache warm) and prints the median of each.

Run:  .venv/bin/python bench/read_shard.py            (~10 s on 2 CPU cores)
Timings are noisy on a shared machine: the footer prints the load average.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from table import show  # noqa: E402

from harvest.storage import Storage  # noqa: E402
from harvest.store import encoding  # noqa: E402
from harvest.store.records import Sidecar  # noqa: E402
from harvest.store.snapshot import read_shard, shard_path  # noqa: E402


def write_shard(storage: Storage, tensors: int, width: int, tokens: int) -> Sidecar:
    rng = np.random.default_rng(0)
    acts = {f"resid_post.{i}": rng.standard_normal((tokens, width), np.float32).astype(ml_dtypes.bfloat16)
            for i in range(tensors)}
    samples = max(1, tokens // 256)
    lengths = np.full(samples, tokens // samples)
    lengths[-1] += tokens - lengths.sum()
    parts = encoding.shard_parts(acts, np.zeros(tokens, np.int32), lengths, np.arange(samples),
                                 np.zeros(samples, np.int32), {"stream": "0", "shard": "0"})
    sidecar = Sidecar.of_shard(parts, stream=0, shard=0, stats={}, attempt="0123abcd", start=(0, 0),
                               next=(samples, 0), row_start=(samples, 0), samples=samples, tokens=tokens, skipped=[],
                               long={}, final=True, records=samples)
    storage.write_bytes(shard_path(sidecar), b"".join(parts))
    return sidecar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tensors", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    storage = Storage(tempfile.mkdtemp(prefix="harvest-bench-"))
    sidecar = write_shard(storage, args.tensors, args.width, args.tokens)
    reads = {"unchecked (decode only)": lambda: encoding.decode_shard(storage.read_bytes(shard_path(sidecar))),
             "checked (per-tensor digests)": lambda: read_shard(storage, sidecar)}
    times: dict[str, list[float]] = {name: [] for name in reads}
    for _ in range(args.rounds + 1):  # the first round warms the page cache
        for name, read in reads.items():
            start = time.perf_counter()
            read()
            times[name].append(time.perf_counter() - start)
    base = float(np.median(times["unchecked (decode only)"][1:]))
    rows = []
    for name, spent in times.items():
        median = float(np.median(spent[1:]))
        rows.append([name, f"{sidecar.bytes / 2**20:.0f} MiB", f"{args.tensors} x {args.width}", f"{median * 1e3:.1f}",
                     f"{sidecar.bytes / median / 1e9:.2f}", f"{median / base:.2f}x"])
    show("read_shard: one whole shard, local disk (page cache warm)",
         ["read", "shard", "tensors", "ms (median)", "GB/s", "time vs unchecked"], rows,
         f"{args.rounds} rounds, alternating; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
