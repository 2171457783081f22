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
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from chip_stage import rows_in
from limited import failure, run_limited
from table import show

HERE = Path(__file__).resolve().parent
HEADER = ["stage", "case", "result", "detail"]
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

def run_stage(args: argparse.Namespace) -> None:
    """One stage, in this process (a child of the check)."""
    from chip_parity import stage_parity
    from chip_speed import stage_extract, stage_forward, stage_host, stage_train

    work = Path(args.work)
    if args.stage == "forward-7b":
        stage_forward(args, work, preset="7b")
    else:
        {"parity": stage_parity, "forward": stage_forward, "train": stage_train,
         "extract": stage_extract, "host": stage_host}[args.stage](args, work)


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
        rows += rows_in(log)
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
        run_stage(args)
        return
    started = time.perf_counter()
    rows = check(args)
    import jax  # after the stages: this process must not hold the chip while they run

    footer = (f"{'--smoke: tiny shapes, the code paths only' if args.smoke else 'one host'}; "
              f"{jax.device_count()} x {jax.devices()[0].device_kind}, jax {jax.__version__}; "
              f"{time.perf_counter() - started:.0f} s in all")
    show("harvest device check", HEADER, rows, footer, columns=200)


if __name__ == "__main__":
    main()
