"""Bucket benchmark: how fast a worker's shard data objects reach GCS and S3, against local disk in the same run.

Shard-sized objects (a list of parts, as the Committer hands them: a small header, then the tensors) go through
`Storage.write_bytes`, several at once (`--in-flight`, default each Storage's `writes_in_flight`, as the
Committer runs them), to:

- local disk: Storage on a temp directory (temp file, fsync, rename): the baseline;
- fake-gcs-server (Go, in memory) and moto's S3 server (Python), both on 127.0.0.1 (tests/storage_servers.py
  starts them, as the tests do); `s3-put` is S3 with multipart off, every object one PUT (moto copies a
  multipart object's parts together: that row tells its cost from the client's);
- the same servers through raw HTTP (`http.client`, one connection per thread, one request per object: a GCS
  media upload, an S3 PUT): what the server alone absorbs, with no client library around the bytes.

The table gives GB/s per target and size, the bucket path's ratio to local disk (the issue's target: >= 0.8)
and to its server's raw floor (the client's own cost, with the emulator's taken out), this process's CPU
seconds per GB (the client's cost, which carries over to a real VM), and how busy fsspec's one event-loop
thread was (every gcsfs/s3fs request of a process runs on it: its ceiling). On one machine client, server and
disk share the cores: read the ratios, not the absolute numbers.

Run:  .venv/bin/python bench/bucket.py                 (~2-4 minutes on 2 CPU cores)
      .venv/bin/python bench/bucket.py --tensors 1100  (an 8-bit shard's ~1,100 parts)
      .venv/bin/python bench/bucket.py --sizes 64MB --objects 4 --repeats 1
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import os
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/table.py
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # storage_servers.py: the test servers

import storage_servers as servers  # noqa: E402
from table import show  # noqa: E402

from harvest.storage import Storage  # noqa: E402
from harvest.storage.s3 import S3Backend  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="64MB,256MB", help="object sizes (default 64MB,256MB)")
    p.add_argument("--objects", type=int, default=6, help="objects written per size and target (default 6)")
    p.add_argument("--in-flight", type=int, default=None,
                   help="objects written at once (default: the Storage's writes_in_flight)")
    p.add_argument("--repeats", type=int, default=2, help="best of this many passes (default 2)")
    p.add_argument("--tensors", type=int, default=4, help="tensors (parts after the header) per object (default 4)")
    p.add_argument("--targets", default="local,gs,gs-raw,s3,s3-put,s3-raw",
                   help="which rows (default all; s3-put: S3 with multipart off, every object one PUT)")
    p.add_argument("--dir", default=None, help="local directory for the disk baseline (default: a temp dir)")
    return p.parse_args()


def parse_size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    for unit, scale in units.items():
        if text.upper().endswith(unit):
            return int(float(text[:-len(unit)]) * scale)
    return int(text)


def shard_parts(size: int, tensors: int, seed: int) -> list:
    """One shard's parts as the Committer hands them: a header, then uint8 views of the tensors' bytes."""
    body = np.random.default_rng(seed).integers(0, 256, size - 256, dtype=np.uint8)
    return [os.urandom(256), *np.array_split(body, tensors)]


def loop_cpu() -> float:
    """CPU seconds so far of fsspec's IO thread, the one event loop every gcsfs/s3fs request runs on (0 before
    it exists)."""
    import fsspec.asyn

    thread = fsspec.asyn.iothread[0]
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident)) if thread is not None else 0.0


def timed(jobs: list[Callable[[], None]], in_flight: int) -> tuple[float, float, float]:
    """(wall seconds, this process's CPU seconds, the IO loop thread's CPU seconds) to run `jobs` on
    `in_flight` threads (all of them: the first error is raised)."""
    start, cpu, loop = time.perf_counter(), time.process_time(), loop_cpu()
    with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        for f in [pool.submit(job) for job in jobs]:
            f.result()
    return time.perf_counter() - start, time.process_time() - cpu, loop_cpu() - loop


def storage_jobs(storage: Storage, names: list[str], objects: list[list]) -> list[Callable[[], None]]:
    return [lambda n=n, o=o: storage.write_bytes(n, o) for n, o in zip(names, objects)]


class RawPut:
    """One object by plain HTTP, a connection per thread: what the server absorbs without a client library."""

    def __init__(self, endpoint: str, request: Callable[[str], tuple[str, str]]):
        host, port = endpoint.split("//", 1)[1].split(":")
        self.host, self.port, self.request = host, int(port), request
        self._local = threading.local()

    def __call__(self, name: str, parts: list) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=600)
        method, url = self.request(name)
        size = sum(memoryview(p).nbytes for p in parts)
        conn.putrequest(method, url)
        conn.putheader("Content-Length", str(size))
        conn.putheader("Content-Type", "application/octet-stream")
        conn.endheaders()
        for p in parts:
            conn.send(memoryview(p).cast("B"))
        reply = conn.getresponse()
        reply.read()
        if reply.status >= 300:
            raise OSError(f"{method} {url}: HTTP {reply.status}")


def raw_jobs(put: RawPut, keys: list[str], objects: list[list]) -> list[Callable[[], None]]:
    return [lambda k=k, o=o: put(k, o) for k, o in zip(keys, objects)]


def main() -> None:
    args = parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    targets = args.targets.split(",")
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="bucket-bench-", dir=args.dir) as tmp:
        logs = Path(tmp) / "logs"
        logs.mkdir()
        gcs = servers.start_fake_gcs_server(servers._fake_gcs_server_binary(), logs)
        s3 = servers.start_moto_server(servers._bin("moto_server"), logs)
        os.environ.update(servers.gcs_environ(gcs) | servers.s3_environ(s3))
        try:
            rows = measure(args, sizes, targets, Path(tmp), gcs, s3)
        finally:
            gcs.stop()
            s3.stop()
    load = os.getloadavg()
    show(f"Bucket path vs local disk ({cores} cores, load {load[0]:.2f}/{load[1]:.2f}, {args.objects} objects a "
         f"size, best of {args.repeats})",
         ["target", "size", "in flight", "GB/s", "vs local", "vs raw server", "client CPU s/GB", "IO loop busy"],
         rows,
         "local: Storage to a temp dir (fsync, rename). gs/s3: Storage.write_bytes to fake-gcs-server / moto on "
         "127.0.0.1.\nraw: the same bytes by plain HTTP, one request per object: the emulator's own bound.\n"
         "client CPU s/GB: this process's CPU (every thread; the servers are other processes) per GB written.\n"
         "IO loop busy: the share of the wall time fsspec's one event-loop thread (every gcsfs/s3fs request) ran.")


def measure(args, sizes: list[int], targets: list[str], tmp: Path, gcs, s3) -> list[list[str]]:
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    servers.create_gcs_bucket(gcs, bucket)
    servers.create_s3_bucket(s3, bucket)
    stores = {"local": Storage(str(tmp / "out")), "gs": Storage(f"gs://{bucket}/run"),
              "s3": Storage(f"s3://{bucket}/run"), "s3-put": Storage(f"s3://{bucket}/run", backend=S3Backend())}
    stores["s3-put"].backend.part_size = 5 * 2**30  # S3's largest part: below two of them, one PUT
    raw = {"gs-raw": RawPut(gcs.endpoint, lambda k: ("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&"
                                                            f"name=run/{k}")),
           "s3-raw": RawPut(s3.endpoint, lambda k: ("PUT", f"/{bucket}/run/{k}"))}
    rows, best = [], {}
    for size in sizes:
        objects = [shard_parts(size, args.tensors, seed) for seed in range(args.objects)]
        for target in targets:
            store = stores[target.removesuffix("-raw")]
            in_flight = args.in_flight or getattr(store, "writes_in_flight", max(2, len(os.sched_getaffinity(0))))
            store.write_bytes("warm-up", b"x")  # the client's imports and connections, outside the clock
            runs = []
            for _ in range(args.repeats):
                names = [f"stream_00000/shard_{i:06d}-{uuid.uuid4().hex[:8]}.safetensors" for i in range(len(objects))]
                jobs = raw_jobs(raw[target], names, objects) if target in raw else storage_jobs(store, names, objects)
                runs.append(timed(jobs, in_flight))
                with contextlib.suppress(Exception):
                    store.delete_many(names)
            wall, cpu, loop = min(runs)
            gb = size * len(objects) / 1e9
            best[target, size] = gb / wall
            rows.append([target, f"{size / 1e6:.0f} MB", str(in_flight), f"{gb / wall:.2f}", "", "",
                         f"{cpu / gb:.2f}", f"{loop / wall:.0%}" if loop else ""])
        for row in rows[-len(targets):]:
            target = row[0]
            if "local" in targets:
                row[4] = f"{best[target, size] / best['local', size]:.2f}"
            floor = f"{target.split('-')[0]}-raw"
            if floor in targets and target != floor and target != "local":
                row[5] = f"{best[target, size] / best[floor, size]:.2f}"
    return rows


if __name__ == "__main__":
    main()
