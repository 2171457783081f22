"""The device check's speed stages: forward and train tokens/s and MFU per kernel (bench/forward.py's and
bench/train.py's rows), whole-process `harvest extract` against the HF script, and bench/host.py's host stage."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chip_stage import emit, hf_model_args
from limited import failure, run_limited

HERE = Path(__file__).resolve().parent
PALLAS_SWEEP = "table,128x128w4s2,64x64w4s2,128x64w4s3,128x128w8s3,64x128w4s3"  # bench/forward.py --pallas-blocks


def forward_setup(args: argparse.Namespace) -> tuple[str, list[tuple[int, int]], str]:
    """(preset, shapes, points) of the forward stages, the e2e stage's capture points included."""
    return ("small", [(2, 128)], "resid_post:1,2") if args.smoke else ("0.5b", [(16, 2048)], "resid_post:6,12")


def stage_forward(args: argparse.Namespace, work: Path, preset: str | None = None) -> None:
    from forward import kernel_rows
    from shapes import model_config

    from harvest.model import default_compute_dtype

    smoke_preset, shapes, points = forward_setup(args)
    preset = preset or smoke_preset
    if preset == "7b":
        shapes, points = [(8, 2048)], "resid_post:14"
    kinds = "auto" if preset == "7b" else "dense,auto"
    # on a GPU the pallas-gpu tiles are swept: the table's first (what harvest runs), then the candidates
    sweep = "table" if args.smoke or preset == "7b" or args.backend != "gpu" else PALLAS_SWEEP
    start = time.perf_counter()
    for shape, kind, _, best, tokens, ratio, mfu in kernel_rows(model_config(preset), shapes, kinds, points, 300,
                                                                default_compute_dtype(), 2 if args.smoke else 5,
                                                                sweep):
        if best == "failed" or not tokens:
            emit(f"forward {preset}", f"{shape} {kind}", "FAILED", f"{best}: {tokens}"[:200])
            continue
        emit(f"forward {preset}", f"{shape} {kind}", f"{tokens} tokens/s/chip, MFU {mfu}",
             f"best {best} ms{', ' + ratio + ' dense' if ratio and kind != 'dense' else ''}; {points}; "
             f"stage {time.perf_counter() - start:.0f} s")


def stage_train(args: argparse.Namespace, work: Path) -> None:
    from train import step_rows

    from harvest.model import default_compute_dtype

    preset, batch, seq = ("small", 2, 128) if args.smoke else ("0.5b", 16, 2048)
    rows, _ = step_rows(preset, batch, seq, 300, "dense,auto" if args.smoke else "auto,dense", "layer",
                        default_compute_dtype(), None, 2 if args.smoke else 4)
    for kind, what, _, best, tokens, ratio, mfu in rows:
        emit(f"train {preset}", f"{batch}x{seq} {kind}, {what}", f"{tokens} tokens/s/chip, MFU {mfu}",
             f"best {best} ms{', ' + ratio + ' dense' if ratio and kind != 'dense' else ''}")


def stage_extract(args: argparse.Namespace, work: Path) -> None:
    from workloads import build_model, harvest_command, hf_command, resid_layers, workload_texts, write_data

    on_chip = args.backend != "cpu"  # not jax.default_backend(): this process must leave the chip to harvest
    shape = hf_model_args(args.smoke, small=False)
    model_dir = build_model(shape, work)
    texts = workload_texts("lognormal", 40 if args.smoke else 2000)
    data = write_data(texts, work / "e2e.jsonl")
    _, [(batch, seq)], points = forward_setup(args)
    layers = resid_layers(points, shape.layers)
    wide_layers = list(range(0, shape.layers, max(1, shape.layers // 8)))[:8]
    wide = f"resid_post:{','.join(map(str, wide_layers))}"
    dtype = "bfloat16" if on_chip else "float32"
    limit = 70 if args.smoke else 110
    runs = {}
    commands = (
        ("harvest extract --attention auto", harvest_command(model_dir, data, work / "e2e-harvest", points, seq,
                                                             batch, "--attention", "auto", compute_dtype=dtype)),
        ("harvest extract, compiled programs cached", harvest_command(model_dir, data, work / "e2e-harvest",
                                                                      points, seq, batch, "--attention", "auto",
                                                                      compute_dtype=dtype)),
        (f"harvest extract, {len(wide_layers)} layers", harvest_command(model_dir, data, work / "e2e-wide", wide,
                                                                        seq, batch, "--attention", "auto",
                                                                        compute_dtype=dtype)),
        (f"HF script ({dtype}, sdpa)", hf_command(model_dir, data, work / "e2e-hf", layers, seq, batch, dtype=dtype)))
    if args.smoke:  # the two reruns take the first run's path with other arguments: --smoke spares their start-ups
        commands = tuple(c for c in commands if not c[0].startswith("harvest extract,"))
    for i, (name, cmd) in enumerate(commands):
        log = work / f"e2e-{i}-{name.split()[0]}.log"
        with utilisation() as busy:
            code, seconds = run_limited(cmd, limit, log)
        if code != "0":
            emit("extract", name, "FAILED", failure(code, limit, log))
            continue
        text = log.read_text()
        if name.startswith("harvest"):
            tokens = int(re.search(r"this run (\d+) tokens", text).group(1))
            pipeline = float(re.search(r"\(([\d,]+) tokens/s", text).group(1).replace(",", ""))
        else:
            done = json.loads(text.strip().splitlines()[-1])
            tokens, pipeline = done["tokens"], done["tokens"] / done["pipeline"]
        captured = len(wide_layers) if name.endswith(" layers") else len(layers)
        gbps = pipeline * captured * shape.hidden * 2 / 1e9
        chip_busy = f"; chip busy {busy[0]:.0f}% (mean of {busy[1]} samples after start-up)" if busy else ""
        runs[name] = seconds
        emit("extract", name, f"{seconds:.1f} s whole process", f"{tokens:,} tokens: {tokens / seconds:,.0f} "
             f"tokens/s whole process, {pipeline:,.0f} after start-up ({gbps:.2f} GB/s of captures){chip_busy}; "
             f"{captured} layers, {batch}x{seq}")
        started = re.search(r"^start-up: (.*)$", text, re.M)
        if started:
            emit("extract", "  start-up of the run above", started.group(1).split("(")[0].strip(),
                 started.group(1)[len(started.group(1).split("(")[0]):].strip())
        if name == "harvest extract --attention auto":
            emit("extract", "harvest pipeline", f"{pipeline:,.0f} tokens/s", "over the forward alone: see below")
    hf = next((seconds for name, seconds in runs.items() if name.startswith("HF")), None)
    if hf and "harvest extract --attention auto" in runs:
        harvest = runs["harvest extract --attention auto"]
        emit("extract", "harvest / HF script", f"{hf / harvest:.2f}x", "whole process, start-up included")


@contextlib.contextmanager
def utilisation():
    """Samples the GPU's utilisation every 0.5 s while the block runs (nvidia-smi, where there is one): yields a
    list that holds (mean %, samples) afterwards, from the first busy sample on (start-up left out), or stays
    empty."""
    found: list = []
    if not shutil.which("nvidia-smi"):
        yield found
        return
    with tempfile.TemporaryFile("w+") as out:
        sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                    "-lms", "500"], stdout=out, stderr=subprocess.DEVNULL)
        try:
            yield found
        finally:
            sampler.terminate()
            sampler.wait()
            out.seek(0)
            samples = [float(x) for x in out.read().split() if x.replace(".", "").isdigit()]
            busy = samples[next((i for i, x in enumerate(samples) if x > 0), len(samples)):]  # start-up left out
            if busy:
                found[:] = [sum(busy) / len(busy), len(busy)]


def stage_host(args: argparse.Namespace, work: Path) -> None:
    """bench/host.py on all of this host's cores, then on 2 (this project's CI machine): its whole table goes to
    the stage's log, the host stage's row to the check's table."""
    cores = len(os.sched_getaffinity(0))
    # the H100's host took ~70 s and ~50 s for these with bf16 alone, most of it the feeder's corpus (built by a
    # Python loop) and its BPE; fp8 captures as the device hands them add a stage run of ~2 s, on all cores
    for n, limit in [(cores, 80)] + ([(2, 60)] if cores > 2 else []):
        log = work / f"host-{n}.log"
        dtypes = "bfloat16,float8_e4m3fn" if n == cores else "bfloat16"
        cmd = [sys.executable, str(HERE / "host.py"), "--cores", str(n), "--repeats", "1", "--batches", "6",
               "--feeder-mb", "2", "--vocab", "30000", "--dtypes", dtypes, "--out", str(work)]
        code, seconds = run_limited(cmd, limit, log, env={"COLUMNS": "200"})
        if code != "0":
            emit("host", f"{n} cores", "FAILED", failure(code, limit, log))
            continue
        text = log.read_text(errors="replace")
        print(text, flush=True)
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip().strip("│").split("│")]
            if len(cells) == 6 and cells[0].startswith(("host stage", "floor", "feeder")):
                emit("host", f"{n} cores: {cells[0]}", cells[3], f"per core {cells[4]}; vs floor {cells[5] or '-'}")
            elif len(cells) == 8 and cells[4].replace(",", "").isdigit():  # the table by storage dtype
                emit("host", f"{n} cores: {cells[0]}", f"{cells[4]} tokens/s",
                     f"{cells[3]} GB/s; vs bf16 {cells[6] or '-'}; vs floor {cells[7] or '-'}")
