"""Every reader checks the bytes it serves, whatever its share: with chunk digests in the sidecar each rank checks
the chunks of the pieces it is dealt (a flipped byte is refused, or skipped, by the rank that would serve it),
while runs written before chunk digests keep the older rule (the rank dealt a shard's first piece checks it);
and a shard's offsets, sample ids and variants are checked by every reader, not only by `Run.sample`."""

from __future__ import annotations

import numpy as np
import pytest
from reader_helpers import SPECIAL, RunWriter

from harvest.read import CorruptShardError, open_run, shuffle
from harvest.read.shardfile import parse_header

ROWS = 40 * (4 + 2 * 24 + 2 * 16)  # piece_bytes for 40 rows of both tensors


def shard_file(w: RunWriter) -> tuple[str, bytearray]:
    rel = "stream_00000/shard_000000.safetensors"
    return rel, bytearray(w.storage.read_bytes(rel))


def dealt(run, reader) -> list[shuffle.Piece]:
    """The pieces of epoch 0 `reader` serves (harvest.read.shuffle, as the reader deals them)."""
    order = reader.order()
    pieces = shuffle.cut([(sc.stream, sc.shard, sc.tokens) for sc in run.shards], order.piece_tokens)
    everyone = shuffle.epoch_order(pieces, order.seed, 0, order.shuffle)
    return shuffle.share(everyone, order.rank, order.world, order.worker, order.workers)


def flip_in(data: bytearray, piece: shuffle.Piece) -> None:
    """Flip a byte of resid_post.3 in the middle row of `piece` (a chunk inside the piece's rows)."""
    span = parse_header(bytes(data)).tensors["resid_post.3"]
    at = span.rows((piece.lo + piece.hi) // 2, (piece.lo + piece.hi) // 2 + 1)[0]
    data[at + 3] ^= 0x10


def served(tokens: np.ndarray, pieces: list[shuffle.Piece]) -> list[int]:
    return sorted(t for p in pieces for t in tokens[p.lo:p.hi].tolist() if t not in SPECIAL)


@pytest.mark.parametrize("chunk_bytes", [256, None], ids=["chunk digests", "before chunk digests"])
def test_two_ranks_each_refuse_or_skip_a_flipped_byte_in_a_piece_they_are_dealt(tmp_path, chunk_bytes):
    w = RunWriter(str(tmp_path / "run"), streams=1, chunk_bytes=chunk_bytes)
    w.shard(0, [30] * 8, final=True)  # 240 tokens: 6 pieces of 40 rows
    rel, data = shard_file(w)
    tokens = np.frombuffer(bytes(data), np.int32, count=240, offset=parse_header(bytes(data)).tensors["tokens"].start)
    run = open_run(w.storage.url)
    settings = dict(seed=5, world=2, piece_bytes=ROWS, verify="auto")
    share = {r: dealt(run, run.token_batches(8, rank=r, **settings)) for r in (0, 1)}
    first = next(r for r in (0, 1) if any(p.lo == 0 for p in share[r]))  # the older rule's one verifier
    bad = {r: next(p for p in share[r] if p.lo != 0) for r in (0, 1)}
    for r in (0, 1):
        flip_in(data, bad[r])
    w.storage.write_bytes(rel, bytes(data))

    if chunk_bytes is None:  # the older rule: the first piece's rank refuses the shard, the other serves it
        with pytest.raises(CorruptShardError):
            list(run.token_batches(8, rank=first, **settings))
        other = run.token_batches(8, rank=1 - first, on_corrupt="skip", **settings)
        got = sorted(t for b in other for t in b["tokens"].tolist())
        assert not other.skipped_shards and got == served(tokens, share[1 - first])
        return
    for r in (0, 1):
        with pytest.raises(CorruptShardError) as e:
            list(run.token_batches(8, rank=r, **settings))
        assert f"{rel}: bytes " in str(e.value) and "of tensor 'resid_post.3') do not match" in str(e.value)
        assert "\n" not in str(e.value)
        reader = run.token_batches(8, rank=r, on_corrupt="skip", **settings)
        got = sorted(t for b in reader for t in b["tokens"].tolist())
        assert reader.skipped_shards == {rel} and reader.verified_shards == {rel}
        assert got == served(tokens, [p for p in share[r] if p != bad[r]])  # every piece but the bad one


@pytest.mark.parametrize("name", ["offsets", "sample_ids", "variants"])
def test_a_changed_offset_sample_id_or_variant_is_refused_by_every_reader(tmp_path, name):
    """offsets[2] += 3 made a reader leaving out each sample's first token serve a sink token and drop a real
    one; sample ids and variants were not looked at. Each rank now checks them against the sidecar."""
    w = RunWriter(str(tmp_path / "run"), streams=1)
    w.shard(0, [12, 9, 14, 7], final=True)
    rel, data = shard_file(w)
    span = parse_header(bytes(data)).tensors[name]
    values = np.frombuffer(data, span.dtype, count=span.shape[0], offset=span.start)
    values[2] += 3  # a view: changes the bytes
    w.storage.write_bytes(rel, bytes(data))
    run = open_run(w.storage.url)
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        settings = dict(rank=rank, world=world, skip_first=1, exclude=[], piece_bytes=ROWS // 4)
        with pytest.raises(CorruptShardError, match=rf"{rel}: the bytes of tensor '{name}' do not match"):
            list(run.token_batches(4, **settings))
        reader = run.token_batches(4, on_corrupt="skip", **settings)
        assert list(reader) == [] and reader.skipped_shards == {rel}
    with pytest.raises(CorruptShardError):
        run.sample(0)
