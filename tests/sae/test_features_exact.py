"""`harvest sae features` is exact: on the SAE tests' run, every number a latent shows (count, density, max,
mean, top-K values and positions, the quantile sample, the histogram, the contexts' tokens and activations,
the logits) equals a brute-force numpy computation over every token of the held-out stream."""

from __future__ import annotations

import numpy as np
import pytest
from sae_helpers import TENSOR

TOP, BINS, PER_BIN, WINDOW, LOGITS = 6, 3, 4, 3, 5


@pytest.fixture(scope="module")
def built(straight, tmp_path_factory):
    from features_helpers import build_features

    return build_features(straight, tmp_path_factory.mktemp("features") / "out", site=False, top=TOP, bins=BINS,
                          per_bin=PER_BIN, window=WINDOW, logits=LOGITS, batch_tokens=96)


def brute_force(sae_url: str, run_url: str) -> dict:
    """Every held-out token the SAE's training would keep (no special token, under the norm limit), encoded
    with the SAE by numpy-side code: per token (ordinal, offset, latents), and every row's latents."""
    from harvest.read.run import open_run
    from harvest.sae import model as M
    from harvest.sae.export import load_sae_run, spec_of

    info, _, params = load_sae_run(sae_url)
    sae = info["saes"][TENSOR]
    spec = spec_of(sae)
    run = open_run(run_url)
    shards = [sc for s in sae["holdout_streams"][0] for sc in run.shards_of(s) if sc.tokens]
    special = run.info.special_token_ids or []
    limit = sae["norm_limit"][0] if sae.get("norm_limit") else np.inf
    acts, where, rows = [], [], {}
    for ordinal, sc in enumerate(shards):
        t = run.read_shard(sc)
        x = t[TENSOR].astype(np.float32)
        every = np.asarray(M.infer(params[TENSOR], x, spec)[0])
        rows[ordinal] = (t["tokens"], t["offsets"], every)
        keep = ~np.isin(t["tokens"], special) & (np.sqrt(np.sum(x.astype(np.float64) ** 2, axis=1)) <= limit)
        acts.append(every[keep])
        where += [(ordinal, int(o)) for o in np.flatnonzero(keep)]
    return {"acts": np.concatenate(acts), "where": np.asarray(where, np.int64), "rows": rows, "shards": shards,
            "params": params[TENSOR], "spec": spec}


def test_every_statistic_equals_brute_force(built, straight, sae_source):
    from harvest.sae.features.state import EDGES, sample_key

    _, record, latents = built
    ref = brute_force(straight, sae_source["run"])
    acts, where = ref["acts"], ref["where"]
    tokens = len(acts)
    assert record.tensors[0].tokens == tokens and record.tensors[0].latents == ref["spec"].latents
    mine = latents[TENSOR]
    assert [lat.index for lat in mine] == list(range(ref["spec"].latents))
    fired = acts > 0
    assert record.tensors[0].dead == int(np.sum(~fired.any(0)))
    for lat in mine:
        col, on = acts[:, lat.index], fired[:, lat.index]
        assert lat.count == int(on.sum()) and lat.density == lat.count / tokens
        assert lat.max == pytest.approx(float(col.max()), rel=1e-6, abs=1e-7)
        assert lat.mean == pytest.approx(float(col[on].astype(np.float64).sum() / max(on.sum(), 1)), rel=1e-5)
        # top-K: by value (larger first), then the earlier token. The same value met twice (one token's activation
        # in two samples) can differ in its last bit between the pass's batches: such near-ties come in either order.
        hits = np.flatnonzero(on)
        order = hits[np.lexsort((where[hits, 1], where[hits, 0], -col[hits]))][:TOP]
        assert [c.value for c in lat.top] == pytest.approx(col[order].tolist(), rel=1e-6)
        shards = ref["shards"]
        row_of = {(shards[o].shard, int(off)): i for i, (o, off) in enumerate(where)}
        picked = [row_of[(c.where[1], c.where[2])] for c in lat.top]
        assert len(set(picked)) == len(picked) and col[picked].tolist() == pytest.approx(col[order].tolist(), rel=1e-6)
        exact = [i for i, value in enumerate(col[order]) if np.sum(np.isclose(col[hits], value, rtol=1e-6)) == 1]
        assert [picked[i] for i in exact] == [order[i] for i in exact]  # an untied value: exactly the reference's
        # the sample: the bottom of the hash, binned by value
        keys = sample_key(np, where[hits, 0], where[hits, 1], np.full(len(hits), lat.index))
        drawn = hits[np.lexsort((where[hits, 1], where[hits, 0], -keys.astype(np.int64)))][:BINS * PER_BIN]
        drawn = drawn[np.lexsort((where[drawn, 1], where[drawn, 0], col[drawn]))]
        groups = [drawn[g:g + PER_BIN] for g in range(0, len(drawn), PER_BIN)]
        assert [v for b in lat.bins for v in (b.lo, b.hi)] == pytest.approx(
            [float(col[i]) for g in groups for i in (g[0], g[-1])], rel=1e-6)
        # the drawn tokens exactly, in bins of PER_BIN by value (near-ties, as above, in either order)
        examples = [row_of[(c.where[1], c.where[2])] for b in lat.bins for c in b.examples]
        assert [len(b.examples) for b in lat.bins] == [len(g) for g in groups] and sorted(examples) == sorted(drawn)
        assert col[examples].tolist() == pytest.approx(col[drawn].tolist(), rel=1e-6)
        # the histogram: fixed log-spaced bins, the non-empty span
        counts = np.bincount(np.searchsorted(EDGES, col[on], side="right"), minlength=len(EDGES) + 1)
        span = np.flatnonzero(counts)
        want = counts[span[0]:span[-1] + 1].tolist() if len(span) else []
        assert lat.counts == want and len(lat.edges) == len(want) + (1 if want else 0)


def test_contexts_and_logits_equal_brute_force(built, straight, sae_source):
    from harvest.data.prompts import load_tokenizer
    from harvest.model.config import ModelConfig
    from harvest.model.weights import load_params

    _, record, latents = built
    ref = brute_force(straight, sae_source["run"])
    tokenizer = load_tokenizer(sae_source["checkpoint"])
    by_shard = {(sc.stream, sc.shard): o for o, sc in enumerate(ref["shards"])}
    checked = 0
    for lat in latents[TENSOR]:
        for c in lat.top + [e for b in lat.bins for e in b.examples]:
            ids, offsets, every = ref["rows"][by_shard[c.where[:2]]]
            at = c.where[2]
            sample = np.searchsorted(offsets, at, side="right") - 1
            lo, hi = max(offsets[sample], at - WINDOW), min(offsets[sample + 1], at + WINDOW + 1)
            assert c.tokens == [tokenizer.decode([int(t)]) for t in ids[lo:hi]]
            assert c.acts == pytest.approx(every[lo:hi, lat.index].tolist(), rel=1e-5, abs=1e-6)
            assert c.at == at - lo and c.acts[c.at] == c.value
            checked += 1
    assert checked > 100
    cfg = ModelConfig.from_dir(sae_source["checkpoint"])
    head = load_params(sae_source["checkpoint"], cfg, num_layers=1, head=True)
    unembed = np.asarray(head["lm_head"] if "lm_head" in head else head["embed"].T)
    scores = (ref["params"]["W_dec"] * np.asarray(head["final_norm"])) @ unembed
    assert record.model and record.settings["logits"] == LOGITS
    for lat in latents[TENSOR][:16]:
        order = np.argsort(-scores[lat.index], kind="stable")
        assert [v for _, v in lat.top_logits] == pytest.approx(scores[lat.index][order[:LOGITS]].tolist(), rel=1e-4)
        assert [v for _, v in lat.bottom_logits] == pytest.approx(
            scores[lat.index][order[::-1][:LOGITS]].tolist(), rel=1e-4)
        assert lat.top_logits[0][0] == tokenizer.decode([int(order[0])])


@pytest.mark.parametrize("devices", [1, 8])
def test_the_pass_encodes_as_the_sae(devices):
    """The pass's encoding gives sae/model.encode's latents: on one device (its faster TopK threshold) bit for
    bit; with the latents split over 8, the same latents fire, their values within float32 rounding (a block
    of the encoder's columns is multiplied apart)."""
    import jax

    from harvest.runtime.mesh import make_mesh
    from harvest.sae import model as M
    from harvest.sae.features import running as R

    spec = M.Spec("topk", 16, 64, 4, 8)
    params = M.init_params(jax.random.key(1), spec, jax.numpy.zeros(16))
    x = np.random.default_rng(2).standard_normal((32, 16)).astype(np.float32)
    mesh = make_mesh("1d", jax.local_devices()[:devices])
    got = np.asarray(R.make_encode(spec, mesh)(R.place(params, spec, mesh), x))
    want = np.asarray(jax.jit(lambda p, x: M.encode(p, x, spec, inference=True))(params, x))
    if devices == 1:
        assert np.array_equal(got, want)
    assert np.array_equal(got > 0, want > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6)
