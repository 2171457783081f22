"""Preemption agreement bench: steps/s of harvest's training loop (harvest.training.loop.run_steps: a decoder's
train step, each batch placed from the host as the trainer places it) on 2 processes x 4 CPU devices (gloo),
with the processes agreeing on a SIGTERM at every step (one all-gather a step, as before) against at checks
about a second apart (harvest.runtime.distributed.StopAgreement, as now) and every CPU_MOST_AHEAD steps (as now
where a step takes less than 1/CPU_MOST_AHEAD s: on CPU, no further apart), measured in the same run: the same
two processes run each way in turn, every round. The bench chooses the checks by replacing StopAgreement.due;
harvest itself has no such setting. (No row without checks: on CPU, a host that queues ~50 steps of this pod's
collectives hangs the runtime; see distributed.CPU_MOST_AHEAD.)

Run:  .venv/bin/python bench/train_sync.py                      (tiny model, ~5 minutes on 2 busy cores)
      .venv/bin/python bench/train_sync.py --preset small --seq 256 --steps 20
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/shapes.py, bench/table.py
from shapes import PRESETS, hf_fields, packed_segments
from table import show

from harvest.runtime.distributed import CPU_MOST_AHEAD

PROCESSES, DEVICES = 2, 4
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
# (row name, StopAgreement.due as the bench sets it; None: harvest's own)
MODES = {"every step (before)": lambda self, step: True,
         "~1 s apart (now)": None,
         f"every {CPU_MOST_AHEAD} steps (now, steps < 1/{CPU_MOST_AHEAD} s)":
             lambda self, step: step % CPU_MOST_AHEAD == 0}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=["tiny", *sorted(PRESETS)], help="model shape (default tiny)")
    p.add_argument("--batch", type=int, default=8, help="global rows per step (default 8)")
    p.add_argument("--seq", type=int, default=64, help="tokens per row (default 64)")
    p.add_argument("--steps", type=int, default=96, help="steps per timed run (default 96)")
    p.add_argument("--rounds", type=int, default=3, help="timed runs of each way, interleaved (default 3)")
    p.add_argument("--worker", type=str, default=None, help=argparse.SUPPRESS)  # COORDINATOR,PROCESS_ID
    return p.parse_args()


class NoCheckpoints:
    """What run_steps asks of its checkpoints, with nothing saved: the bench times the steps alone."""

    def steps(self) -> list[int]:
        return []

    def wait(self) -> None:
        pass

    def close(self) -> None:
        pass


def worker(args: argparse.Namespace) -> None:
    """One process of the pod: each round, `--steps` steps each way; process 0 prints the seconds as JSON."""
    from harvest.runtime import distributed

    coordinator, pid = args.worker.split(",")
    distributed.initialize(coordinator, PROCESSES, int(pid))
    import jax
    import numpy as np

    from harvest.decoder.config import TrainConfig
    from harvest.decoder.optimizer import learning_rate, make_optimizer
    from harvest.decoder.step import batch_sharding, init_state, make_step, state_shardings
    from harvest.model.config import ModelConfig
    from harvest.model.init import init_params
    from harvest.runtime.mesh import make_mesh
    from harvest.training.loop import run_steps

    fields = {**hf_fields("small"), **TINY} if args.preset == "tiny" else hf_fields(args.preset)
    model = ModelConfig.from_hf(fields, f"preset {args.preset}")
    mesh = make_mesh(f"fsdp={jax.device_count()}")  # harvest train's default mesh
    shape = (args.batch, args.seq)
    cfg = TrainConfig(data="-", out="-", shape=fields, tokenizer="-", steps=10**6, warmup=10)
    optimizer = make_optimizer(cfg)
    params = init_params(model, 0, mesh)
    shardings = state_shardings(optimizer, model, mesh, jax.eval_shape(lambda p: p, params))
    step_fn = make_step(model, mesh, optimizer, shardings, compute_dtype="float32", remat=cfg.remat, grad_accum=1,
                        batch_shape=shape, lr_at=learning_rate(cfg))
    sharding = batch_sharding(shape, mesh)
    tokens = np.random.default_rng(0).integers(0, model.vocab_size, shape).astype(np.int32)
    segments = packed_segments(*shape, mean_len=args.seq // 3)
    state = [init_state(params, optimizer, shardings)]

    def advance(at: int) -> None:  # as DecoderTrainer.advance: the batch placed from the host, metrics left
        placed = [jax.make_array_from_callback(shape, sharding, lambda index, a=a: a[index])
                  for a in (tokens, segments)]
        state[0], _ = step_fn(state[0], *placed)

    def run(due) -> tuple[float, int]:
        """Seconds for `--steps` steps through run_steps, up to the last one done on the device; checks made."""
        checks = []
        stop = distributed.StopAgreement.stop

        def counted(self, step: int, notice: bool) -> bool:
            checks.append(step)
            return stop(self, step, notice)

        with contextlib.ExitStack() as patches:
            patches.enter_context(mock.patch.object(distributed.StopAgreement, "stop", counted))
            if due is not None:
                patches.enter_context(mock.patch.object(distributed.StopAgreement, "due", due))
            start = time.perf_counter()
            run_steps(0, args.steps, advance, lambda at: None, checkpoints=NoCheckpoints(), every=args.steps,
                      saved_at=None, name="bench-train-sync")
            jax.block_until_ready(state[0])
            return time.perf_counter() - start, len(checks)

    for _ in range(3):  # compile and warm up
        advance(0)
    jax.block_until_ready(state[0])
    seconds: dict[str, list[float]] = {name: [] for name in MODES}
    checks: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, due in MODES.items():
            took, checks[name] = run(due)
            seconds[name].append(took)
    if jax.process_index() == 0:
        print(json.dumps({"seconds": seconds, "checks": checks, "devices": jax.device_count(),
                          "layers": model.num_layers, "hidden": model.hidden_size}), flush=True)
    distributed.leave(0)


def pod(args: argparse.Namespace) -> dict:
    """Run this script as 2 processes x 4 CPU devices; process 0's results."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_PROCESS_COUNT", "JAX_PROCESS_INDEX")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}", JAX_PLATFORMS="cpu")
    flags = ["--preset", args.preset, "--batch", str(args.batch), "--seq", str(args.seq), "--steps",
             str(args.steps), "--rounds", str(args.rounds)]
    procs = [subprocess.Popen([sys.executable, __file__, *flags, "--worker", f"127.0.0.1:{port},{pid}"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
             for pid in range(PROCESSES)]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"a worker failed: exit codes {[p.returncode for p in procs]}; run with --worker to see why")
    return json.loads(outputs[0].strip().splitlines()[-1])


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    result = pod(args)
    before = statistics.median(result["seconds"][next(iter(MODES))])
    rows = []
    for name, seconds in result["seconds"].items():
        median = statistics.median(seconds)
        rows.append([name, f"{result['checks'][name]}", f"{args.steps / median:,.1f}",
                     f"{args.steps / min(seconds):,.1f}", f"{before / median:.2f}x"])
    load = open("/proc/loadavg").read().split()[0]
    footer = (f"{args.preset}: {result['layers']} layers, d={result['hidden']}; {args.batch} rows x {args.seq} a step; "
              f"mesh fsdp={result['devices']} over {PROCESSES} processes x {DEVICES} CPU devices (gloo); "
              f"{args.steps} steps a run, {args.rounds} runs each, interleaved; steps/s up to the last step done on "
              f"the device; x before: against the median of a check every step. Load average {load}.")
    show("harvest training loop on 2 processes: steps/s by how often they agree on a SIGTERM",
         ["agreement", "checks a run", "median steps/s", "best steps/s", "x before"], rows, footer)


if __name__ == "__main__":
    main()
