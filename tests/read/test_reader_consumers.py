"""Many consumers of one run: DataLoader workers of several ranks on a run still being written, global JAX
batches over meshes on 2 processes x 4 devices, and shard bytes verified by every consumer, each the chunks it
fetched (runs written before chunk digests: once across all consumers).

The growing run is written by another process with harvest's own commit code (growing_run_writer.py);
the meshes run in tests/reader_mesh_worker.py with jax.distributed on 127.0.0.1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from processes import free_port, pod_env
from reader_helpers import RunWriter, small_run

from harvest.errors import UserError
from harvest.read import CorruptShardError, open_run, shuffle
from harvest.storage import Storage
from harvest.store import encoding, format as fmt

HERE = Path(__file__).resolve().parents[1]  # the workers live beside the shared helpers, in tests/
PIECE = 40 * (4 + 2 * 40)  # piece_bytes for ~40 rows of small_run's two tensors: shards cut into several pieces


# a run still being written, read by 2 ranks x 2 DataLoader workers -----------------------------------------
def shard_tokens(snapshot: dict[int, list], streams: int = 2) -> list[int]:
    """The token ids growing_run_writer.py commits in the first n shards of each stream s, snapshot[s] = [n, its
    generation] (Run.snapshot)."""
    import growing_run_writer as w

    return [t for s, (n, _) in snapshot.items() for k in range(n)
            for t in range(1000 + (k * streams + s) * w.TOKENS, 1000 + (k * streams + s + 1) * w.TOKENS)]


@pytest.fixture
def growing(tmp_path):
    """A run being written by another process, one shard every ~20 ms over 2 streams, 8 shards in already."""
    url = str(tmp_path / "growing")
    writer = subprocess.Popen([sys.executable, str(HERE / "growing_run_writer.py"), url, "2", "3000", "0.02"])
    storage, deadline = Storage(url), time.monotonic() + 60
    while sum(len(storage.listdir(fmt.stream_dir(s))) for s in (0, 1)) < 16:
        assert writer.poll() is None and time.monotonic() < deadline, "the writer did not start"
        time.sleep(0.05)
    yield url
    writer.kill()
    writer.wait()


def grown_past(url: str, snapshot: dict[int, list]) -> None:
    """Wait until the writer has committed more than `snapshot` (Run.snapshot) holds."""
    deadline = time.monotonic() + 30
    while sum(n for n, _ in open_run(url).snapshot().values()) <= sum(n for n, _ in snapshot.values()):
        assert time.monotonic() < deadline, "the writer stopped committing"
        time.sleep(0.02)


def loader_tokens(dataset, start: str = "fork") -> list[int]:
    """Every token 2 workers serve; `start` "spawn": the dataset reaches them pickled, as plain data."""
    import torch

    got = []
    for batch in torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, multiprocessing_context=start):
        tokens = batch["tokens"].numpy()
        np.testing.assert_array_equal(batch["resid_post.1"].numpy(), tokens[:, None] + np.arange(8))
        got += tokens.tolist()
    return got


@pytest.mark.timeout(240)
def test_a_growing_run_read_by_two_ranks_of_two_dataloader_workers(growing):
    settings = dict(seed=3, piece_bytes=10 * 36, shard_buffer=2, epochs=2)
    snapshot = open_run(growing).snapshot()  # taken once, e.g. on rank 0, and given to every rank
    served = []
    for rank in (0, 1):
        grown_past(growing, snapshot)
        run = open_run(growing)  # each rank opens the run later, with more shards committed
        served += loader_tokens(run.torch_dataset(16, snapshot=snapshot, rank=rank, world=2, **settings))
    assert sorted(served) == sorted(shard_tokens(snapshot) * 2)  # every token of the snapshot once an epoch

    dataset = open_run(growing).torch_dataset(16, **settings)  # one rank: the dataset's own snapshot
    grown_past(growing, dataset.snapshot)  # workers start on a run that has grown past it
    assert sorted(loader_tokens(dataset, "spawn")) == sorted(shard_tokens(dataset.snapshot) * 2)

    for refused in (lambda run: run.token_batches(8, rank=0, world=2),
                    lambda run: run.torch_dataset(8, rank=1, world=2)):
        with pytest.raises(UserError, match="still being written.*same snapshot=") as e:
            refused(open_run(growing))
        assert "\n" not in str(e.value)


# JAX global batches over any mesh, 2 processes x 4 devices --------------------------------------------
@pytest.mark.timeout(240)
def test_jax_batches_on_two_processes_for_any_mesh(tmp_path):
    written = small_run(str(tmp_path / "run"))
    out = tmp_path / "out"
    out.mkdir()
    env = pod_env(4)
    coordinator = f"127.0.0.1:{free_port()}"
    procs = [subprocess.Popen([sys.executable, str(HERE / "reader_mesh_worker.py"), coordinator, "2", str(pid),
                               written.storage.url, str(out)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for pid in (0, 1)]
    logs = [p.communicate(timeout=200)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-4000:] for log in logs)

    def steps(mesh: str, pid: int) -> dict:
        return json.loads((out / f"mesh.{mesh}.{pid}.json").read_text())

    holds = {"data1": (["0"], ["0"]), "data2": (["0"], ["8"]), "data2_spanning": (["0", "8"], ["0", "8"]),
             "data8": (["0", "2", "4", "6"], ["8", "10", "12", "14"])}
    for mesh, blocks in holds.items():
        p0, p1 = steps(mesh, 0)["steps"], steps(mesh, 1)["steps"]
        assert [sorted(s, key=int) for s in p0[:1] + p1[:1]] == list(blocks), mesh
        rows: dict[tuple[int, str], list[int]] = {}
        for step, held in [*enumerate(p0), *enumerate(p1)]:
            for block, tokens in held.items():
                assert rows.setdefault((step, block), tokens) == tokens, f"{mesh}: processes disagree on a block"
        served = [t for tokens in rows.values() for t in tokens]
        assert len(served) == len(set(served)) and set(served) <= set(written.rows), mesh  # no token twice
        assert len(served) > len(written.rows) - 16, mesh  # all but what drop_last leaves of each share
        if blocks[0] == blocks[1]:  # processes on the same data indices read the same rows, step for step
            assert p0 == p1, mesh
    refusal = steps("overlapping", 0).get("refused", "")
    assert "overlapping or unequal parts of the batch" in refusal and steps("overlapping", 1)["refused"] == refusal


# each consumer verifies the chunks it reads; before chunk digests, once across ranks and workers -----------
def consumers(run, **settings) -> list:
    readers = [run.token_batches(16, seed=7, rank=r, world=2, worker=w, workers=2, piece_bytes=PIECE, **settings)
               for r in (0, 1) for w in (0, 1)]
    for reader in readers:
        list(reader)
    return readers


def test_each_consumer_verifies_the_chunks_of_every_shard_it_reads(tmp_path):
    written = small_run(str(tmp_path / "run"))
    run = open_run(written.storage.url)
    readers = consumers(run)
    every = {run.shard_path(sc) for sc in run.shards}
    for r in readers:  # each consumer reads pieces of most shards: it checked each of those
        order = r.order()
        everyone = shuffle.epoch_order(shuffle.cut([(sc.stream, sc.shard, sc.tokens) for sc in run.shards],
                                                   order.piece_tokens), order.seed, 0, order.shuffle)
        mine = shuffle.share(everyone, order.rank, order.world, order.worker, order.workers)
        assert r.verified_shards == {run.shard_path(sc) for sc in run.shards
                                     if any((p.stream, p.shard) == (sc.stream, sc.shard) for p in mine)}
    assert set().union(*(r.verified_shards for r in readers)) == every
    # the tensors read, once across consumers (each tiny shard's tensor is one chunk, so each piece fetches it)
    assert sum(r.pieces.bytes_hashed for r in readers) >= sum(sc.bytes for sc in run.shards) * 0.9


@pytest.mark.parametrize("tensor_sha256", [True, False], ids=["per-tensor checksums", "file checksum only"])
def test_before_chunk_digests_each_shard_is_verified_by_one_consumer_of_all(tmp_path, tensor_sha256):
    written = small_run(str(tmp_path / "run"), tensor_sha256=tensor_sha256, chunk_bytes=None)
    run = open_run(written.storage.url)
    readers = consumers(run)  # verify="auto": both tensors asked for, so old sidecars are hashed too
    verified = [r.verified_shards for r in readers]
    assert sum(map(len, verified)) == len(run.shards) and set().union(*verified) == {
        run.shard_path(sc) for sc in run.shards}
    shard_bytes = sum(sc.bytes for sc in run.shards)
    hashed = sum(r.pieces.bytes_hashed for r in readers)
    assert hashed == shard_bytes if not tensor_sha256 else hashed < shard_bytes  # old: whole files, once each


@pytest.mark.parametrize("chunk_bytes", [16 * 1024, None], ids=["chunk digests", "before chunk digests"])
def test_four_consumers_fetch_a_tensor_of_eight_from_s3_not_the_shard_four_times(s3_proxy_url, s3_proxy, chunk_bytes):
    """With chunk digests each consumer checks what it fetched: the tensor is fetched once (chunks and pieces
    align here); before them, the one verifier reads the tensor once more."""
    tensors = {f"resid_post.{i}": 1024 for i in range(8)}
    w = RunWriter(s3_proxy_url, tensors=tensors, streams=1, chunk_bytes=chunk_bytes)
    w.shard(0, [256], final=True)
    run = open_run(s3_proxy_url)
    before = s3_proxy.bytes_down
    readers = [run.token_batches(16, "resid_post.5", rank=r, world=2, worker=k, workers=2, verify="sha256",
                                 piece_bytes=64 * (4 + 2048)) for r in (0, 1) for k in (0, 1)]
    tokens = [t for reader in readers for b in reader for t in b["tokens"].tolist()]
    down = s3_proxy.bytes_down - before
    wanted = 256 * 1024 * 2 + 256 * 4  # the tensor and the tokens
    assert sorted(tokens) == sorted(w.rows)
    assert sum(len(r.verified_shards) for r in readers) == (4 if chunk_bytes else 1)
    # the pieces (each the whole 1 KiB tokens tensor, one chunk), the verifier's one more read of the tensor and
    # the tokens before chunk digests; 4 headers and the small tensors; HTTP's own headers
    copies = 1 if chunk_bytes else 2
    assert copies * wanted <= down <= copies * wanted + 4 * 20 * 1024 + 16 * 1024, (down, run.shards[0].bytes)
    assert down < run.shards[0].bytes / 3


def test_a_flipped_byte_in_a_tensor_read_is_caught_and_one_not_read_costs_nothing(tmp_path):
    written = small_run(str(tmp_path / "run"))
    run = open_run(written.storage.url)
    sc = run.shards[3]
    rel, layout = run.shard_path(sc), encoding.decode_shard(written.storage.read_bytes(run.shard_path(sc)))
    data = bytearray(written.storage.read_bytes(rel))
    at = data.find(layout["mlp_out.3"][5].tobytes())  # a row of mlp_out.3 in the file
    data[at + 1] ^= 0x40
    written.storage.write_bytes(rel, bytes(data))
    alone = run.token_batches(16, "resid_post.3")
    list(alone)
    for readers in (consumers(run, tensors="resid_post.3"), [alone]):
        assert set().union(*(r.verified_shards for r in readers)) == {run.shard_path(sc) for sc in run.shards}
        assert not any(r.skipped_shards for r in readers)
    with pytest.raises(CorruptShardError, match=r"tensor 'mlp_out.3'\) do not match their xxh3_128"):
        consumers(run, tensors="mlp_out.3")
    with pytest.raises(CorruptShardError, match=r"tensor 'mlp_out.3'\) do not match"):
        list(run.token_batches(16, "mlp_out.3"))
