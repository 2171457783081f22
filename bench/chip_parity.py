"""The device check's parity stage: `harvest extract` against HF transformers' own activations (fp32, on the
CPU), the worst relative error per tensor against a tolerance."""

from __future__ import annotations

import argparse
from pathlib import Path

from chip_stage import emit, hf_model_args
from limited import failure, run_limited

TOLERANCE = {"float32": 2e-3, "bfloat16": 3e-2}  # TF32 matmuls on a GPU give ~1e-3 in fp32


def stage_parity(args: argparse.Namespace, work: Path) -> None:
    import numpy as np
    import torch
    import transformers
    from workloads import build_model, harvest_command, workload_texts, write_data

    from harvest.read import open_run

    model_dir = build_model(hf_model_args(args.smoke, small=True), work)
    texts = workload_texts("short", 6 if args.smoke else 24)
    data = write_data(texts, work / "parity.jsonl")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    points = f"resid_post:0-{n - 2},attn_out:0,mlp_out:{n - 1}"
    # dense matched HF on the first chip measured; the kernels are what changes
    cases = [("float32", "dense"), ("bfloat16", "auto")] if args.smoke else [("float32", "auto"), ("bfloat16", "auto")]
    for dtype, kind in cases:
        out = work / f"parity-{dtype}-{kind}"
        cmd = harvest_command(model_dir, data, out, points, 1024, 4, "--attention", kind, "--dtype", "float32",
                              compute_dtype=dtype)
        log = work / f"parity-{dtype}-{kind}.log"
        limit = 60
        code, seconds = run_limited(cmd, limit, log)
        if code != "0":
            emit("parity", f"{dtype} {kind}", "FAILED", failure(code, limit, log))
            continue
        worst, count = 0.0, 0
        for sample in open_run(str(out)).iter_samples():
            ref = hf_points(model, sample.tokens)
            for name, value in sample.activations.items():
                want = ref[name]
                worst = max(worst, float(np.abs(value - want).max() / (np.abs(want).max() + 1e-6)))
            count += 1
        verdict = "ok" if worst <= TOLERANCE[dtype] and count == len(texts) else "OVER TOLERANCE"
        emit("parity", f"{dtype} {kind}", f"worst rel err {worst:.1e} ({verdict})",
             f"{count}/{len(texts)} samples, {points}; {seconds:.0f} s whole process")


def hf_points(model, tokens) -> dict:
    """HF's activations of one sample by harvest's tensor names: hidden states and forward hooks, fp32."""
    import torch

    got: dict = {}
    layers = model.model.layers
    hooks = [layers[0].self_attn.register_forward_hook(lambda m, a, o: got.__setitem__("attn_out.0", o[0])),
             layers[-1].mlp.register_forward_hook(lambda m, a, o: got.__setitem__(f"mlp_out.{len(layers) - 1}", o))]
    try:
        with torch.no_grad():
            hidden = model(torch.tensor(tokens, dtype=torch.long)[None], output_hidden_states=True).hidden_states
    finally:
        for hook in hooks:
            hook.remove()
    got.update({f"resid_post.{i}": hidden[i + 1] for i in range(len(layers) - 1)})  # the last one is normed
    return {name: value[0].float().numpy() for name, value in got.items()}
