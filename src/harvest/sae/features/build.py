"""`harvest sae features SAE_RUN --out DIR`: the pass (sae/features/scan.py) for this rank, then, in the process
that finds every rank's part present, the merge and the output: per SAE tensor a TensorSummary, its latents
in blocks of BLOCK (contexts fetched a chunk of latents at a time, logits through the model's unembedding)
handed to the writers (the site always, the Neuronpedia layout with --neuronpedia), and features.json last."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from harvest.errors import UserError
from harvest.model.gguf import model_name
from harvest.sae.features.writer import BLOCK, Writer
from harvest.sae.features.config import FeaturesConfig
from harvest.sae.features.contexts import Contexts, contexts_of, examples
from harvest.sae.features.plan import Plan, make_plan
from harvest.sae.features.record import FEATURES_JSON, FeaturesRecord, Latent, TensorSummary
from harvest.sae.features.scan import load_state, part_path, parts_present, scan, state_path, token_progress
from harvest.sae.features.state import EDGES, TensorState, merge
from harvest.sae.features.vocab import Vocab, checkpoint_of
from harvest.storage import Storage, json_bytes

log = logging.getLogger(__name__)

CHUNK = 1024  # latents whose contexts are fetched together (each shard read once per chunk)


Writers = Callable[[Storage, FeaturesRecord], list[Writer]]


def default_writers(neuronpedia: bool) -> Writers:
    """The site's writer, and the Neuronpedia layout's under neuronpedia/ when asked for."""
    def make(out: Storage, record: FeaturesRecord) -> list[Writer]:
        from harvest.sae.features.site import SiteWriter

        writers: list[Writer] = [SiteWriter(out, record)]
        if neuronpedia:
            from harvest.sae.features.dashboard import NeuronpediaWriter

            writers.append(NeuronpediaWriter(out.child("neuronpedia"), record))
        return writers
    return make


def run_features(cfg: FeaturesConfig, writers: Writers | None = None) -> dict[str, Any]:
    """This rank's pass (resumed where a state is saved), and the output when every part is there. Returns
    {"built": bool, "out", "tokens", "waiting": ranks whose parts are missing}."""
    out = Storage(cfg.out)
    plan = make_plan(cfg)
    settings = plan.settings()
    part = load_state(out, part_path(cfg.rank, cfg.world), settings)
    if part is None:
        saved = load_state(out, state_path(cfg.rank, cfg.world), settings)
        if saved is not None:
            plan = plan.pinned(saved[1].listing)
        scan(plan, out, saved)
    missing = sorted(set(range(cfg.world)) - set(parts_present(out, cfg.world)))
    if missing:
        return {"built": False, "out": out.url, "waiting": missing}
    parts = [load_state(out, part_path(r, cfg.world), settings) for r in range(cfg.world)]
    listings = {str(p[1].listing) for p in parts}
    if len(listings) > 1:
        raise UserError(f"{out.url_of('scan')}: the ranks listed other shards (the run grew between their starts); "
                        "rerun them, on a complete run, with another --out")
    plan = plan.pinned(parts[0][1].listing)
    tokens = sum(p[1].tokens for p in parts)
    merged = merge([p[0] for p in parts])
    record = write_output(plan, merged, tokens, out, writers or default_writers(cfg.neuronpedia))
    return {"built": True, "out": out.url, "tokens": tokens, "waiting": [],
            "tensors": [t.to_json() for t in record.tensors]}


def write_output(plan: Plan, merged: dict[str, TensorState], tokens: int, out: Storage,
                 writers: Writers) -> FeaturesRecord:
    cfg = plan.cfg
    model, checkpoint = checkpoint_of(cfg.model, plan.runs[0].info.model)
    vocab = Vocab(checkpoint)
    logits = None
    if checkpoint is not None and cfg.logits:
        from harvest.sae.features.logits import Logits

        logits = Logits(checkpoint, cfg.logits, vocab)
    record = FeaturesRecord(
        sae_run=Storage(cfg.sae).url, step=plan.step, runs=[r.url for r in plan.runs], streams=plan.streams,
        model=model, model_name=model and model_name(model), tensors=[summary(t, plan, merged[t], tokens) for t in plan.tensors],
        settings={"top": cfg.top, "window": cfg.window, "bins": cfg.bins, "per_bin": cfg.per_bin,
                  "dense_above": cfg.dense_above, "logits": cfg.logits if logits else 0,
                  "batch_tokens": cfg.batch_tokens, "tokens": cfg.tokens, "skip_first": plan.skip_first})
    made = writers(out, record)
    for t in plan.tensors:
        state, spec = merged[t], plan.specs[t]
        contexts = Contexts(plan, t, vocab)
        ends = logits if logits is not None and logits.fits(t, spec.width) else None
        with token_progress(f"features: {t} latents", spec.latents, "latents") as bar:
            for lo in range(0, spec.latents, CHUNK):
                hi = min(lo + CHUNK, spec.latents)
                top, binned = examples(state, lo, hi, cfg.bins, cfg.per_bin)
                wanted = {e for es in top.values() for e in es} | {e for gs in binned.values() for g in gs for e in g}
                found = contexts.build(sorted(wanted, key=lambda e: (e.ordinal, e.offset, e.latent)))
                for start in range(lo, hi, BLOCK):
                    stop = min(start + BLOCK, hi)
                    signs = ends.of(plan.params[t]["W_dec"][start:stop]) if ends else [([], [])] * (stop - start)
                    block = [latent(state, i, tokens, *contexts_of(top[i], binned[i], found), *signs[i - start])
                             for i in range(start, stop)]
                    for w in made:
                        w.add(t, block)
                    bar(len(block))
    for w in made:
        w.close()
    out.write_bytes(FEATURES_JSON, json_bytes(record.to_json()))
    return record


def summary(tensor: str, plan: Plan, state: TensorState, tokens: int) -> TensorSummary:
    spec, cfg = plan.specs[tensor], plan.cfg
    density = state.count / max(tokens, 1)
    return TensorSummary(tensor, spec.latents, tokens, int(np.sum(state.count == 0)),
                         int(np.sum(density > cfg.dense_above)), cfg.dense_above, spec.architecture, spec.width)


def latent(state: TensorState, i: int, tokens: int, top, bins, top_logits, bottom_logits) -> Latent:
    edges, counts = histogram(state.hist[i], float(state.max[i]))
    return Latent(i, int(state.count[i]), float(state.count[i] / max(tokens, 1)), float(state.max[i]),
                  float(state.mean[i]), top, bins, edges, counts, top_logits, bottom_logits)


def histogram(hist: np.ndarray, top: float) -> tuple[list[float], list[int]]:
    """The non-empty span of a latent's histogram: (edges n+1, counts n); the bin below EDGES[0] starts at 0, the
    one above EDGES[-1] ends at the latent's max."""
    filled = np.flatnonzero(hist)
    if not len(filled):
        return [], []
    a, b = int(filled[0]), int(filled[-1])
    bounds = [0.0, *map(float, EDGES), max(top, float(EDGES[-1]))]
    return bounds[a:b + 2], [int(c) for c in hist[a:b + 1]]
