"""The SAEDashboard/Neuronpedia export of `harvest sae features --neuronpedia`: the files SAEDashboard's
`neuronpedia-runner` writes (jbloomAus/SAEDashboard, sae_dashboard/neuronpedia/), from harvest's records, so
SAEDashboard's own converter (`neuronpedia_export.export_neuronpedia_dashboards`) turns them into Neuronpedia's
bulk-import layout, and any reader of the runner's files reads ours. Per SAE tensor, one directory named as the
runner names its output directory:

    <model>_<sae set>_<hook name>_<latents>/
        batch-N.json            latents [64N, 64N + 64): {model_id, layer, sae_set, sae_id_suffix, features}
        run_settings.json       the settings the batches were made with (the runner's config, as far as harvest
                                has its fields) and harvest's record of the pass
        skipped_indexes.json    latents left out of the batches: none (the runner's current behaviour)

Fields harvest does not compute are written as the runner writes them when their option is off (see EMPTY and
_Source.feature). The JSON is ASCII (json's default escapes, as the runner writes it): any token string, even a
lone surrogate, reads back as it was decoded."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from harvest.tl_hooks import tl_hook_of_tensor
from harvest.sae.features.writer import BLOCK, BlockOrder
from harvest.sae.features.record import Context, FeaturesRecord, Latent, TensorSummary
from harvest.sae.features.site import short
from harvest.storage.storage import Storage

RUN_SETTINGS = "run_settings.json"
SKIPPED = "skipped_indexes.json"
HIST_BINS = 50  # the runner's ActsHistogramConfig.n_bins
LOG_SPARSITY = -6  # the runner's default sparsity_threshold, recorded in skipped_indexes.json (it skips none)
TOP_GROUP = -1  # bin_min and bin_contains of the top examples (the runner's "TOP ACTIVATIONS" group)

# Fields of a runner's feature that harvest does not compute, as the runner writes them with their option off:
# the feature tables (neuron alignment, correlated neurons and features), the logit histogram over the whole
# vocabulary, the attention heads' share of the decoder (hook_z SAEs only) and the steering vector (vectors only).
EMPTY = ("neuron_alignment_indices", "neuron_alignment_values", "neuron_alignment_l1", "correlated_neurons_indices",
         "correlated_neurons_l1", "correlated_neurons_pearson", "correlated_features_indices",
         "correlated_features_l1", "correlated_features_pearson")
_NAME = re.compile(r"[^A-Za-z0-9._-]+")


def batch_name(number: int) -> str:
    return f"batch-{number}.json"


def freq_histogram(edges: list[float], counts: list[int], top: float, bins: int = HIST_BINS
                   ) -> tuple[list[float], list[int]]:
    """The runner's activation histogram (bar centres, integer heights): `bins` equal-width bins over the
    latent's firing range, from harvest's log-spaced one (`edges` n+1, `counts` n, `top` the latent's max).

    An approximation: a log bin's firings are spread over its width evenly (harvest keeps no finer detail), so
    a bar's height is off by at most the firings of the log bins straddling its edges; the heights are rounded
    so their running sums stay within 0.5 of the spread ones and add up to the firings exactly. The range runs
    from the first non-empty log bin's lower edge (the runner: the smallest firing) to the max."""
    if not counts:
        return [], []  # a dead latent: the runner's empty histogram
    lo, hi = float(edges[0]), float(top)
    if hi <= lo:  # every firing at one value (the first bin's edge): one bar
        return [short(lo)], [int(sum(counts))]
    lin = np.linspace(lo, hi, bins + 1)
    spread = np.zeros(bins)
    for a, b, c in zip(edges[:-1], edges[1:], counts):
        b = min(float(b), hi)  # nothing fired above the max
        if b <= a:  # a bin that starts at the max: its firings are the max
            spread[-1] += c
            continue
        overlap = np.clip(np.minimum(lin[1:], b) - np.maximum(lin[:-1], a), 0.0, None)
        spread += c * overlap / (b - a)
    running = np.rint(np.cumsum(spread))
    running[-1] = sum(counts)
    heights = np.diff(running, prepend=0.0).astype(int)
    return [short(x) for x in (lin[:-1] + lin[1:]) / 2], [int(h) for h in heights]


def _activation(context: Context, bin_min: float, bin_max: float, bin_contains: float) -> dict[str, Any]:
    """One of the runner's activation examples: the window's tokens and the latent's activation on each, the
    example's token (qualifying_token_index) and the group it was drawn for."""
    return {"bin_min": bin_min, "bin_max": bin_max, "bin_contains": bin_contains, "tokens": list(context.tokens),
            "values": [short(a) for a in context.acts], "qualifying_token_index": context.at}


def activations(latent: Latent) -> list[dict[str, Any]]:
    """The runner's examples, in its order: the top examples (bin_min = bin_contains = -1, bin_max the latent's
    max), then the bins, highest first, each with its value range and the fraction of all tokens read whose
    activation lies in it: each bin holds its share of a uniform sample of the firings (exact when the sample
    holds every firing, an unbiased estimate otherwise)."""
    out = [_activation(c, TOP_GROUP, short(latent.max), TOP_GROUP) for c in latent.top]
    sampled = sum(len(b.examples) for b in latent.bins)
    for b in reversed(latent.bins):
        contains = latent.density * len(b.examples) / sampled
        out.extend(_activation(c, short(b.lo), short(b.hi), contains) for c in b.examples)
    return out


class _Source:
    """One SAE tensor's output directory and the fields its batches share."""

    def __init__(self, record: FeaturesRecord, summary: TensorSummary):
        self.summary = summary
        self.hook_name = tl_hook_of_tensor(summary.tensor) or summary.tensor
        point, _, layer = summary.tensor.rpartition(".")
        self.layer = int(layer) if layer.isdigit() else 0
        self.model_id = record.model_name or (record.model or "").rstrip("/").rsplit("/", 1)[-1]
        run = record.sae_run.rstrip("/").rsplit("/", 1)[-1]
        # Neuronpedia names a source "<layer>-<set>": the point in the set keeps a run's tensors at one layer apart.
        self.sae_set = f"{run}-{point or summary.tensor}"
        self.dir = "_".join(_NAME.sub("-", part) or "-" for part in
                            (self.model_id, self.sae_set, self.hook_name, str(summary.latents)))
        self.dataset = ",".join(record.runs)

    def feature(self, latent: Latent) -> dict[str, Any]:
        """A latent as the runner's feature (its NeuronpediaDashboardFeature.to_dict keys, in its order)."""
        values, heights = freq_histogram(latent.edges, latent.counts, latent.max)
        return {"feature_index": latent.index, **{key: [] for key in EMPTY},
                "neg_str": [t for t, _ in latent.bottom_logits],
                "neg_values": [short(v) for _, v in latent.bottom_logits],
                "pos_str": [t for t, _ in latent.top_logits], "pos_values": [short(v) for _, v in latent.top_logits],
                "frac_nonzero": latent.density,
                "freq_hist_data_bar_values": values, "freq_hist_data_bar_heights": heights,
                "logits_hist_data_bar_heights": [], "logits_hist_data_bar_values": [],
                # harvest counts tokens, not prompts: each token read is a "prompt" of one
                "n_prompts_total": self.summary.tokens, "n_tokens_in_prompt": 1, "dataset": self.dataset,
                "decoder_weights_dist": [], "activations": activations(latent), "vector": []}

    def batch(self, block: list[Latent]) -> dict[str, Any]:
        return {"model_id": self.model_id, "layer": self.layer, "sae_set": self.sae_set, "sae_id_suffix": None,
                "features": [self.feature(latent) for latent in block]}

    def run_settings(self, storage: Storage, record: FeaturesRecord) -> dict[str, Any]:
        """The runner's config fields that harvest has values for, and harvest's record of the pass."""
        s = record.settings
        return {"sae_set": self.sae_set, "sae_path": record.sae_run, "outputs_dir": storage.url_of(self.dir),
                "np_sae_id_suffix": None, "np_set_name": None, "sparsity_threshold": LOG_SPARSITY,
                "huggingface_dataset_path": self.dataset, "n_prompts_total": self.summary.tokens,
                "n_tokens_in_prompt": 1, "n_features_at_a_time": BLOCK, "n_quantiles": s.get("bins"),
                "top_acts_group_size": s.get("top"), "quantile_group_size": s.get("per_bin"), "use_dfa": False,
                "model_id": self.model_id, "layer": self.layer, "hook_name": self.hook_name,
                "harvest": {**record.to_json(), "tensors": [self.summary.to_json()]}}

    def skipped(self) -> dict[str, Any]:
        return {"model_id": self.model_id, "layer": str(self.layer), "sae_set": self.sae_set,
                "log_sparsity": LOG_SPARSITY, "skipped_indexes": []}


def _json(data: Any) -> bytes:
    return json.dumps(data, separators=(",", ":")).encode("ascii")


class NeuronpediaWriter:
    """Writes the SAEDashboard/Neuronpedia files into `storage` as the blocks of latents come (the Writer
    protocol of sae/features: `add` each tensor's latents in order, in blocks of BLOCK, then `close`)."""

    def __init__(self, storage: Storage, record: FeaturesRecord):
        self.storage = storage
        self.record = record
        self.sources = {summary.tensor: _Source(record, summary) for summary in record.tensors}
        self.order = BlockOrder(record)

    def add(self, tensor: str, block: list[Latent]) -> None:
        number = self.order.take(tensor, block)
        source = self.sources[tensor]
        self.storage.write_bytes(f"{source.dir}/{batch_name(number)}", _json(source.batch(block)))

    def close(self) -> None:
        """Writes each tensor's run settings and skipped latents, once all its latents are in."""
        self.order.check_complete()
        for source in self.sources.values():
            self.storage.write_bytes(f"{source.dir}/{RUN_SETTINGS}",
                                     _json(source.run_settings(self.storage, self.record)))
            self.storage.write_bytes(f"{source.dir}/{SKIPPED}", _json(source.skipped()))
