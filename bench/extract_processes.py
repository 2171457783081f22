"""bench/extract.py's second table: `harvest extract` and `python bench/hf_loop.py` as whole processes, timed
from start to exit, start-up included."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from workloads import harvest_command, hf_command, resid_layers, workload_texts, write_data


def run_processes(args, model_dir: Path, root: Path, workload: str) -> list[list[str]]:
    """`harvest extract` and `python bench/hf_loop.py` as a user runs them, timed from fork to exit: a short job
    pays each one's start-up (imports, model load, harvest's compile). harvest runs first with an empty compile
    cache (a first job), then with the cache that run left (every later job of the shape); rounds alternate."""
    texts = workload_texts(workload, args.process_texts)
    data = write_data(texts, root / f"process-{workload}.jsonl")
    layers = resid_layers(args.points, args.layers)
    harvest_cmd = harvest_command(model_dir, data, root / "process-harvest", args.points, args.max_seq_len,
                                  args.batch_size, "--shard-size", args.shard_size)
    hf_cmd = hf_command(model_dir, data, root / "process-hf", layers, args.max_seq_len, args.hf_batch_size, args.attn)
    cache = root / "process-cache"
    env = {**os.environ, "HARVEST_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}

    startups: list[str] = []  # harvest's own start-up line (harvest.extract.startup) of each job

    def timed(cmd: list[str]) -> float:
        t = time.perf_counter()
        done = subprocess.run(cmd, env=env, check=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        startups.extend(line for line in done.stdout.splitlines() if line.startswith("start-up:"))
        return time.perf_counter() - t

    seconds: dict[str, list[float]] = {"first": [], "later": [], "hf": []}
    tokens = sum(min(len(t), args.max_seq_len) for t in texts)
    print(f"whole process: {len(texts)} {workload} texts, {tokens:,} tokens", flush=True)
    for k in range(args.rounds):
        shutil.rmtree(cache, ignore_errors=True)
        seconds["first"].append(timed(harvest_cmd))
        seconds["hf"].append(timed(hf_cmd))
        seconds["later"].append(timed(harvest_cmd))
        print(f"  round {k + 1}: harvest {seconds['first'][-1]:.1f} s (compiles), {seconds['later'][-1]:.1f} s "
              f"(compile cache), HF {seconds['hf'][-1]:.1f} s", flush=True)
        for line in startups[-2:]:
            print(f"    harvest {line}", flush=True)
    hf = min(seconds["hf"])
    return [[f"{workload}: {what}", f"{tokens:,}", f"{min(seconds[key]):.1f}", f"{hf / min(seconds[key]):.2f}x"]
            for what, key in (("harvest extract, first job (compiles)", "first"),
                              ("harvest extract, later jobs (compile cache)", "later"),
                              ("python bench/hf_loop.py", "hf"))]
