"""A node's devices in one process: does the host stage keep up with one forward per device?

A GPU node runs one harvest process over its 8 GPUs (a data=8 mesh: 8 slots, each its own streams). The forward
scales with the devices; the host stage (device->host copies, cutting shards) and the commits run on the host's
cores, shared by all of them. This runs the whole extraction (`run_extract`, as `harvest extract` does) of one
workload on 1 and on N CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count, --mesh data=N), each in a
fresh process, alternated for --rounds, and prints one table with the fastest round of each: tokens/s, its ratio
to 1 device measured in the same run, and each stage's share of the pipeline's time with the bound
(harvest.store.bounds). On CPU devices the forwards share the host's cores with the host stage, so N devices
give the forward no more compute than one: the host's share and the bound are what to read here; on a GPU node
the forward scales and the host stage must keep up. The shapes are extract's defaults (8 rows of 2,048 tokens a
device): a row must cost on N devices the time and memory it costs on one (docs/performance.md).

Run:  .venv/bin/python bench/devices.py                       (~3 minutes on 2 idle cores)
      .venv/bin/python bench/devices.py --devices 1,2,8 --texts 800 --dtype float8_e4m3fn
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # table.py, workloads.py
from table import show
from workloads import add_model_args, build_model, workload_texts, write_data

from harvest.store.bounds import Shares

STAGES = ("chip", "host", "storage", "feeder")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default="1,8", help="device counts, the first the baseline (default 1,8)")
    p.add_argument("--texts", type=int, default=2000, help="short texts of 3-120 words (default 2000)")
    p.add_argument("--streams", type=int, default=8, help="streams: at least the largest device count (default 8)")
    p.add_argument("--points", default="resid_post:3-5", help="capture points (default resid_post:3-5)")
    p.add_argument("--dtype", default="bfloat16", help="stored dtype (default bfloat16)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per device per forward (default 8, as extract)")
    p.add_argument("--max-seq-len", type=int, default=2048, help="row length (default 2048, as extract)")
    p.add_argument("--shard-size", default="4MB", help="shard size (default 4MB)")
    p.add_argument("--rounds", type=int, default=2, help="alternated runs of each count (default 2)")
    p.add_argument("--out", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                   help="where runs are written (default /dev/shm: memory, the host stage's bound, not a disk's)")
    add_model_args(p)
    p.add_argument("--child", nargs=3, metavar=("MODEL", "STREAMS", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    args.devices = [int(n) for n in args.devices.split(",")]
    args.shapes = [(args.batch_size, args.max_seq_len)]  # for the model's positions (forward.hf_config)
    if max(args.devices) > args.streams:
        p.error("--streams must be at least the largest device count: each device's slot needs its own streams")
    return args


def child(args: argparse.Namespace) -> None:
    """One extraction on this process's devices (all on the data axis); its summary as JSON on stdout's last line."""
    import jax

    from harvest.config import ExtractConfig
    from harvest.extract import job

    model, streams, out = args.child
    cfg = ExtractConfig(model=model, data=streams, out=out, points=args.points, max_seq_len=args.max_seq_len,
                        batch_size=args.batch_size, long="truncate", dtype=args.dtype, compute_dtype="float32",
                        shard_size=args.shard_size, mesh=f"data={jax.device_count()}", overwrite=True).validate()
    summary = job.run_extract(cfg)
    print(json.dumps({**summary, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def extract_on(args: argparse.Namespace, devices: int, model: Path, streams: Path, root: Path) -> dict:
    out = root / f"out-{devices}"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HARVEST_CACHE": str(root / "cache"),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    done = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", str(model), str(streams), str(out)],
                          env=env, check=True, stdout=subprocess.PIPE, text=True)
    shutil.rmtree(out, ignore_errors=True)
    return json.loads(done.stdout.splitlines()[-1])


def per_second(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:,.0f}" if seconds > 0 else "-"  # "-": not measured (no batch went through)


def host_takes(tokens: int, seconds: float, bytes_per_token: float) -> str:
    """Tokens per second of the host stage's own work, and the bytes per second that stores."""
    if seconds <= 0:
        return "-"
    return f"{tokens / seconds:,.0f} ({tokens / seconds * bytes_per_token / 1e9:.2f} GB/s)"


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    from harvest.data.streams import create_streams

    load = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="harvest-devices-", dir=args.out))
    try:
        model = build_model(args, root)
        data = write_data(workload_texts("short", args.texts), root / "short.jsonl")
        streams = root / "streams"
        create_streams(str(data), args.streams, str(streams))
        runs: dict[int, list[dict]] = {n: [] for n in args.devices}
        for k in range(args.rounds):  # alternated, so that a burst of other work does not hit one count only
            for n in args.devices:
                runs[n].append(extract_on(args, n, model, streams, root))
                r = runs[n][-1]
                print(f"  round {k + 1}, {n} devices: {r['tokens_per_s']:,.0f} tokens/s; {r['bound']}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    best = {n: max(rs, key=lambda r: r["tokens_per_s"]) for n, rs in runs.items()}
    base, peak_base = best[args.devices[0]]["tokens_per_s"], best[args.devices[0]]["peak_rss"]
    rows = [[str(n), f"{r['tokens_this_run']:,}", f"{r['seconds']:.1f}", f"{r['tokens_per_s']:,.0f}",
             f"{r['tokens_per_s'] / base:.2f}x", per_second(r["tokens_this_run"], r["waits"]["window_s"]),
             host_takes(r["tokens_this_run"], r["waits"]["host"] * r["waits"]["window_s"], r["bytes_per_token"]),
             f"{r['bytes_per_token']:,.0f}", f"{r['peak_rss'] / 1e9:.2f}", f"{r['peak_rss'] / peak_base:.2f}x",
             *(f"{r['waits'][s]:.0%}" for s in STAGES), Shares(**r["waits"]).bound or "-"]
            for n, r in best.items()]
    footer = (f"whole extraction (run_extract, compile from harvest's cache after the first run of a count) of "
              f"{args.texts} short texts in {args.streams} streams, each count in its own process with that many "
              f"CPU devices on a data mesh; fastest of {args.rounds} alternated rounds. x 1st: tokens/s over "
              f"{args.devices[0]} device(s) in this run. steady: tokens/s from the first batch (compile and start-up "
              f"out). host takes: tokens per second of the host stage's own work (and the GB/s stored at that "
              f"rate): what it would keep up with. peak GB: the process's peak resident memory (x 1st: over the "
              f"first count's). Shares of the pipeline's time from the first batch "
              f"(harvest.store.bounds): chip = the host waiting on the forward, host = the host stage's own work, "
              f"storage = waiting on commits, feeder = the forward waiting on tokenizing. Qwen2 random weights: "
              f"{args.layers} layers, hidden {args.hidden}; points {args.points}; {args.batch_size} rows of "
              f"{args.max_seq_len} per device; fp32 compute, {args.dtype} stored in {args.out or 'a temp dir'}, "
              f"shards of {args.shard_size}. {os.cpu_count()} cores; load average {load:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after")
    show("one process, N devices: the whole extraction", ["devices", "tokens", "seconds", "tokens/s", "x 1st",
         "steady", "host takes", "B/token", "peak GB", "x 1st", *STAGES, "bound"], rows, footer, columns=180)


if __name__ == "__main__":
    main()
