"""Memory benchmark: does a long extraction's peak RSS stay flat? (bounded queues, nothing accumulating)

Runs `harvest extract` (a subprocess, as a user would) on the lognormal workload of bench/extract.py with
the same random Qwen2 model (width 256, 8 layers, resid_post at 3 middle layers, bf16 storage) for
--minutes, sampling the process's RSS every second from /proc, then stops it. Prints peak RSS after the
first --warmup minutes and at the end, and their ratio (the acceptance bound: within 10%).

Run:  .venv/bin/python bench/rss.py --minutes 20      (the acceptance run)
      .venv/bin/python bench/rss.py --minutes 4 --warmup 1   (a shorter one)
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # workloads.py: model and data; table.py: its printer
from table import show
from workloads import build_model, harvest_command, model_fields, workload_texts, write_data


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=20, help="how long the extraction runs (default 20)")
    p.add_argument("--warmup", type=float, default=2, help="minutes before the reference peak (default 2)")
    p.add_argument("--records", type=int, default=40_000, help="lognormal records (more than the run gets through)")
    p.add_argument("--max-seq-len", type=int, default=1024, help="row length (default 1024)")
    p.add_argument("--shard-size", default="64MB", help="shard size (default 64MB: many commits)")
    return p.parse_args()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    args = parse_args()
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="harvest-rss-") as tmp:
        root = Path(tmp)
        model = build_model(model_fields([(8, args.max_seq_len)]), root)
        data = write_data(workload_texts("lognormal", args.records), root / "data.jsonl")
        cmd = harvest_command(model, data, root / "out", "resid_post:3-5", args.max_seq_len, 8,
                              "--shard-size", args.shard_size)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu"}
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        start = time.monotonic()
        samples: list[tuple[float, int]] = []
        while proc.poll() is None and time.monotonic() - start < args.minutes * 60:
            try:
                samples.append((time.monotonic() - start, rss_bytes(proc.pid)))
            except OSError:
                break
            time.sleep(1.0)
        finished = proc.poll() is not None
        if not finished:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        shards = len(list((root / "out").glob("stream_*/shard_*.json")))
    if finished and proc.returncode != 0:
        sys.exit(f"harvest extract failed ({proc.returncode}): {err.strip()[-2000:]}")
    warm = [rss for t, rss in samples if t <= args.warmup * 60]
    if not warm or len(warm) == len(samples):
        sys.exit(f"the run lasted {samples[-1][0] if samples else 0:.0f} s: not past the {args.warmup} min warm-up "
                 "(more --records)")
    at_warmup, at_end = max(warm), max(rss for _, rss in samples)
    rows = [[f"peak RSS in the first {args.warmup:g} min", f"{at_warmup / 2**20:,.0f} MiB", ""],
            [f"peak RSS over {samples[-1][0] / 60:.1f} min", f"{at_end / 2**20:,.0f} MiB",
             f"{at_end / at_warmup - 1:+.1%}"]]
    for minute in range(int(args.warmup) + 1, int(samples[-1][0] // 60) + 1, max(int(args.minutes // 10), 1)):
        upto = max(rss for t, rss in samples if t <= minute * 60)
        rows.append([f"  peak up to minute {minute}", f"{upto / 2**20:,.0f} MiB", f"{upto / at_warmup - 1:+.1%}"])
    footer = (f"`harvest extract` on lognormal text (bench/extract.py's workload), Qwen2 width 256 x 8 layers, "
              f"resid_post:3-5, bf16, rows of {args.max_seq_len}, shard size {args.shard_size}; {shards} shards "
              f"committed; {'finished' if finished else 'stopped at the time limit'}. RSS sampled every second "
              f"from /proc. Load average {load:.1f} before, {os.getloadavg()[0]:.1f} after.")
    show("harvest extract: peak RSS over time", ["when", "RSS", "vs warm-up"], rows, footer)


if __name__ == "__main__":
    main()
