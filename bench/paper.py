"""On paper: what extraction should reach per chip, from the chips' published numbers (harvest.runtime.chips) and
the models' shapes (harvest.model.flops), for docs/performance.md. No accelerator needed.

Per model, the forward's FLOPs per token in a row of --seq tokens: the matmuls of the layers run (no LM head:
extraction exits after the last captured layer), plus attention as dense computes it ([seq, seq], every
cross-sample and padding score) and as the kernels compute it over packed rows (each sample causally within
itself; samples of --sample-len tokens).

Per model x chip:
  compute   tokens/s per chip at MaxText's published MFU range (--mfu, default 45% and 65%), packed attention;
  HBM       the bytes a token moves through HBM: its share of the weights (read once per step of --tokens-per-step
            tokens a chip) plus its activations (each layer's input, q/k/v/attention/output, MLP gate/up/hidden:
            written once, read once), and the tokens/s HBM bandwidth alone allows;
  ICI       for a model that does not fit one chip's HBM with room for activations (bf16 weights over half of it):
            tensor parallel over `model`=n chips (the smallest power of two that fits), two all-reduces of the
            hidden state per layer (ring: 2 (n-1)/n x its bytes a chip), and the tokens/s the link alone allows;
  storage   capture bytes a second that one host (--chips-per-host) hands to storage at the compute rate, for
            --points (resid_post at 8 layers, bf16, by default).
The seed scripts measured ~110 tokens/s per v5e chip for Qwen2.5-0.5B (DESIGN.md): the last column compares.

Run:  .venv/bin/python bench/paper.py        (instant; no device)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/shapes.py, bench/table.py
from shapes import NAMES, model_config
from table import show

from harvest.model.config import ModelConfig
from harvest.model.flops import causal_context, forward_flops_per_token, matmul_params
from harvest.runtime.chips import chip_named

MODELS = {NAMES[p]: p for p in ("0.5b", "7b")}
CHIPS = ("TPU v5e", "TPU v6e", "TPU v4", "NVIDIA H100 SXM")
SEED_V5E_TOKENS_PER_S = 110  # the seed scripts on a v5e-64, Qwen2.5-0.5B (DESIGN.md, "Who uses it")
MAXTEXT_MFU = (0.45, 0.65)  # MaxText's published range: MaxText/configs/v5e/README.md (46-67%, 16B-128B models)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=2048, help="row length (default 2048)")
    p.add_argument("--sample-len", type=int, default=300, help="tokens per packed sample (default 300)")
    p.add_argument("--tokens-per-step", type=int, default=16 * 2048, help="tokens a chip runs per step (16 rows)")
    p.add_argument("--capture-layers", type=int, default=8, help="resid_post layers captured (default 8)")
    p.add_argument("--chips-per-host", type=int, default=8, help="chips a host drives (default 8: v5e/v6e/H100)")
    p.add_argument("--mfu", default=",".join(str(m) for m in MAXTEXT_MFU), help="MFU range (default 0.45,0.65)")
    args = p.parse_args()
    args.mfu = [float(m) for m in args.mfu.split(",")]
    return args


def flops_rows(args) -> list[list[str]]:
    rows = []
    packed = causal_context([args.sample_len] * (args.seq // args.sample_len))
    for name in MODELS:
        cfg = model_config(MODELS[name])
        matmul = forward_flops_per_token(cfg, 0.0)
        dense, kernel = forward_flops_per_token(cfg, args.seq), forward_flops_per_token(cfg, packed)
        rows.append([name, f"{matmul_params(cfg) / 1e9:.2f}B", f"{matmul / 1e9:.2f}", f"{(dense - matmul) / 1e9:.2f}",
                     f"{(kernel - matmul) / 1e9:.3f}", f"{dense / 1e9:.2f}", f"{kernel / 1e9:.2f}",
                     f"{dense / kernel:.2f}x"])
    return rows


def activation_bytes(cfg: ModelConfig) -> float:
    """HBM bytes of one token's activations in the layers (bf16, each written once and read once)."""
    kv = cfg.num_kv_heads * cfg.head_dim
    per_layer = 2 * cfg.hidden_size + 2 * cfg.num_heads * cfg.head_dim + 2 * kv + 3 * cfg.intermediate_size
    return 2 * 2 * cfg.num_layers * per_layer


def chip_rows(args) -> list[list[str]]:
    rows = []
    packed = causal_context([args.sample_len] * (args.seq // args.sample_len))
    for name in MODELS:
        cfg = model_config(MODELS[name])
        flops = forward_flops_per_token(cfg, packed)
        weights = 2.0 * matmul_params(cfg) + 2.0 * cfg.vocab_size * cfg.hidden_size  # bf16, embedding included
        capture = args.capture_layers * cfg.hidden_size * 2
        for chip_name in CHIPS:
            chip = chip_named(chip_name)
            shards = 1
            while weights / shards > chip.hbm_bytes / 2:
                shards *= 2
            hbm = (weights / shards) / args.tokens_per_step + activation_bytes(cfg) / shards
            hbm_rate = chip.hbm_bytes_per_s / hbm
            if shards > 1 and chip.link_bytes_per_s:
                ici = cfg.num_layers * 2 * 2 * (shards - 1) / shards * cfg.hidden_size * 2
                ici_cell = f"model={shards}: {ici / 1e3:.0f} KB, {chip.link_bytes_per_s / ici / shards:,.0f}"
            elif shards > 1:
                ici_cell = f"model={shards}: link unpublished"
            else:
                ici_cell = "fits: none"
            low, high = (m * chip.bf16_flops / flops for m in args.mfu)
            per_host = high * capture * args.chips_per_host
            rows.append([name, chip_name, f"{low:,.0f} - {high:,.0f}", f"{hbm / 1e3:.0f} KB, {hbm_rate:,.0f}",
                         ici_cell, f"{capture / 1e3:.1f} KB, {per_host / 1e9:.2f} GB/s",
                         f"{low / SEED_V5E_TOKENS_PER_S:,.0f}x" if chip_name == "TPU v5e" and name == "Qwen2.5-0.5B"
                         else ""])
    return rows


def main() -> None:
    args = parse_args()
    show(f"forward GFLOP per token, rows of {args.seq}, packed samples of {args.sample_len} tokens",
         ["model", "matmul params", "matmul", "attn dense", "attn packed", "dense", "packed", "dense / packed"],
         flops_rows(args), "matmul: 2 x the layers' weights (no LM head: extraction exits early); attention: 4 x heads "
         "x head_dim per (query, key) pair, dense over all seq keys, packed over a causal sample's (len+1)/2")
    show("expected tokens/s per chip (packed attention)",
         ["model", "chip", f"compute @ {args.mfu[0]:.0%}-{args.mfu[-1]:.0%} MFU", "HBM: bytes/token, tokens/s",
          "ICI: bytes/token, tokens/s", f"storage: capture/token, per host ({args.chips_per_host} chips)",
          "vs seed (110/s)"],
         chip_rows(args),
         "compute: MFU x the chip's bf16 peak / packed FLOPs per token; HBM and ICI: the rate each alone allows "
         "(higher than compute: compute-bound); storage: the capture bytes a host must write at the upper compute "
         "rate. Chips: harvest.runtime.chips (vendor pages); MFU range: MaxText's published v5e results.")


if __name__ == "__main__":
    main()
