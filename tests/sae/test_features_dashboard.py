"""The SAEDashboard/Neuronpedia export (sae/features/dashboard.py): the files SAEDashboard's neuronpedia-runner
writes (jbloomAus/SAEDashboard, sae_dashboard/neuronpedia/: batch-N.json per batch of features in a directory
named <model>_<set>_<hook>_<latents>, run_settings.json, skipped_indexes.json), their keys and JSON types as its
NeuronpediaDashboardBatch/Feature/Activation.to_dict write them, and values equal to the records they come from
(brute-force numpy for the histogram and the bins' shares). Where sae-dashboard is installed, its own reader and
its Neuronpedia converter read the files too."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from harvest.sae.features.writer import BLOCK
from harvest.sae.features.build import histogram
from harvest.sae.features.dashboard import NeuronpediaWriter, freq_histogram
from harvest.sae.features.record import Bin, Context, FeaturesRecord, Latent, TensorSummary
from harvest.sae.features.site import short
from harvest.sae.features.state import NUM_BINS, bin_index
from harvest.storage.storage import Storage

# Token strings a tokenizer may give: unicode, quotes, backslashes, markup, line separators, a lone surrogate.
VOCAB = [" the", " é", "日本", "🙂", '"quoted"', "back\\slash", "</script>", "\u2028", "\ud800", "\n", "'", "<b>",
         "\x00", " Paris"]
TOKENS = 5000  # tokens read
TOP, BINS, PER_BIN, WINDOW = 5, 3, 4, 3
MODEL, SAE_RUN, RUN = "HuggingFaceTB/SmolLM2-135M", "/data/sae/my-sae", "/data/runs/web-1"
TENSORS = {"resid_post.3": 150, "mlp_out.3": BLOCK}  # 150: blocks of 64, 64 and 22
DIRS = {"resid_post.3": "SmolLM2-135M_my-sae-resid_post_blocks.3.hook_resid_post_150",
        "mlp_out.3": "SmolLM2-135M_my-sae-mlp_out_blocks.3.hook_mlp_out_64"}

# What SAEDashboard's to_dict methods write (neuronpedia_dashboard.py), with the JSON type of each value.
BATCH = {"model_id": str, "layer": int, "sae_set": str, "sae_id_suffix": type(None), "features": list}
FEATURE = {"feature_index": int, "neuron_alignment_indices": [int], "neuron_alignment_values": [float],
           "neuron_alignment_l1": [float], "correlated_neurons_indices": [int], "correlated_neurons_l1": [float],
           "correlated_neurons_pearson": [float], "correlated_features_indices": [int],
           "correlated_features_l1": [float], "correlated_features_pearson": [float], "neg_str": [str],
           "neg_values": [float], "pos_str": [str], "pos_values": [float], "frac_nonzero": float,
           "freq_hist_data_bar_values": [float], "freq_hist_data_bar_heights": [int],
           "logits_hist_data_bar_heights": [int], "logits_hist_data_bar_values": [float], "n_prompts_total": int,
           "n_tokens_in_prompt": int, "dataset": str, "decoder_weights_dist": [float], "activations": list,
           "vector": [float]}
ACTIVATION = {"bin_min": (int, float), "bin_max": float, "bin_contains": (int, float), "tokens": [str],
              "values": [float], "qualifying_token_index": int}
SKIPPED = {"model_id": str, "layer": str, "sae_set": str, "log_sparsity": int, "skipped_indexes": list}


@dataclasses.dataclass
class Truth:
    """A latent's record and the activations it was made from (every token read, 0 where it did not fire)."""

    latent: Latent
    acts: np.ndarray


def context(rng, value: float) -> Context:
    tokens = [VOCAB[i] for i in rng.integers(len(VOCAB), size=2 * WINDOW + 1)]
    acts = rng.uniform(0, value, len(tokens)) * (rng.random(len(tokens)) < 0.5)
    acts[WINDOW] = value
    return Context(tokens, [float(a) for a in acts], WINDOW, float(value), (0, 1, int(rng.integers(10**6))))


def make_latent(rng, index: int) -> Truth:
    """A latent firing a random number of times (sometimes never, sometimes more than its sample holds), its
    record made as the pass makes it: top-K, quantile bins of a uniform sample, harvest's histogram."""
    count = int(rng.choice([0, 1, 7, 12, 300]))
    acts = np.zeros(TOKENS, np.float32)
    acts[rng.choice(TOKENS, count, replace=False)] = rng.lognormal(0.0, 1.0, count).astype(np.float32)
    fired = np.sort(acts[acts > 0])
    logits = sorted(((VOCAB[i], float(v)) for i, v in zip(rng.permutation(len(VOCAB))[:6], rng.normal(0, 2, 6))),
                    key=lambda t: -t[1])
    if count == 0:
        return Truth(Latent(index, 0, 0.0, 0.0, 0.0, [], [], [], [], logits[:3], logits[:-4:-1]), acts)
    sample = fired if count <= BINS * PER_BIN else np.sort(rng.choice(fired, BINS * PER_BIN, replace=False))
    bins = [Bin(float(g[0]), float(g[-1]), [context(rng, float(v)) for v in g])
            for g in (sample[i:i + PER_BIN] for i in range(0, len(sample), PER_BIN))]
    edges, counts = histogram(np.bincount(bin_index(np, fired), minlength=NUM_BINS), float(fired[-1]))
    return Truth(Latent(index, count, count / TOKENS, float(fired[-1]), float(fired.mean()),
                        [context(rng, float(v)) for v in fired[::-1][:TOP]], bins, edges, counts,
                        logits[:3], logits[:-4:-1]), acts)


def make_record() -> FeaturesRecord:
    return FeaturesRecord(SAE_RUN, 100, [RUN], [[0]], MODEL,
                          {"top": TOP, "window": WINDOW, "bins": BINS, "per_bin": PER_BIN, "dense_above": 0.1},
                          [TensorSummary(t, n, TOKENS, 0, 0, 0.1, "relu", 64) for t, n in TENSORS.items()])


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict[str, list[Truth]]]:
    out = tmp_path_factory.mktemp("np")
    rng = np.random.default_rng(39)
    truths = {t: [make_latent(rng, i) for i in range(n)] for t, n in TENSORS.items()}
    writer = NeuronpediaWriter(Storage(str(out)), make_record())
    for tensor, ts in truths.items():
        for start in range(0, len(ts), BLOCK):
            writer.add(tensor, [t.latent for t in ts[start:start + BLOCK]])
    writer.close()
    return out, truths


def check_types(data: dict, schema: dict, where: str) -> None:
    assert set(data) == set(schema), f"{where}: keys {sorted(set(data) ^ set(schema))} differ"
    for key, kind in schema.items():
        if isinstance(kind, list):
            assert isinstance(data[key], list), f"{where}.{key}"
            assert all(isinstance(v, kind[0]) and not isinstance(v, bool) for v in data[key]), f"{where}.{key}"
        else:
            assert isinstance(data[key], kind), f"{where}.{key}: {type(data[key]).__name__}"


def test_one_batch_file_per_block_in_the_runners_layout(written):
    out, truths = written
    assert sorted(p.name for p in out.iterdir()) == sorted(DIRS.values())
    for tensor, ts in truths.items():
        blocks = -(-len(ts) // BLOCK)
        files = sorted(p.name for p in (out / DIRS[tensor]).iterdir())
        assert files == sorted([f"batch-{n}.json" for n in range(blocks)] + ["run_settings.json",
                                                                               "skipped_indexes.json"])
        for n in range(blocks):
            batch = json.loads((out / DIRS[tensor] / f"batch-{n}.json").read_bytes())
            check_types(batch, BATCH, f"batch-{n}")
            point, layer = tensor.split(".")
            assert (batch["model_id"], batch["layer"], batch["sae_set"]) == ("SmolLM2-135M", int(layer),
                                                                             f"my-sae-{point}")
            assert [f["feature_index"] for f in batch["features"]] == list(range(n * BLOCK,
                                                                                 min(len(ts), (n + 1) * BLOCK)))


def features(out: Path, tensor: str) -> list[dict]:
    files = sorted((out / DIRS[tensor]).glob("batch-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return [f for p in files for f in json.loads(p.read_bytes())["features"]]


def test_features_equal_the_records(written):
    out, truths = written
    for tensor, ts in truths.items():
        for feature, truth in zip(features(out, tensor), ts, strict=True):
            latent = truth.latent
            check_types(feature, FEATURE, f"feature {latent.index}")
            assert feature["feature_index"] == latent.index
            assert feature["frac_nonzero"] == latent.density == np.count_nonzero(truth.acts) / TOKENS
            assert feature["pos_str"] == [t for t, _ in latent.top_logits]
            assert feature["pos_values"] == [short(v) for _, v in latent.top_logits]
            assert feature["neg_str"] == [t for t, _ in latent.bottom_logits]
            assert feature["neg_values"] == sorted(feature["neg_values"])  # most negative first, as the runner
            assert feature["neg_values"] == [short(v) for _, v in latent.bottom_logits]
            assert feature["n_prompts_total"] * feature["n_tokens_in_prompt"] == TOKENS
            assert feature["dataset"] == RUN
            assert sum(feature["freq_hist_data_bar_heights"]) == latent.count
            for key in ("neuron_alignment_indices", "correlated_features_pearson", "logits_hist_data_bar_values",
                        "logits_hist_data_bar_heights", "decoder_weights_dist", "vector"):
                assert feature[key] == []  # not computed: as the runner writes them with their option off
            check_activations(feature["activations"], truth)


def check_activations(acts: list[dict], truth: Truth) -> None:
    """The top examples (the runner's TOP ACTIVATIONS group) then the bins highest first, each example's tokens,
    values and token as recorded; each bin's share of the tokens read equals numpy's count when the sample
    held every firing."""
    latent = truth.latent
    examples = [(c, None) for c in latent.top] + [(c, b) for b in latent.bins[::-1] for c in b.examples]
    assert len(acts) == len(examples)
    for act, (c, b) in zip(acts, examples):
        check_types(act, ACTIVATION, f"latent {latent.index} activation")
        assert act["tokens"] == c.tokens
        assert act["values"] == [short(a) for a in c.acts]
        assert act["qualifying_token_index"] == c.at and act["values"][c.at] == short(c.value)
        if b is None:
            assert (act["bin_min"], act["bin_max"], act["bin_contains"]) == (-1, short(latent.max), -1)
        else:
            assert (act["bin_min"], act["bin_max"]) == (short(b.lo), short(b.hi))
            if latent.count <= BINS * PER_BIN:
                inside = np.count_nonzero((truth.acts >= b.lo) & (truth.acts <= b.hi))
                assert act["bin_contains"] == pytest.approx(inside / TOKENS, rel=1e-12)
    shares = {(a["bin_min"], a["bin_max"]): a["bin_contains"] for a in acts if a["bin_contains"] != -1}
    assert sum(shares.values()) == pytest.approx(latent.density, rel=1e-12)


def test_token_strings_round_trip_untouched(written):
    out, truths = written
    seen = set()
    for tensor, ts in truths.items():
        for feature, truth in zip(features(out, tensor), ts):
            written_tokens = [a["tokens"] for a in feature["activations"]]
            recorded = [c.tokens for c in truth.latent.top] + [c.tokens for b in truth.latent.bins[::-1]
                                                                for c in b.examples]
            assert written_tokens == recorded
            seen.update(t for ts_ in written_tokens for t in ts_)
    assert seen == set(VOCAB)  # every awkward string went through
    raw = (out / DIRS["resid_post.3"] / "batch-0.json").read_bytes()
    assert raw.isascii()  # non-ASCII escaped, as the runner's json.dumps writes it: a lone surrogate too


@pytest.mark.parametrize("seed", range(4))
def test_histogram_is_the_runners_equal_bins_within_one_log_bin_of_numpy(seed):
    """SAEDashboard's histogram: 50 equal-width bins of the firings, centres and integer heights. From harvest's
    log-spaced bins the heights can only be spread evenly within each log bin: at every bar edge the running
    count is within the straddling log bin's firings (+0.5 for rounding) of numpy's exact count."""
    rng = np.random.default_rng(seed)
    fired = rng.lognormal(rng.uniform(-3, 3), rng.uniform(0.2, 2), int(rng.integers(1, 20000))).astype(np.float32)
    edges, counts = histogram(np.bincount(bin_index(np, fired), minlength=NUM_BINS), float(fired.max()))
    values, heights = freq_histogram(edges, counts, float(fired.max()))
    lin = np.linspace(edges[0], float(fired.max()), 51)
    assert len(values) == len(heights) == 50 and all(isinstance(h, int) and h >= 0 for h in heights)
    assert values == [short(x) for x in (lin[:-1] + lin[1:]) / 2]
    assert sum(heights) == len(fired)
    ours = np.cumsum(heights)
    for k, x in enumerate(lin[1:]):
        exact = np.count_nonzero(fired < x) if k < 49 else len(fired)
        straddle = sum(c for a, b, c in zip(edges[:-1], edges[1:], counts) if a < x < b)
        assert abs(int(ours[k]) - exact) <= straddle + 0.5, (k, x)


def test_histogram_of_a_dead_latent_and_of_one_value():
    assert freq_histogram([], [], 0.0) == ([], [])
    fired = np.full(9, 1.0, np.float32)  # every firing on a bin edge: one bar, as wide as nothing
    edges, counts = histogram(np.bincount(bin_index(np, fired), minlength=NUM_BINS), 1.0)
    assert freq_histogram(edges, counts, 1.0) == ([1.0], [9])


def test_run_settings_and_skipped_indexes(written):
    out, _ = written
    for tensor, d in DIRS.items():
        skipped = json.loads((out / d / "skipped_indexes.json").read_bytes())
        check_types(skipped, SKIPPED, "skipped_indexes")
        assert skipped["skipped_indexes"] == [] and skipped["layer"] == tensor.split(".")[1]
        settings = json.loads((out / d / "run_settings.json").read_bytes())
        assert settings["sae_path"] == SAE_RUN and settings["n_features_at_a_time"] == BLOCK
        assert settings["hook_name"] == f"blocks.3.hook_{tensor.split('.')[0]}"
        assert (settings["n_quantiles"], settings["top_acts_group_size"], settings["quantile_group_size"]) == (
            BINS, TOP, PER_BIN)
        assert settings["harvest"]["tensors"][0]["tensor"] == tensor
        assert FeaturesRecord.from_json(settings["harvest"]).model == MODEL


def test_blocks_out_of_order_or_missing_are_refused(tmp_path):
    rng = np.random.default_rng(1)
    writer = NeuronpediaWriter(Storage(str(tmp_path)), make_record())
    block = [make_latent(rng, i).latent for i in range(BLOCK)]
    with pytest.raises(ValueError, match="not in the record"):
        writer.add("resid_post.9", block)
    with pytest.raises(ValueError, match="expected a block of latents 0"):
        writer.add("resid_post.3", block[1:])
    writer.add("resid_post.3", block)
    with pytest.raises(ValueError, match="64 of its 150 latents"):
        writer.close()


def test_saedashboards_reader_reads_every_key(written):
    """NeuronpediaDashboardBatch(**batch) takes exactly the keys it writes: an unknown key is a TypeError, a
    missing one comes back as its default; its to_dict gives our batch back."""
    dashboard = pytest.importorskip("sae_dashboard.neuronpedia.neuronpedia_dashboard",
                                    reason="sae-dashboard is not installed (it pulls torch and transformer-lens)")
    out, _ = written
    for path in out.glob("*/batch-*.json"):
        batch = json.loads(path.read_bytes())
        assert dashboard.NeuronpediaDashboardBatch(**batch).to_dict() == batch


def test_saedashboards_converter_makes_the_neuronpedia_import(written, tmp_path):
    """SAEDashboard's own converter to Neuronpedia's bulk-import layout reads our directory whole."""
    export = pytest.importorskip("sae_dashboard.neuronpedia.neuronpedia_export",
                                 reason="sae-dashboard is not installed (it pulls torch and transformer-lens)")
    out, truths = written
    settings = json.loads((out / DIRS["resid_post.3"] / "run_settings.json").read_bytes())
    done = Path(export.export_neuronpedia_dashboards(export.NeuronpediaExportConfig(
        saedashboard_output_dir=str(out / DIRS["resid_post.3"]), exports_dir=str(tmp_path), creator_name="t",
        creator_id="t", release_id="r", release_title="r", url="", model_name=settings["model_id"],
        neuronpedia_source_set_id=settings["sae_set"], neuronpedia_source_set_description="d",
        hf_weights_repo_id="", hf_weights_path="", hook_point="hook_resid_post", layer_num=settings["layer"],
        prompts_huggingface_dataset_path=settings["huggingface_dataset_path"],
        n_prompts_total=settings["n_prompts_total"], n_tokens_in_prompt=settings["n_tokens_in_prompt"])))
    assert done.name == "3-my-sae-resid_post"
    assert sorted(p.name for p in (done / "features").iterdir()) == [f"batch-{n}.jsonl.gz" for n in range(3)]
    rows = [json.loads(line) for n in range(3)
            for line in gzip.decompress((done / "activations" / f"batch-{n}.jsonl.gz").read_bytes()).splitlines()]
    assert len(rows) == sum(len(t.latent.top) + sum(len(b.examples) for b in t.latent.bins)
                            for t in truths["resid_post.3"])
