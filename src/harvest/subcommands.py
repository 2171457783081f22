"""What each `harvest` subcommand does with its parsed arguments: build its config (`config_from`, the reverse
of the flags harvest.cli adds per config field), call its job, print what it did, return the exit code."""

from __future__ import annotations

import argparse
import dataclasses


def config_from(args: argparse.Namespace, cls, prefix: str = ""):
    """The `cls` config from --config's YAML and the flags harvest.config.add_flags made of its fields (under `prefix`)."""
    from harvest import config

    return config.build(cls, args.config, {f.name: getattr(args, prefix + f.name) for f in dataclasses.fields(cls)})


def extract(args: argparse.Namespace) -> int:
    from harvest.config import ExtractConfig
    from harvest.extract.job import run_extract

    summary = run_extract(config_from(args, ExtractConfig))
    _print_summary(summary)
    return 0


def train(args: argparse.Namespace) -> int:
    if args.action == "export":
        from harvest.decoder.export import export

        done = export(args.run_url, args.out, args.step)
        print(f"exported step {done['step']} of {args.run_url} to {done['out']}: {done['tensors']} tensors in "
              f"{len(done['files'])} file(s), tokenizer files: {', '.join(done['tokenizer_files']) or 'none'}")
        return 0
    if args.action == "eval":
        import json

        from harvest.trm.evaluate import evaluate

        print(json.dumps(evaluate(args.run_url, args.data, args.split), indent=1))
        return 0
    from harvest.training import kinds

    flags = {f.name: getattr(args, f.name) for f in dataclasses.fields(kinds.KINDS["train"].config())}
    return _train(kinds.train_config(args.config, flags))


def _train(cfg) -> int:
    """Run cfg's trainer and say where it stands; exit 75 when stopped short: a job manager reruns it, it resumes."""
    from harvest.errors import RetryLater
    from harvest.training import kinds
    from harvest.training.run import run

    summary = run(kinds.trainer_for(cfg))
    how = "stopped on SIGTERM, checkpoint saved; rerun to resume" if summary.preempted else "done"
    print(f"{summary.out}: step {summary.step}/{summary.steps} ({how}), {summary.said}, {summary.seconds}s")
    return RetryLater.exit_code if summary.preempted else 0


def puzzles(args: argparse.Namespace) -> int:
    from harvest.puzzles.build import build_puzzles, summary_line
    from harvest.puzzles.config import PuzzlesConfig

    config = config_from(args, PuzzlesConfig)
    print(summary_line(build_puzzles(args.kind, config)))
    return 0


def sae(args: argparse.Namespace) -> int:
    if args.action == "features":
        return _features(args)
    if args.action == "export":
        from harvest.sae.export import export

        done = export(args.sae_url, args.sae_out, args.format, args.step)
        print(f"exported step {done['step']} of {args.sae_url} as {args.format}: {', '.join(done['dirs'])}")
        return 0
    if args.action == "eval":
        import json

        from harvest.sae.evaluate import evaluate

        print(json.dumps(evaluate(args.sae_url, args.sae_run, tokens=args.sae_tokens or 100_000, step=args.step,
                                  model=args.eval_model, data=args.eval_data, max_seq_len=args.eval_max_seq_len,
                                  skip_first=args.sae_skip_first, max_norm=args.sae_max_norm),
                         indent=1))
        return 0
    from harvest.training.kinds import KINDS

    return _train(config_from(args, KINDS["sae"].config(), "sae_"))


def _features(args: argparse.Namespace) -> int:
    """`harvest sae features SAE_RUN --out DIR`, or `harvest sae features serve DIR`."""
    from harvest.errors import UserError
    from harvest.sae.features.config import FeaturesConfig

    if args.features_target == "serve":
        if not args.features_dir:
            raise UserError("harvest sae features serve DIR: give the site's directory (the --out it was built into)")
        from harvest.sae.features.serve import serve

        serve(args.features_dir, args.features_port)
        return 0
    if args.features_dir is not None:
        raise UserError(f"harvest sae features: unexpected {args.features_dir!r} after the SAE run (did you mean "
                        "--out DIR?)")
    if args.features_sae is None:
        args.features_sae = args.features_target
    from harvest.sae.features.build import run_features

    done = run_features(config_from(args, FeaturesConfig, "features_"))
    if not done["built"]:
        print(f"{done['out']}: this rank's part is done; the site is written by the rank that finishes last "
              f"(waiting for rank(s) {', '.join(map(str, done['waiting']))})")
        return 0
    for t in done["tensors"]:
        print(f"{t['tensor']}: {t['latents']:,} latents over {t['tokens']:,} tokens, {t['dead']:,} dead, "
              f"{t['dense']:,} dense (firing on more than {t['dense_above']:g} of tokens)")
    local = "://" not in done["out"]
    print(f"open {done['out']}/index.html" if local else f"wrote {done['out']}/index.html")
    print(f"or serve it: harvest sae features serve {done['out']}" + ("" if local else " (after copying it here)"))
    return 0


def _print_summary(summary: dict) -> None:
    from harvest.store.report import human_bytes

    print(f"wrote {summary['out']}: {summary['samples']} samples, {summary['tokens']} tokens in "
          f"{summary['streams']} streams; this run {summary['tokens_this_run']} tokens in {summary['seconds']}s "
          f"({summary['tokens_per_s']:,.0f} tokens/s, {human_bytes(summary['bytes_per_s'])}/s stored at "
          f"{summary['bytes_per_token']:,.0f} B/token, "
          f"packing efficiency {summary['packing_efficiency']:.1%}, "
          f"{summary['shards_written']} shards)")
    print(f"devices: {summary['devices']}")
    print(summary["startup"])
    print(summary["bound"])
    print(f"long samples: {summary['truncated']} truncated, {summary['chunked']} chunked, "
          f"{summary['skipped_long']} skipped; bad inputs skipped: {summary['skipped'] - summary['skipped_long']}")
    for reason, count in summary["skip_reasons"].items():
        print(f"  {count} x {reason}")
    for example in summary["skip_examples"]:
        print(f"  e.g. {example}")


def streams_create(args: argparse.Namespace) -> int:
    from harvest.data.streams import create_streams

    created = create_streams(args.data, args.num_streams, args.out, overwrite=args.overwrite)
    print(f"wrote {created.num_streams} streams of {created.total} records to {args.out}")
    return 0


def status(args: argparse.Namespace) -> int:
    from harvest.store import report
    from harvest.training import status as training

    table = training.training_status(args.url)  # None: an extraction run
    if args.watch:
        (report if table is None else training).watch(args.url, args.interval, console=_console())
    else:
        _console().print(report.status_table(args.url) if table is None else table)
    return 0


def verify(args: argparse.Namespace) -> int:
    from harvest.store.verify import verify_all

    reports = verify_all(args.urls)
    for report in reports:
        for line in report.lines():
            print(line)
    return 0 if all(r.ok for r in reports) else 1


def inspect(args: argparse.Namespace) -> int:
    from harvest.store import report

    console = _console()
    for renderable in report.inspect(args.url):
        console.print(renderable)
    return 0


def fleet(args: argparse.Namespace) -> int:
    from harvest.fleet import launch, status
    from harvest.fleet.plan import emit, make_plan, plan_table
    from harvest.fleet.sky import SkyJobs
    from harvest.fleet.spec import load_fleet

    plan = make_plan(load_fleet(args.fleet))
    console = _console()
    if args.fleet_command == "plan":
        console.print(plan_table(plan))
        if args.emit:
            print(f"wrote {len(emit(plan, args.emit))} SkyPilot task files to {args.emit}")
        return 0
    jobs = SkyJobs()
    if args.fleet_command == "up":
        launched, kept = launch.up(plan, jobs)
        print(f"launched {len(launched)} workers ({', '.join(w.job_name for w in launched) or 'none'}); "
              f"{len(kept)} already running or done")
    elif args.fleet_command == "down":
        cancelled = launch.down(plan, jobs)
        print(f"cancelled {len(cancelled)} workers ({', '.join(w.job_name for w in cancelled) or 'none'})")
    else:
        return status.show(plan, jobs, watch=args.watch, interval=args.interval, console=console)
    return 0


def demo(args: argparse.Namespace) -> int:
    from harvest.demo import run_demo

    return run_demo(args)


def _console():
    from harvest.console import table_console

    return table_console()
