"""The device check: one command on one accelerator host (a GPU node or a TPU VM; under 9 minutes) that prints
one table of what an engineer paying for the chip asks first.

  parity    `harvest extract` (--attention dense and auto; fp32 and bf16 compute) on a small random Qwen2
            checkpoint against HF transformers' own activations (fp32, on the CPU) at resid_post of every layer
            but the last, attn_out of the first and mlp_out of the last: the worst relative error
            (max |harvest - HF| / max |HF|, per tensor) against a tolerance (fp32 on a GPU runs TF32 matmuls).
  forward   bench/forward.py's kernel rows: harvest's forward on rows packed with ~300-token samples, per kernel
            (dense and the backend's best), tokens/s per chip and MFU; on a chip also the 7B forward.
  train     bench/train.py's rows: the forward-only loss and a train step (remat layer), per kernel.
  extract   whole processes, start-up included: `harvest extract` and the plain HF script (bench/hf_loop.py:
            bf16 and sdpa on a GPU) on the same random 0.5B-shaped checkpoint and texts, timed from start to
            exit; harvest's own pipeline rate over the forward alone at the same capture points, its start-up
            line, the chip's utilisation sampled during it (nvidia-smi, where there is one), and a second
            harvest run capturing 8 layers: the GB/s the host absorbs when captures outrun it.
  host      bench/host.py on this host (all its cores, then 2): the host stage's GB/s against the floor.

Each stage runs in its own process (the chip's memory is freed between them), and every process the check
starts (stages and each `harvest extract`) runs with Python's faulthandler on under a time limit: at the limit it
gets SIGABRT, so its log (in --logs) ends with every thread's stack, and a row says where to look.

Run:  python bench/chip.py                  (on the accelerator host, from the project's root)
      python bench/chip.py --smoke          (the same code paths on CPU with tiny shapes, well under a minute)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HEADER = ["stage", "case", "result", "detail"]
ROW = "CHIP-ROW "  # a stage's stdout lines that carry a table row (JSON)
PALLAS_SWEEP = "table,128x128w4s2,64x64w4s2,128x64w4s3,128x128w8s3,64x128w4s3"  # bench/forward.py --pallas-blocks
TOLERANCE = {"float32": 2e-3, "bfloat16": 3e-2}  # TF32 matmuls on a GPU give ~1e-3 in fp32
# name: (limit in seconds on a chip, limit with --smoke), in the order they run: what matters most first, so
# that a check cut short by --budget still answers it
STAGES = {"extract": (200, 150), "forward": (130, 90), "train": (100, 90), "host": (140, 0), "parity": (60, 120),
          "forward-7b": (70, 0)}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on any backend (CPU): the code paths, not speed")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)} (default all)")
    p.add_argument("--logs", default=None, help="each process's log here (default: a temp dir, printed)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole check: a stage gets what is left if less than its limit, and one "
                        "with under 20 s left is skipped (default: every stage its full limit)")
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # internal: run one stage in this process
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    p.add_argument("--backend", default="cpu", help=argparse.SUPPRESS)  # jax's, found once by the parent
    args = p.parse_args()
    args.stages = [s for s in args.stages.split(",") if s]
    unknown = set(args.stages) - set(STAGES)
    if unknown:
        p.error(f"--stages: unknown {', '.join(sorted(unknown))}; known are {', '.join(STAGES)}")
    return args


def run_limited(cmd: list[str], limit: float, log: Path, env: dict | None = None,
                group: bool = False) -> tuple[str, float]:
    """Run `cmd` with its output in `log` under `limit` seconds: ("0" or the exit code, or "stalled"), seconds.

    faulthandler is on in the child, so the SIGABRT it gets at the limit writes every thread's stack to the log.
    With `group` the child leads a new process group (a stage: what it starts stays in that group), and a stalled
    one's whole group is killed once its stacks are written (or 15 s after the SIGABRT)."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=group,
                                env={**os.environ, "PYTHONFAULTHANDLER": "1", "PYTHONUNBUFFERED": "1", **(env or {})})
        try:
            code = str(proc.wait(limit))
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
            if group:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
            code = "stalled"
    return code, time.perf_counter() - start


def failure(code: str, limit: float, log: Path) -> str:
    if code == "stalled":
        return f"stalled at its {limit:.0f} s limit: every thread's stack is in {log}"
    tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
    return f"exit {code} ({log}): {tail[0][:160] if tail else 'no output'}"


def emit(*row: str) -> None:
    print(ROW + json.dumps(list(row)), flush=True)


# --- stages (each in its own process) -----------------------------------------------------------------------

def hf_model_args(smoke: bool, small: bool) -> argparse.Namespace:
    """bench/extract.py's model fields: tiny, a small realistic one (head size 64, GQA) or the 0.5B shape."""
    if smoke:
        dims = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, layers=3)
    elif small:
        dims = dict(hidden=256, intermediate=512, heads=4, kv_heads=2, layers=4)
    else:
        dims = dict(hidden=896, intermediate=4864, heads=14, kv_heads=2, layers=24)
    return argparse.Namespace(vocab=320, shapes=[(16, 2048)], **dims)


def stage_parity(args: argparse.Namespace, work: Path) -> None:
    import numpy as np
    import torch
    import transformers
    from extract import build_model, harvest_command, workload_texts, write_data

    from harvest.read import open_run

    model_dir = build_model(hf_model_args(args.smoke, small=True), work)
    texts = workload_texts("short", 6 if args.smoke else 24)
    data = write_data(texts, work / "parity.jsonl")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    points = f"resid_post:0-{n - 2},attn_out:0,mlp_out:{n - 1}"
    # dense matched HF on the first chip measured; the kernels are what changes
    cases = [("float32", "dense"), ("bfloat16", "auto")] if args.smoke else [("float32", "auto"), ("bfloat16", "auto")]
    for dtype, kind in cases:
        out = work / f"parity-{dtype}-{kind}"
        cmd = harvest_command(model_dir, data, out, points, 1024, 4, "--attention", kind, "--dtype", "float32",
                              compute_dtype=dtype)
        log = work / f"parity-{dtype}-{kind}.log"
        limit = 60
        code, seconds = run_limited(cmd, limit, log)
        if code != "0":
            emit("parity", f"{dtype} {kind}", "FAILED", failure(code, limit, log))
            continue
        worst, count = 0.0, 0
        for sample in open_run(str(out)).iter_samples():
            ref = hf_points(model, sample.tokens)
            for name, value in sample.activations.items():
                want = ref[name]
                worst = max(worst, float(np.abs(value - want).max() / (np.abs(want).max() + 1e-6)))
            count += 1
        verdict = "ok" if worst <= TOLERANCE[dtype] and count == len(texts) else "OVER TOLERANCE"
        emit("parity", f"{dtype} {kind}", f"worst rel err {worst:.1e} ({verdict})",
             f"{count}/{len(texts)} samples, {points}; {seconds:.0f} s whole process")


def hf_points(model, tokens) -> dict:
    """HF's activations of one sample by harvest's tensor names: hidden states and forward hooks, fp32."""
    import torch

    got: dict = {}
    layers = model.model.layers
    hooks = [layers[0].self_attn.register_forward_hook(lambda m, a, o: got.__setitem__("attn_out.0", o[0])),
             layers[-1].mlp.register_forward_hook(lambda m, a, o: got.__setitem__(f"mlp_out.{len(layers) - 1}", o))]
    try:
        with torch.no_grad():
            hidden = model(torch.tensor(tokens, dtype=torch.long)[None], output_hidden_states=True).hidden_states
    finally:
        for hook in hooks:
            hook.remove()
    got.update({f"resid_post.{i}": hidden[i + 1] for i in range(len(layers) - 1)})  # the last one is normed
    return {name: value[0].float().numpy() for name, value in got.items()}


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
    from extract import build_model, harvest_command, hf_command, workload_texts, write_data

    on_chip = args.backend != "cpu"  # not jax.default_backend(): this process must leave the chip to harvest
    shape = hf_model_args(args.smoke, small=False)
    model_dir = build_model(shape, work)
    texts = workload_texts("lognormal", 40 if args.smoke else 2000)
    data = write_data(texts, work / "e2e.jsonl")
    _, [(batch, seq)], points = forward_setup(args)
    layers = [int(x) for x in points.split(":")[1].split(",")]
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


def run_stage(args: argparse.Namespace) -> None:
    work = Path(args.work)
    if args.stage == "forward-7b":
        stage_forward(args, work, preset="7b")
    else:
        {"parity": stage_parity, "forward": stage_forward, "train": stage_train,
         "extract": stage_extract, "host": stage_host}[args.stage](args, work)


# --- the check --------------------------------------------------------------------------------------------

def check(args: argparse.Namespace) -> list[list[str]]:
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="harvest-chip-"))
    logs.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE), os.environ.get("PYTHONPATH", "")]),
           "HARVEST_CACHE": str(logs / "cache"), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    rows: list[list[str]] = []
    # Which backend, asked of a child: a process that opens the chip holds it (a TPU) or most of its memory (a GPU).
    backend = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], text=True,
                             capture_output=True, timeout=120).stdout.strip() or "cpu"
    started = time.perf_counter()
    for stage in args.stages:
        limit = STAGES[stage][1 if args.smoke else 0]
        if not limit:
            rows.append([stage, "-", "skipped", "not in --smoke"])
            continue
        if args.budget:
            limit = min(limit, args.budget - (time.perf_counter() - started))
            if limit < 20:
                rows.append([stage, "-", "skipped", f"under 20 s left of --budget {args.budget:.0f}"])
                continue
        work = logs / stage
        work.mkdir(exist_ok=True)
        log = logs / f"{stage}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", stage, "--work", str(work), "--backend",
               backend]
        print(f"{time.strftime('%H:%M:%S')} {stage} (limit {limit} s)", file=sys.stderr, flush=True)
        code, seconds = run_limited(cmd + (["--smoke"] if args.smoke else []), limit, log, env, group=True)
        found = [json.loads(line[len(ROW):]) for line in log.read_text(errors="replace").splitlines()
                 if line.startswith(ROW)]
        rows += found
        if code != "0":
            rows.append([stage, "-", "FAILED", failure(code, limit, log)])
    pipeline = next((r for r in rows if r[:2] == ["extract", "harvest pipeline"]), None)
    forward = next((r for r in rows if r[0].startswith("forward") and r[0] != "forward 7b" and "tokens/s" in r[2]
                    and r[1].split()[1] == resolved_auto(rows)), None)
    if pipeline and forward:
        ratio = number(pipeline[2]) / number(forward[2])
        pipeline[3] = f"{ratio:.0%} of the forward alone ({forward[1]}, same capture points)"
    return rows


def resolved_auto(rows: list[list[str]]) -> str:
    """The kernel `auto` became: the forward rows' last kind (a row's case: "ROWSxSEQ KIND [TILES]")."""
    kinds = [r[1].split()[1] for r in rows if r[0].startswith("forward") and "tokens/s" in r[2]]
    return kinds[-1] if kinds else "auto"


def number(text: str) -> float:
    return float(text.split()[0].replace(",", ""))


def main() -> None:
    args = parse_args()
    if args.stage:
        sys.path.insert(0, str(HERE))  # bench/forward.py, train.py, extract.py, shapes.py
        run_stage(args)
        return
    started = time.perf_counter()
    rows = check(args)
    import jax  # after the stages: this process must not hold the chip while they run

    sys.path.insert(0, str(HERE))
    from table import show

    if not sys.stdout.isatty():  # rich would wrap the table at 100 columns
        os.environ.setdefault("COLUMNS", "200")
    footer = (f"{'--smoke: tiny shapes, the code paths only' if args.smoke else 'one host'}; "
              f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}; "
              f"{time.perf_counter() - started:.0f} s in all")
    show("harvest device check", HEADER, rows, footer)


if __name__ == "__main__":
    main()
