"""`harvest sae export SAE_RUN --format saelens|sparsify --out DIR [--step N]`: one directory per tensor
that `sae_lens.SAE.load_from_disk` or sparsify's `SparseCoder.load_from_disk` loads, giving harvest's
latents and reconstructions on the raw activations (a run-stats input scale is folded into the weights:
W_enc x s, W_dec / s, b_dec / s leave the pre-activations unchanged and return raw-scale outputs). Beside
them, harvest.json says what those configs cannot: the tokens left out of training (each sample's first
`skip_first`, and those over `max_norm` x the run's `median_norm`: `norm_limit`, an L2 norm, per run)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors.numpy import save_file

from harvest.errors import UserError
from harvest.tl_hooks import tl_hook_of_tensor
from harvest.sae import model as M
from harvest.storage import Storage
from harvest.training.checkpoint import CHECKPOINTS, Checkpoints
from harvest.training.record import read_run

FORMATS = ("saelens", "sparsify")
SAELENS_FORMAT = "6.0.0"  # the cfg.json layout written (metadata apart); without it SAELens drops the metadata


def load_sae_run(url: str, step: int | None = None) -> tuple[dict[str, Any], int, dict[str, dict]]:
    """(run.json, the step, {tensor: params as numpy float32, the input scale folded in})."""
    run = Storage(url)
    record = read_run(run, "sae", "an SAE run")
    if record is None:
        raise UserError(f"{run.url} is not an SAE run (no run.json of `harvest sae train`)")
    info = record.to_json()
    checkpoints = Checkpoints(run.url_of(CHECKPOINTS), every=1, keep=1, read_only=True)
    try:
        steps = checkpoints.steps()
        if not steps:
            raise UserError(f"{run.url} has no checkpoint yet")
        step = steps[-1] if step is None else step
        saved = jax.device_get(checkpoints.restore_params(step))
    finally:
        checkpoints.close()
    params = {}
    for name, sae in info["saes"].items():
        p = {k: np.asarray(v, np.float32) for k, v in saved[name].items()}
        s = float(sae["scale"])
        p["W_enc"], p["W_dec"], p["b_dec"] = p["W_enc"] * s, p["W_dec"] / s, p["b_dec"] / s
        params[name] = p
    return info, step, params


def trained_max_norm(info: dict[str, Any], name: str) -> float:
    """The --max-norm R an SAE was trained with (0: off), as its run.json records it (older runs: none)."""
    sae = info["saes"][name]
    return float(sae["max_norm"] if "max_norm" in sae else info["config"].get("max_norm") or 0)


def spec_of(sae: dict[str, Any]) -> M.Spec:
    return M.Spec(*(sae[f] for f in M.Spec._fields))


def export(url: str, out: str, fmt: str, step: int | None = None) -> dict[str, Any]:
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: choose one of {', '.join(FORMATS)}")
    info, step, params = load_sae_run(url, step)
    written = []
    for name, p in params.items():
        spec = spec_of(info["saes"][name])
        target = Path(out) / re.sub(r"[^A-Za-z0-9._-]+", "_", name)
        target.mkdir(parents=True, exist_ok=True)
        write = _sparsify if fmt == "sparsify" else _saelens
        write(target, name, spec, p)
        # What the loaders' configs have no field for: the tokens the SAE never saw, to leave out when using it.
        kept = {"sae_run": url, "step": step, "tensor": name, "skip_first": int(info["config"].get("skip_first", 0)),
                "max_norm": trained_max_norm(info, name)}
        if kept["max_norm"]:  # tokens over max_norm x median_norm (the L2 norm, per training run) were left out
            kept.update(median_norm=info["saes"][name]["median_norm"], norm_limit=info["saes"][name]["norm_limit"])
        (target / "harvest.json").write_text(json.dumps(kept, indent=1))
        written.append(str(target))
    return {"step": step, "out": out, "dirs": written}


def _sparsify(target: Path, name: str, spec: M.Spec, p: dict) -> None:
    if spec.architecture != "topk":
        raise UserError(f"sparsify loads TopK SAEs; {name} is {spec.architecture} (export it --format saelens)")
    cfg = {"activation": "topk", "expansion_factor": spec.latents // spec.width, "normalize_decoder": True,
           "num_latents": spec.latents, "k": spec.k, "multi_topk": False, "skip_connection": False,
           "transcode": False, "d_in": spec.width}
    save_file({"encoder.weight": np.ascontiguousarray(p["W_enc"].T), "encoder.bias": p["b_enc"],
               "W_dec": p["W_dec"], "b_dec": p["b_dec"]}, str(target / "sae.safetensors"))
    (target / "cfg.json").write_text(json.dumps(cfg, indent=1))


def _saelens(target: Path, name: str, spec: M.Spec, p: dict) -> None:
    """topk -> TopKSAE; relu -> StandardSAE; jumprelu and batchtopk (its learned threshold) -> JumpReLUSAE. The
    hook_name is the TransformerLens name of the point (`blocks.12.hook_resid_post`), as SAELens users hook it."""
    weights = {k: p[k] for k in ("W_enc", "b_enc", "W_dec", "b_dec")}
    cfg: dict[str, Any] = {"d_in": spec.width, "d_sae": spec.latents, "dtype": "float32", "device": "cpu",
                           "apply_b_dec_to_input": True, "normalize_activations": "none",
                           "metadata": {"sae_lens_version": SAELENS_FORMAT,
                                        "hook_name": tl_hook_of_tensor(name) or name}}
    if spec.architecture == "topk":
        cfg.update(architecture="topk", k=spec.k)
    elif spec.architecture == "relu":
        cfg.update(architecture="standard")
    else:
        cfg.update(architecture="jumprelu")
        weights["threshold"] = (np.exp(p["log_threshold"]) if spec.architecture == "jumprelu"
                                else np.full(spec.latents, p["threshold"], np.float32)).astype(np.float32)
    save_file({k: np.ascontiguousarray(v) for k, v in weights.items()}, str(target / "sae_weights.safetensors"))
    (target / "cfg.json").write_text(json.dumps(cfg, indent=1))
