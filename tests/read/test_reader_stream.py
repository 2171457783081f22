"""The streaming reader: exactly-once splits over ranks and DataLoader workers, epochs, resuming from a
state dict, ranged reads counted on the wire (moto S3), outputs (numpy, torch, JAX), a run still being
written, corrupt shards, bad input, and a real extraction's special tokens left out.

Runs are written with encoding.encode_shard/sidecar as the extractor writes them. Every token id is unique
except the special ones (0 and 1, left out by default), so a token names its row: each served row is
checked against the values stored for that token.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from reader_helpers import TENSORS, RunWriter, small_run

from harvest.errors import UserError
from harvest.read import CorruptShardError, StateError, UnknownTensorError, open_run
from harvest.store import encoding

@pytest.fixture
def written(tmp_path) -> RunWriter:
    return small_run(str(tmp_path / "run"))


PIECE = 40 * (4 + 2 * 40)  # piece_bytes for ~40 rows of both tensors: shards cut into several pieces


def served(batches) -> tuple[list[int], list[dict]]:
    out = list(batches)
    return [t for b in out for t in np.asarray(b["tokens"]).tolist()], out


def check_rows(written: RunWriter, batches: list[dict], names=TENSORS) -> None:
    for b in batches:
        for row, t in enumerate(np.asarray(b["tokens"]).tolist()):
            for name in names:
                np.testing.assert_array_equal(np.asarray(b[name][row]), written.rows[t][name])


# order, split, epochs, resume ----------------------------------------------------------------------------
def test_three_ranks_by_two_workers_serve_every_token_once(written):
    run = open_run(written.storage.url)
    everyone = []
    for rank in range(3):
        for worker in range(2):
            tokens, batches = served(run.token_batches(16, seed=7, rank=rank, world=3, worker=worker, workers=2,
                                                       piece_bytes=PIECE, shard_buffer=2))
            assert tokens, f"rank {rank} worker {worker} got nothing"
            assert all(len(b["tokens"]) == 16 for b in batches[:-1])
            check_rows(written, batches)
            everyone += tokens
    assert sorted(everyone) == sorted(written.rows)  # special tokens left out, the rest exactly once
    assert run.token_batches(16).shards_seen == 0  # nothing listed before iterating
    assert len(list(run.token_batches(10**6))) == 1


@pytest.mark.timeout(120)
def test_dataloader_workers_split_a_rank_by_themselves(written):
    import torch

    run = open_run(written.storage.url)
    everyone = []
    for rank in range(3):
        settings = dict(seed=7, rank=rank, world=3, piece_bytes=PIECE, shard_buffer=2)
        loader = torch.utils.data.DataLoader(run.torch_dataset(16, **settings), batch_size=None, num_workers=2)
        got = [b for b in loader]
        assert all(isinstance(b["resid_post.3"], torch.Tensor) and b["resid_post.3"].dtype == torch.bfloat16
                   for b in got)
        tokens = sorted(t for b in got for t in b["tokens"].tolist())
        by_hand = sorted(t for w in range(2) for t in served(run.token_batches(16, worker=w, workers=2, **settings))[0])
        assert tokens == by_hand
        everyone += tokens
    assert sorted(everyone) == sorted(written.rows)
    # normalized by the run's stats, merged once in this process: the workers get no per-shard stats
    settings = dict(seed=7, piece_bytes=PIECE, shard_buffer=2, normalize="standardize")
    loader = torch.utils.data.DataLoader(run.torch_dataset(16, "mlp_out.3", **settings), batch_size=None, num_workers=2)
    got = {t: row for b in loader for t, row in zip(b["tokens"].tolist(), b["mlp_out.3"].numpy())}
    want = {t: row for w in range(2) for b in run.token_batches(16, "mlp_out.3", worker=w, workers=2, **settings)
            for t, row in zip(b["tokens"].tolist(), b["mlp_out.3"])}
    assert got.keys() == want.keys() and all(np.array_equal(got[t], want[t]) for t in got)


def test_epochs_reorder_and_a_stopped_reader_resumes_with_exactly_the_rest(written):
    run = open_run(written.storage.url)
    flat, _ = served(run.token_batches(12, seed=3, piece_bytes=PIECE, shard_buffer=2, epochs=2))
    half = len(flat) // 2
    assert sorted(flat[:half]) == sorted(flat[half:]) == sorted(written.rows)  # each epoch: every token once
    assert flat[:half] != flat[half:]  # in another order
    settings = dict(seed=3, piece_bytes=PIECE, shard_buffer=2, epochs=2, rank=1, world=2)
    whole = list(run.token_batches(12, **settings))
    tokens = [np.asarray(b["tokens"]).tolist() for b in whole]
    for stop in (1, 3, len(whole) // 2, len(whole) // 2 + 1, len(whole) - 1):
        reader = run.token_batches(12, **settings)
        it = iter(reader)
        for _ in range(stop):
            next(it)
        state = json.loads(json.dumps(reader.state_dict()))  # as a trainer's checkpoint holds it
        fresh = open_run(written.storage.url).token_batches(12, **settings)
        fresh.load_state_dict(state)
        rest = list(fresh)
        assert [np.asarray(b["tokens"]).tolist() for b in rest] == tokens[stop:], f"stopped after {stop}"
        for a, b in zip(rest, whole[stop:]):
            np.testing.assert_array_equal(a["mlp_out.3"], b["mlp_out.3"])


def test_unshuffled_order_follows_the_shards(written):
    run = open_run(written.storage.url)
    tokens, _ = served(run.token_batches(5, shuffle=False, piece_bytes=PIECE, exclude=[]))
    expected = [int(t) for sc in run.shards for t in run.read_shard(sc)["tokens"]]
    assert tokens == expected


# reading -----------------------------------------------------------------------------------------------
def test_one_tensor_of_eight_reads_only_its_bytes_from_s3(s3_proxy_url, s3_proxy):
    tensors = {f"resid_post.{i}": 1024 for i in range(8)}
    w = RunWriter(s3_proxy_url, tensors=tensors, streams=1)
    w.shard(0, [256], final=True)
    run = open_run(s3_proxy_url)
    shard_bytes = run.shards[0].bytes
    wanted = 256 * 1024 * 2 + 256 * 4  # the tensor and the tokens
    before = s3_proxy.bytes_down
    tokens, batches = served(run.token_batches(64, "resid_post.5", shuffle=False))
    down = s3_proxy.bytes_down - before
    check_rows(w, batches, ["resid_post.5"])
    assert len(tokens) == 255
    # the header (one 16 KiB read), the two ranges, HTTP's own headers and the run's small JSON records (a
    # loaded machine's retry re-reads one): nothing of the other 7 tensors, 512 KiB each
    assert wanted <= down <= wanted + 64 * 1024, (down, shard_bytes)
    assert down < shard_bytes / 6


def test_gcs_reads_the_same_batches_as_local(tmp_path, gcs_url):
    local, remote = small_run(str(tmp_path / "run")), small_run(gcs_url)
    a = list(open_run(local.storage.url).token_batches(32, seed=1, piece_bytes=PIECE))
    b = list(open_run(remote.storage.url).token_batches(32, seed=1, piece_bytes=PIECE))
    assert [x["tokens"].tolist() for x in a] == [x["tokens"].tolist() for x in b]


def test_dtype_normalization_and_several_tensors(written):
    run = open_run(written.storage.url)
    plain = list(run.token_batches(50, seed=2, exclude=[]))
    as_fp32 = list(run.token_batches(50, seed=2, exclude=[], dtype="float32"))
    standard = list(run.token_batches(50, seed=2, exclude=[], normalize="standardize"))
    normed = list(run.token_batches(50, seed=2, exclude=[], normalize="norm", tensors="resid_post.3"))
    assert set(plain[0]) == {"tokens", *TENSORS} and set(normed[0]) == {"tokens", "resid_post.3"}
    stats = {n: run.stats(n) for n in TENSORS}
    for p, f, s in zip(plain, as_fp32, standard):
        for n in TENSORS:
            assert f[n].dtype == np.float32 and s[n].dtype == np.float32
            np.testing.assert_array_equal(f[n], p[n].astype(np.float32))
            want = (p[n].astype(np.float64) - stats[n].mean) / np.sqrt(stats[n].var)
            np.testing.assert_allclose(s[n], want, rtol=1e-5, atol=1e-5)
    every = np.concatenate([b["resid_post.3"] for b in standard])
    np.testing.assert_allclose(every.mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(every.std(0, ddof=1), 1, atol=1e-5)
    squared = np.concatenate([b["resid_post.3"] for b in normed]).astype(np.float64) ** 2
    assert squared.sum(1).mean() == pytest.approx(TENSORS["resid_post.3"], rel=1e-5)


def test_jax_global_batches_over_the_data_axis(written):
    import jax

    run = open_run(written.storage.url)
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    got = list(run.jax_batches(16, "mlp_out.3", mesh=mesh, seed=5))
    want = list(run.token_batches(16, "mlp_out.3", seed=5, drop_last=True))
    assert len(got) == len(want) > 1
    for g, w in zip(got, want):
        assert g["mlp_out.3"].shape == (16, 16) and g["mlp_out.3"].sharding.spec == jax.sharding.PartitionSpec(("data",))
        assert len(g["mlp_out.3"].addressable_shards) == 8
        np.testing.assert_array_equal(np.asarray(g["mlp_out.3"]), w["mlp_out.3"])
        np.testing.assert_array_equal(np.asarray(g["tokens"]), w["tokens"])


def test_a_run_still_being_written(tmp_path, caplog):
    w = RunWriter(str(tmp_path / "run"), streams=2)
    w.shard(0, [10, 12])
    w.shard(1, [7], final=True)
    w.shard(0, [9], commit=False)  # data written, no sidecar yet: does not exist
    run = open_run(w.storage.url)
    reader = run.token_batches(4, epochs=2, exclude=[])
    it = iter(reader)
    with caplog.at_level("INFO", logger="harvest"):
        first = [np.asarray(next(it)["tokens"]) for _ in range(29 // 4)]
    assert reader.shards_seen == 2 and "2 committed shards (29 tokens, 2 streams, 1 still being written)" in caplog.text
    w.shard(0, [9])  # the writer goes on: it rewrites shard 1 and commits it, then one more
    w.shard(0, [5], final=True)
    second = [b["tokens"] for b in it]
    assert reader.shards_seen == 4  # picked up at the next epoch
    assert len(np.concatenate(first + second[:1])) == 29 and len(np.concatenate(second[1:])) == 29 + 14


def test_ranks_given_one_snapshot_split_a_growing_run_exactly_once(tmp_path):
    w = RunWriter(str(tmp_path / "run"), streams=2)
    w.shard(0, [30, 20])
    w.shard(1, [25, 5])
    early = open_run(w.storage.url)  # rank 0 lists the run now, rank 1 after one more commit
    snapshot = early.snapshot()
    w.shard(1, [40], final=True)
    late = open_run(w.storage.url)
    settings = dict(seed=4, world=2, piece_bytes=PIECE, exclude=[], snapshot=snapshot)
    tokens = served(early.token_batches(8, rank=0, **settings))[0] + served(late.token_batches(8, rank=1, **settings))[0]
    assert sorted(tokens) == sorted(int(t) for sc in early.shards for t in early.read_shard(sc)["tokens"])


def test_a_corrupt_shard_stops_the_reader_or_is_skipped(written):
    rel = "stream_00001/shard_000000.safetensors"
    lost = {int(t) for t in encoding.decode_shard(written.storage.read_bytes(rel))["tokens"]}
    data = bytearray(written.storage.read_bytes(rel))
    data[-7] ^= 0xFF  # a bit flip in the last tensor's data: only the checksum shows it
    written.storage.write_bytes(rel, bytes(data))
    run = open_run(written.storage.url)
    with pytest.raises(CorruptShardError) as e:
        list(run.token_batches(8, verify="sha256"))
    message = str(e.value)  # the checksum the sidecar names (xxh3_128 by default)
    assert f"{written.storage.url}/{rel}: " in message and encoding.default_checksum() in message
    assert "\n" not in message
    reader = run.token_batches(8, verify="sha256", on_corrupt="skip")
    tokens, _ = served(reader)
    assert reader.skipped_shards == {rel} and sorted(tokens) == sorted(set(written.rows) - lost)

    written.storage.write_bytes(rel, bytes(data[: len(data) // 2]))  # cut short: the ranges show it
    with pytest.raises(CorruptShardError, match="short"):
        list(open_run(written.storage.url).token_batches(8, "mlp_out.3", verify="header"))


# bad input ---------------------------------------------------------------------------------------------
def test_bad_input_is_one_line(written, tmp_path):
    run = open_run(written.storage.url)
    with pytest.raises(UnknownTensorError) as e:
        run.token_batches(8, ["resid_post.9"])
    assert isinstance(e.value, KeyError) and str(e.value).startswith("'resid_post.9' not in run")
    with pytest.raises(UserError, match="no run.json here"):
        open_run(str(tmp_path / "elsewhere"))

    reader = run.token_batches(8, seed=1)
    next(iter(reader))
    state = reader.state_dict()
    other = small_run(str(tmp_path / "other"), seed=1)
    with pytest.raises(StateError, match="saved for another run") as e:
        open_run(other.storage.url).token_batches(8, seed=1).load_state_dict(state)
    with pytest.raises(StateError, match=r"seed=1 \(now 2\)"):
        run.token_batches(8, seed=2).load_state_dict(state)
    with pytest.raises(StateError, match="not a reader state"):
        run.token_batches(8).load_state_dict({"epoch": 3})
    for err in (e.value,):
        assert "\n" not in str(err)
    with pytest.raises(ValueError, match="rank must be in"):
        run.token_batches(8, rank=3, world=3)


# the trainers people use ---------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_saelens_trainer_steps_fed_by_the_reader(written):
    pytest.importorskip("sae_lens", reason="the test extras install sae-lens")
    import torch
    from sae_lens import SAETrainer, TopKTrainingSAE, TopKTrainingSAEConfig
    from sae_lens.config import SAETrainerConfig

    run = open_run(written.storage.url)
    fed = []

    def rows():  # SAETrainer takes any iterator of [batch, d] tensors
        for batch in run.token_batches(32, "resid_post.3", epochs=None, normalize="norm", as_torch=True):
            fed.append(batch["tokens"])
            yield batch["resid_post.3"]

    torch.manual_seed(0)
    sae = TopKTrainingSAE(TopKTrainingSAEConfig(d_in=24, d_sae=48, k=4, normalize_activations="none"))
    before = sae.W_dec.detach().clone()
    trainer = SAETrainer(SAETrainerConfig(total_training_samples=32 * 6, train_batch_size_samples=32, lr=1e-3,
                                         lr_end=1e-3),
                         sae, rows())
    trained = trainer.fit()
    assert trainer.n_training_steps == 6 and len(fed) == 6 and all(len(t) == 32 for t in fed)
    assert torch.isfinite(trained.W_dec).all() and not torch.equal(trained.W_dec, before)


@pytest.mark.timeout(300)
def test_sparsify_sparse_coder_steps_fed_by_the_reader(written):
    pytest.importorskip("sparsify", reason="the test extras install eai-sparsify")
    import torch
    from sparsify import SparseCoder, SparseCoderConfig

    run = open_run(written.storage.url)
    torch.manual_seed(0)
    coder = SparseCoder(24, SparseCoderConfig(k=4, num_latents=48))
    opt = torch.optim.Adam(coder.parameters(), lr=3e-3)
    fvu = []
    batches = run.token_batches(64, "resid_post.3", epochs=None, dtype="float32", as_torch=True)
    for _, batch in zip(range(40), batches):
        out = coder(batch["resid_post.3"])
        out.fvu.backward()
        coder.remove_gradient_parallel_to_decoder_directions()
        opt.step()
        opt.zero_grad()
        coder.set_decoder_norm_to_unit_norm()
        fvu.append(float(out.fvu.detach()))
    assert np.mean(fvu[-5:]) < 0.9 * np.mean(fvu[:5])  # it learns from what it is fed


# a real extraction --------------------------------------------------------------------------------------
def test_an_extracted_chat_run_leaves_its_special_tokens_out(tmp_path):
    import shutil

    import hf_reference as ref

    from harvest.config import ExtractConfig
    from harvest.demo import demo_checkpoint
    from harvest.extract.job import run_extract

    ckpt = ref.build_checkpoint("qwen2", tmp_path / "qwen2", num_layers=2, overrides={"vocab_size": 320})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_checkpoint(tmp_path / "demo") / name, ckpt / name)
    chats = [{"messages": [{"role": "user", "content": f"What is {i}+{i}?"}, {"role": "assistant", "content": str(2 * i)}]}
             for i in range(4)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats))
    run_extract(ExtractConfig(model=str(ckpt), data=str(tmp_path / "chat.jsonl"), out=str(tmp_path / "out"),
                              points="resid_post:1", format="chat", dtype="float32", max_seq_len=64, batch_size=2,
                              shard_size="4KB").validate())
    run = open_run(str(tmp_path / "out"))
    special = set(run.info.special_token_ids)
    stored = np.concatenate([run.read_shard(sc)["tokens"] for sc in run.shards])
    assert special and np.isin(stored, list(special)).sum() >= 4 * 4  # <|im_start|>/<|im_end|> per message
    tokens, batches = served(run.token_batches(8, seed=1))
    assert sorted(tokens) == sorted(t for t in stored.tolist() if t not in special)
    rows = {(int(s.tokens[j]), s.activations["resid_post.1"][j].tobytes()) for s in run.iter_samples()
            for j in range(len(s))}
    assert all((t, b["resid_post.1"][i].tobytes()) in rows for b in batches for i, t in enumerate(b["tokens"]))
