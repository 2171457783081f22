"""Massive activations: the norm rule (token_batches(max_norm=R), `sae train --max-norm R`) leaves out exactly
the tokens over R x the run's median norm, in training, in `sae eval` (its FVU and the CE splice) and in
exports' harvest.json; `harvest inspect` says where they sit; training and `sae eval` count dead latents the
same way (fired on none of the last W tokens)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from reader_helpers import SPECIAL, RunWriter, small_run

import harvest

NAMES = ["resid_post.3", "mlp_out.3"]


class _Planting:
    """The writer's generator, with `rows` of each normal() draw (a shard's activations) scaled by `factor`."""

    def __init__(self, rng: np.random.Generator, factor: float):
        self.rng, self.factor, self.rows = rng, factor, None

    def __getattr__(self, name):
        return getattr(self.rng, name)

    def normal(self, *args, **kw):
        x = self.rng.normal(*args, **kw)
        if self.rows is not None:
            x[self.rows] *= self.factor
        return x


class MassiveWriter(RunWriter):
    """A RunWriter whose samples carry massive activations (x `factor` the usual values) at `positions`."""

    def __init__(self, url: str, positions=(0, 2), factor: float = 60.0, **kw):
        super().__init__(url, **kw)
        self.massive_at = positions
        self.rng = _Planting(self.rng, factor)

    def shard(self, stream: int, lengths: list[int], **kw) -> str:
        starts = np.cumsum([0, *lengths[:-1]])
        self.rng.rows = np.concatenate([s + np.asarray([p for p in self.massive_at if p < n], int)
                                        for s, n in zip(starts, lengths)])
        try:
            return super().shard(stream, lengths, **kw)
        finally:
            self.rng.rows = None


def massive_run(url: str, **kw) -> MassiveWriter:
    w = MassiveWriter(url, **kw)
    for s in range(3):
        for k in range(2):
            w.shard(s, [int(x) for x in w.rng.integers(3, 40, 6)], final=k == 1)
    return w


def brute(run, names, streams=None) -> tuple[dict[int, dict[str, np.ndarray]], dict[str, float]]:
    """{token: {tensor: float32 values}} of every token served by default (not special), and each tensor's
    median L2 norm over them (numpy, float64)."""
    rows = {}
    for sample in run.iter_samples(streams):
        for i, t in enumerate(sample.tokens.tolist()):
            if t not in SPECIAL:
                rows[t] = {n: np.asarray(sample.activations[n], np.float32)[i] for n in names}
    medians = {n: float(np.median([np.linalg.norm(r[n].astype(np.float64)) for r in rows.values()])) for n in names}
    return rows, medians


@pytest.mark.parametrize("ratio", [0.9, 1.1, 1.2])
def test_token_batches_leave_out_exactly_the_tokens_over_r_times_the_median(tmp_path, ratio):
    small_run(str(tmp_path / "run"))
    run = harvest.open(str(tmp_path / "run"))
    rows, medians = brute(run, NAMES)
    assert run.median_norms(NAMES) == pytest.approx(medians, rel=1e-12)
    want = {t for t, r in rows.items()
            if all(np.linalg.norm(r[n].astype(np.float64)) <= ratio * medians[n] for n in NAMES)}
    assert 0 < len(want) < len(rows)
    reader = run.token_batches(7, NAMES, max_norm=ratio, piece_bytes=512, shard_buffer=2, dtype="float32")
    served = [b for b in reader]
    tokens = np.concatenate([b["tokens"] for b in served]).tolist()
    assert sorted(tokens) == sorted(want)
    assert reader.massive_left_out == len(rows) - len(want) and reader.tokens_considered == len(rows)
    assert reader.norm_limits == pytest.approx({n: ratio * m for n, m in medians.items()}, rel=1e-12)
    for b in served:
        for n in NAMES:
            np.testing.assert_array_equal(b[n], np.stack([rows[t][n] for t in b["tokens"].tolist()]))
    # One tensor's rule alone leaves out fewer; a given median is used as given; off leaves out none.
    one = run.token_batches(10**6, NAMES[0], max_norm=ratio)
    assert len(next(iter(one))["tokens"]) >= len(want)
    given = run.token_batches(10**6, NAMES, max_norm=1.0, median_norm={n: ratio * m for n, m in medians.items()})
    assert sorted(next(iter(given))["tokens"].tolist()) == sorted(want)
    assert len(next(iter(run.token_batches(10**6, NAMES, max_norm=0)))["tokens"]) == len(rows)


def test_a_reader_state_keeps_its_norm_rule(tmp_path):
    small_run(str(tmp_path / "run"))
    run = harvest.open(str(tmp_path / "run"))
    whole = [b["tokens"].tolist() for b in run.token_batches(5, NAMES, max_norm=1.1, piece_bytes=512)]
    reader = run.token_batches(5, NAMES, max_norm=1.1, piece_bytes=512)
    it = iter(reader)
    first = [next(it)["tokens"].tolist() for _ in range(3)]
    state = json.loads(json.dumps(reader.state_dict()))
    with pytest.raises(Exception, match="max_norm"):
        run.token_batches(5, NAMES, max_norm=1.2, piece_bytes=512).load_state_dict(state)
    again = run.token_batches(5, NAMES, max_norm=1.1, piece_bytes=512)
    again.load_state_dict(state)
    assert first + [b["tokens"].tolist() for b in again] == whole
    # A state saved before the rule existed (no max_norm in its order) loads into a reader without it.
    plain = run.token_batches(5, NAMES, piece_bytes=512)
    next(iter(plain))
    old = plain.state_dict()
    del old["order"]["max_norm"]
    run.token_batches(5, NAMES, piece_bytes=512).load_state_dict(old)


def test_inspect_says_where_the_massive_activations_sit(tmp_path):
    from rich.console import Console

    from harvest.store import report
    from harvest.store.stats import RunningStats

    massive_run(str(tmp_path / "run"), positions=(0, 2))
    run = harvest.open(str(tmp_path / "run"))
    read, found = report.massive_activations(run.storage, run.view)
    xs, positions = {n: [] for n in NAMES}, []
    for sample in run.iter_samples():
        positions.append(np.arange(len(sample.tokens)))
        for n in NAMES:
            xs[n].append(np.asarray(sample.activations[n], np.float32))
    where = np.concatenate(positions)
    assert read == len(where) == run.num_tokens
    for n in NAMES:
        x = np.concatenate(xs[n])
        norms = np.linalg.norm(x.astype(np.float64), axis=1)
        massive = norms > 20 * np.median(norms)
        assert set(where[massive]) == {0, 2}  # planted there, and only there
        f = found[n]
        assert f["count"] == massive.sum() == np.sum(where == 0) + np.sum(where == 2)
        assert f["positions"] == {0: int(np.sum(where == 0)), 2: int(np.sum(where == 2))}
        assert f["share"] == pytest.approx(RunningStats.of(x[massive]).share_of(RunningStats.of(x)), rel=1e-9)
        later = where > 0
        assert f["later_share"] == pytest.approx(
            RunningStats.of(x[massive & later]).share_of(RunningStats.of(x[later])), rel=1e-9)
        assert f["later_share"] > 0.5  # what --skip-first 1 leaves: most of the later tokens' variance
    console = Console(width=250, record=True)
    for renderable in report.inspect(str(tmp_path / "run")):
        console.print(renderable)
    text = console.export_text()
    assert "massive activations: tokens over 20x the median L2 norm" in text
    assert f"2: {np.sum(where == 2)}" in text, text


def _sae_config(url: str, out: str, **more):
    from harvest.sae.config import SaeConfig

    return SaeConfig(**{"run": [url], "tensors": ["resid_post.3"], "out": out, "expansion": 4, "k": 4,
                        "batch_tokens": 16, "tokens": 16 * 4, "warmup": 1, "checkpoint_every": 4, "log_every": 1,
                        "holdout_streams": 1, **more}).validate()


def test_sae_train_eval_and_export_record_and_apply_the_norm_rule(tmp_path):
    from harvest.sae.evaluate import evaluate
    from harvest.sae.export import export, load_sae_run
    from harvest.training.run import train as run_sae_train

    url, out = str(tmp_path / "run"), str(tmp_path / "sae")
    massive_run(url, positions=(0, 2))
    run = harvest.open(url)
    summary = run_sae_train(_sae_config(url, out, max_norm=10))
    info, _, _ = load_sae_run(out)
    sae = info["saes"]["resid_post.3"]
    _, medians = brute(run, ["resid_post.3"])  # every stream: the median the rule takes
    assert info["config"]["max_norm"] == 10
    assert sae["median_norm"] == pytest.approx([medians["resid_post.3"]], rel=1e-12)
    assert sae["norm_limit"] == pytest.approx([10 * medians["resid_post.3"]], rel=1e-12)
    assert summary["max_norm"] == 10 and summary["massive_left_out"] > 0
    records = [json.loads(line) for line in (tmp_path / "sae" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["massive_left_out"] > 0 and 0 < records[-1]["massive_share"] < 0.5
    # eval: the held-out stream, the same rule, counted
    held, _ = brute(run, ["resid_post.3"], streams=sae["holdout_streams"][0])
    limit = 10 * medians["resid_post.3"]
    kept = [t for t, r in held.items() if np.linalg.norm(r["resid_post.3"].astype(np.float64)) <= limit]
    result = evaluate(out, tokens=10**6)["tensors"]["resid_post.3"]
    assert result["tokens"] == len(kept) and result["massive_left_out"] == len(held) - len(kept) > 0
    assert result["max_norm"] == 10 and result["median_norm"] == pytest.approx([medians["resid_post.3"]])
    assert evaluate(out, tokens=10**6, max_norm=0)["tensors"]["resid_post.3"]["tokens"] == len(held)
    export(out, str(tmp_path / "export"), "saelens")
    kept_json = json.loads((tmp_path / "export" / "resid_post.3" / "harvest.json").read_text())
    assert kept_json["max_norm"] == 10 and kept_json["norm_limit"] == pytest.approx([limit])
    # a resumed run keeps the medians it recorded (a rerun to the same budget: nothing to do, the same record)
    run_sae_train(_sae_config(url, out, max_norm=10))
    assert load_sae_run(out)[0]["saes"]["resid_post.3"]["median_norm"] == sae["median_norm"]


def test_training_and_eval_count_dead_latents_alike(tmp_path):
    """lr 0: the SAE stays as initialized, so training's dead fraction (fired on none of the W tokens trained)
    equals `sae eval`'s on those same tokens (the same reader order, W tokens)."""
    from harvest.sae.evaluate import evaluate
    from harvest.training.run import train as run_sae_train

    url, out = str(tmp_path / "run"), str(tmp_path / "sae")
    small_run(url)
    steps, batch = 6, 16
    run_sae_train(_sae_config(url, out, lr=0.0, holdout_streams=0, tokens=steps * batch, expansion=8, k=2,
                              b_dec_init="zeros"))
    from harvest.sae.export import load_sae_run

    assert load_sae_run(out)[0]["saes"]["resid_post.3"]["max_norm"] == 10  # the default rule, recorded
    records = [json.loads(line) for line in (tmp_path / "sae" / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["dead_window"] == steps * batch and [r["dead_window"] for r in records[:2]] == [batch, 2 * batch]
    result = evaluate(out, url, tokens=steps * batch, batch=batch)["tensors"]["resid_post.3"]
    assert result["dead_window"] == result["tokens"] == steps * batch
    assert 0 < result["dead_fraction"] < 1
    assert last["dead_fraction"] == pytest.approx(result["dead_fraction"], rel=1e-6)  # logged in float32
    # the window is dead_tokens once that many were trained
    out2 = str(tmp_path / "sae2")
    run_sae_train(_sae_config(url, out2, lr=0.0, holdout_streams=0, tokens=steps * batch, expansion=8, k=2,
                              dead_tokens=40, b_dec_init="zeros"))
    windows = [json.loads(line)["dead_window"] for line in (tmp_path / "sae2" / "metrics.jsonl").read_text().splitlines()]
    assert windows == [16, 32, 40, 40, 40, 40]


def test_the_ce_splice_leaves_massive_tokens_clean(tmp_path):
    import jax

    from harvest.demo import demo_checkpoint
    from harvest.sae import model as M
    from harvest.sae.splice import ce_loss_recovered

    model = demo_checkpoint(tmp_path / "model")
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": f"text number {i}: " + "abc def " * (i + 3)}) + "\n" for i in range(6)))
    spec = M.Spec("topk", 64, 128, 4, 32, 0.0, 0.0, 0.001)
    params = {k: np.asarray(v, np.float32)
              for k, v in jax.device_get(M.init_params(jax.random.key(0), spec, np.zeros(64, np.float32))).items()}
    plain = ce_loss_recovered(str(model), str(data), "resid_post.1", params, spec, tokens=400, max_seq_len=32)
    assert plain["massive_left_clean"] == 0 and plain["ce_sae"] != plain["ce_clean"]
    none = ce_loss_recovered(str(model), str(data), "resid_post.1", params, spec, tokens=400, max_seq_len=32,
                             norm_limit=1e-9, skip_first=1)  # every token over the limit: nothing spliced
    assert none["ce_sae"] == none["ce_clean"] == none["ce_zero"]
    assert none["massive_left_clean"] == sum(min(len(t), 32) - 1 for t in _token_counts(model, data))


def _token_counts(model, data) -> list[list[int]]:
    from harvest.data.prompts import encoder, load_tokenizer

    tokenizer = load_tokenizer(model)
    encode = encoder(tokenizer, "text")
    return [encode([json.loads(line)["text"]])[0] for line in data.read_text().splitlines()]


def test_max_norm_defaults_to_10_and_is_off_with_follow():
    from harvest.config import ConfigError
    from harvest.sae.config import SaeConfig

    base = {"run": ["r"], "tensors": ["resid_post.1"], "out": "o"}
    assert SaeConfig(**base).validate().norm_ratio == 10
    assert SaeConfig(**base, max_norm=0).validate().norm_ratio == 0
    assert SaeConfig(**base, follow=True).validate().norm_ratio == 0
    with pytest.raises(ConfigError, match="--max-norm"):
        SaeConfig(**base, follow=True, max_norm=10).validate()


def test_an_sae_run_from_before_the_rule_resumes_without_it(tmp_path):
    """run.json without max_norm (an SAE run started before --max-norm existed): rerun with the default, it
    resumes as it was trained (no rule), reader positions and all."""
    from harvest.training.run import train as run_sae_train

    url, out = str(tmp_path / "run"), tmp_path / "sae"
    small_run(url)
    run_sae_train(_sae_config(url, str(out), max_norm=0))
    info = json.loads((out / "run.json").read_text())
    del info["saes"]["resid_post.3"]["max_norm"]
    del info["config"]["max_norm"], info["run_settings"]["max_norm"]
    (out / "run.json").write_text(json.dumps(info))
    summary = run_sae_train(_sae_config(url, str(out), tokens=16 * 8, checkpoint_every=8))
    assert summary["step"] == 8 and "massive_left_out" not in summary


@pytest.mark.parametrize("dtype", ["int8", "bfloat16"])
def test_the_rule_reads_norms_as_served_from_a_quantized_run(tmp_path, dtype):
    """An extracted run (the demo model) stored as 8-bit codes or bf16: the rule's norms are those of the values
    served (codes x scales), so a reader in shard order serves exactly the rows a numpy filter keeps."""
    from harvest.config import ExtractConfig
    from harvest.demo import demo_checkpoint
    from harvest.extract.job import run_extract

    rng = np.random.default_rng(3)
    words = "the residual stream holds sparse features that an autoencoder reads back out".split()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(3, 40))))}) + "\n"
                            for _ in range(24)))
    run_extract(ExtractConfig(model=str(demo_checkpoint(tmp_path / "model")), data=str(data), out=str(tmp_path / "run"),
                              dtype=dtype, points="resid_post:1", max_seq_len=64, batch_size=4,
                              shard_size="16KB").validate())
    run = harvest.open(str(tmp_path / "run"))
    special = set(run.info.special_token_ids or ())
    x = np.concatenate([np.asarray(s.activations["resid_post.1"], np.float32)[[t not in special for t in s.tokens]]
                        for s in run.iter_samples()])
    norms = np.linalg.norm(x.astype(np.float64), axis=1)
    median = float(np.median(norms))
    assert run.median_norms("resid_post.1")["resid_post.1"] == pytest.approx(median, rel=1e-12)
    reader = run.token_batches(10**6, ["resid_post.1"], shuffle=False, max_norm=1.05, piece_bytes=4096)
    batch = next(iter(reader))
    np.testing.assert_array_equal(batch["resid_post.1"], x[norms <= 1.05 * median])
    assert reader.massive_left_out == int(np.sum(norms > 1.05 * median)) > 0
