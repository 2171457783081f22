"""The `harvest` command: parse flags, build the config, call the job. Errors a user can cause print as
one line (exit 2), never a traceback."""

from __future__ import annotations

import argparse
import sys
import time

from harvest.errors import UserError

DEFAULT_DEMO_POINTS = "resid_post:1-3,mlp_out:2"


def _demo(args: argparse.Namespace) -> int:
    import jax
    import numpy as np
    from rich.console import Console
    from rich.table import Table

    from harvest.data.batching import pack_rows
    from harvest.demo import cache_dir, demo_checkpoint
    from harvest.model import load_decoder
    from harvest.runtime.mesh import describe, make_mesh

    console = Console()
    ckpt = demo_checkpoint(args.cache_dir and __import__("pathlib").Path(args.cache_dir))
    mesh = make_mesh(args.mesh or f"data={jax.device_count()}")
    decoder = load_decoder(ckpt, args.points, mesh)
    console.print(f"model  {ckpt}  ({decoder.cfg.model_type}, {decoder.cfg.num_layers} layers, "
                  f"d={decoder.cfg.hidden_size})\nmesh   {describe(mesh)} on {jax.default_backend()}\n"
                  f"points {decoder.plan.spec()}")

    rng = np.random.default_rng(0)
    samples = [rng.integers(1, decoder.cfg.vocab_size, rng.integers(8, args.seq_len // 2)) for _ in range(args.samples)]
    tokens, segments, placements = pack_rows(samples, args.seq_len)
    rows = -(-len(tokens) // mesh.shape["data"]) * mesh.shape["data"]  # whole rows per data slot
    tokens = np.pad(tokens, ((0, rows - len(tokens)), (0, 0)))
    segments = np.pad(segments, ((0, rows - len(segments)), (0, 0)))

    start = time.perf_counter()
    jax.block_until_ready(decoder(tokens, segments))
    compiled = time.perf_counter() - start
    start = time.perf_counter()
    captures = {k: np.asarray(v) for k, v in decoder.captures(tokens, segments).items()}
    elapsed = time.perf_counter() - start
    real = sum(len(s) for s in samples)

    table = Table(title=f"{len(samples)} samples, {real} tokens packed into {rows} rows of {args.seq_len}")
    for column in ("point", "layer", "captured", "mean", "std", "rms"):
        table.add_column(column, justify="right" if column not in ("point",) else "left")
    mask = segments > 0
    for (point, layer), values in captures.items():
        kept = values[mask]  # the real tokens: no padding
        table.add_row(point, str(layer), f"{kept.shape[0]} x {kept.shape[1]}", f"{kept.mean():+.4f}",
                      f"{kept.std():.4f}", f"{np.sqrt((kept ** 2).mean()):.4f}")
    console.print(table)
    console.print(f"compile {compiled:.2f}s, then {real / elapsed:,.0f} tokens/s "
                  f"({1 - real / tokens.size:.0%} padding); cache {cache_dir()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from importlib.metadata import version

    parser = argparse.ArgumentParser(
        prog="harvest",
        description="Extract the internal activations of open decoder LLMs (Qwen2/2.5, Llama, Mistral, Qwen3) "
        "into verifiable safetensors shards, from one CPU to multi-host TPU pods.",
    )
    parser.add_argument("--version", action="version", version=f"harvest {version('harvest')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = commands.add_parser(
        "demo", help="run the pipeline on the embedded tiny model, offline",
        description="Write a deterministic tiny Qwen2-architecture checkpoint (no download), load it onto a "
        "device mesh, run a packed batch through it and print what each capture point holds.",
    )
    demo.add_argument("--points", default=DEFAULT_DEMO_POINTS,
                      help="capture points, e.g. resid_post:0-3,mlp_out:2,attn_out:0,1 (default: %(default)s)")
    demo.add_argument("--mesh", default=None,
                      help="1d | 2d | 3d | data=..,fsdp=..,model=.. (default: every device on data)")
    demo.add_argument("--samples", type=int, default=64, help="synthetic samples to run (default: %(default)s)")
    demo.add_argument("--seq-len", type=int, default=128, help="packed row length (default: %(default)s)")
    demo.add_argument("--cache-dir", default=None, help="where the demo checkpoint goes (default: $HARVEST_CACHE "
                      "or ~/.cache/harvest)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except UserError as e:
        print(f"harvest: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("harvest: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
