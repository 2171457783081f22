"""A trained SAE read back: exports load in sparsify and SAELens with harvest's latents and reconstructions;
--eval-every logs held-out metrics; `sae eval` reads the held-out stream and, with the model, gives the CE
loss recovered; status shows the run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from extract_helpers import run_harvest
from sae_helpers import BASE, STEPS, TENSOR


def test_exports_load_in_sparsify_and_saelens_with_harvests_outputs(sae_source, straight, tmp_path):
    import torch
    from sae_lens import SAE
    from sparsify import SparseCoder

    from harvest.read.run import open_run
    from harvest.sae import model as M
    from harvest.sae.export import load_sae_run, spec_of

    info, _, params = load_sae_run(straight)
    spec = spec_of(info["saes"][TENSOR])
    x = next(iter(open_run(sae_source["run"]).token_batches(256, [TENSOR], dtype="float32")))[TENSOR]
    latents, recon = (np.asarray(a) for a in M.infer(params[TENSOR], x, spec))
    for fmt in ("sparsify", "saelens"):
        done = run_harvest("sae", "export", straight, "--format", fmt, "--out", str(tmp_path / fmt),
                           env=sae_source["env"])
        assert done.returncode == 0, done.stderr[-3000:]
    coder = SparseCoder.load_from_disk(tmp_path / "sparsify" / TENSOR)
    lens = SAE.load_from_disk(str(tmp_path / "saelens" / TENSOR))
    assert lens.cfg.metadata.hook_name == "blocks.1.hook_resid_post"  # the TransformerLens name of resid_post.1
    with torch.no_grad():
        xt = torch.from_numpy(x)
        top = coder.encode(xt)
        dense = torch.zeros(len(x), spec.latents).scatter_(1, top.top_indices, top.top_acts).numpy()
        theirs = {"sparsify": (dense, coder.decode(top.top_acts, top.top_indices).numpy()),
                  "saelens": (lens.encode(xt).numpy(), lens.decode(lens.encode(xt)).numpy())}
    for fmt, (their_latents, their_recon) in theirs.items():
        np.testing.assert_allclose(their_latents, latents, rtol=1e-5, atol=1e-5, err_msg=fmt)
        np.testing.assert_allclose(their_recon, recon, rtol=1e-5, atol=1e-5, err_msg=fmt)
        assert (their_latents > 0).sum(1).max() <= spec.k


def test_eval_every_logs_the_held_out_metrics(sae_source, straight):
    """--eval-every 4: steps 4, 8, 12 log eval_fvu, eval_l0, eval_dead_fraction; at step 12 they are the
    final SAE's on the first 8 batches of the held-out stream."""
    from harvest.read.run import open_run
    from harvest.sae import model as M
    from harvest.sae.export import load_sae_run, spec_of

    records = {r["step"]: r for r in map(json.loads, Path(straight, "metrics.jsonl").read_text().splitlines())}
    assert [s for s, r in records.items() if "eval_fvu" in r] == [4, 8, 12]
    info, _, params = load_sae_run(straight)
    sae = info["saes"][TENSOR]
    held = open_run(sae_source["run"]).token_batches(64, [TENSOR], dtype="float32", seed=0, epochs=1, drop_last=True,
                                                 streams=sae["holdout_streams"][0])
    x = np.concatenate([b[TENSOR] for _, b in zip(range(8), held)])
    latents, recon = (np.asarray(a) for a in M.infer(params[TENSOR], x, spec_of(sae)))
    want = {"eval_fvu": np.sum((x - recon) ** 2) / np.sum((x - x.mean(0)) ** 2), "eval_l0": (latents > 0).sum(1).mean(),
            "eval_dead_fraction": np.mean(~(latents > 0).any(0))}
    got = records[STEPS]["tensors"][TENSOR]
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-4 * max(1, abs(value)), (key, got[key], value)
    assert records[STEPS]["eval_fvu"] == got["eval_fvu"]


def test_eval_reads_the_held_out_stream_and_status_shows_the_run(sae_source, straight):
    from rich.console import Console

    from harvest.training.status import training_status

    done = run_harvest("sae", "eval", straight, "--tokens", "2000", env=sae_source["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)["tensors"][TENSOR]
    assert 0 < result["fvu"] < 1 and 0 < result["l0"] <= BASE["k"] and result["tokens"] >= 1000
    assert sum(result["firing_histogram"].values()) == round(256 * (1 - result["dead_fraction"]))
    console = Console(width=200, record=True)
    console.print(training_status(straight))
    text = console.export_text()
    assert f"{STEPS}/{STEPS}" in text and TENSOR in text and "topk" in text, text


def test_eval_with_the_model_gives_ce_loss_recovered(sae_source, straight, tmp_path):
    """`sae eval --model --data`: the clean CE equals transformers' loss on the same texts; the trained SAE
    recovers between 0 and 1 of the zero-ablation gap; a zero SAE recovers 0. The demo model is random: its
    one skill is that a token repeats (tied embeddings), so the texts are runs of repeated letters, where the
    clean model beats the zero-ablated one."""
    import torch
    import transformers

    from harvest.sae.export import load_sae_run, spec_of
    from harvest.sae.splice import ce_loss_recovered, text_batches

    rng = np.random.default_rng(0)
    texts = tmp_path / "repeats.jsonl"
    texts.write_text("".join(json.dumps({"text": "".join(chr(rng.integers(97, 123)) * int(rng.integers(2, 9))
                                                         for _ in range(12))}) + "\n" for _ in range(40)))
    texts = str(texts)
    done = run_harvest("sae", "eval", straight, "--tokens", "1500", "--model", str(sae_source["checkpoint"]),
                       "--data", texts, "--max-seq-len", "64", env=sae_source["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    ce = json.loads(done.stdout)["tensors"][TENSOR]["downstream"]
    assert ce["ce_clean"] < ce["ce_sae"] < ce["ce_zero"] and 0 < ce["ce_loss_recovered"] < 1, ce
    hf = transformers.AutoModelForCausalLM.from_pretrained(sae_source["checkpoint"], torch_dtype=torch.float32)
    total = count = 0.0
    for tokens, segments in text_batches(sae_source["checkpoint"], texts, "text", 8, 64, 1500):
        for row, seg in zip(tokens, segments):
            ids = torch.from_numpy(row[seg > 0][None].astype(np.int64))
            if ids.shape[1] > 1:
                with torch.no_grad():
                    total += float(hf(ids, labels=ids).loss) * (ids.shape[1] - 1)
                count += ids.shape[1] - 1
    assert ce["tokens"] == count and abs(ce["ce_clean"] - total / count) < 1e-4, (ce, total / count)

    info, _, params = load_sae_run(straight)
    zero = {k: np.zeros_like(v) for k, v in params[TENSOR].items()}
    spec = spec_of(info["saes"][TENSOR])
    none = ce_loss_recovered(str(sae_source["checkpoint"]), texts, TENSOR, zero, spec, tokens=300, max_seq_len=64)
    assert abs(none["ce_loss_recovered"]) < 1e-6 and none["ce_zero"] > none["ce_clean"], none
