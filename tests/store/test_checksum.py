"""A shard's checksums: one pass over its bytes gives each tensor's digest, the file's is derived from them and
the header's, the sidecar names the algorithm, and sidecars written before it did (the whole file's sha256)
still read and verify. Checked against digests computed here with hashlib and xxhash directly."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import xxhash
from shard_helpers import closed_shard

from harvest.storage import Storage
from harvest.store import encoding
from harvest.store.committer import Committer
from harvest.store.listing import CorruptShardError, read_chain
from harvest.store.records import Sidecar
from harvest.store.snapshot import read_shard, shard_path

HASHES = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}


def committed(tmp_path, checksum: str | None) -> tuple[Storage, Sidecar, bytes]:
    storage = Storage(str(tmp_path / checksum if checksum else tmp_path / "default"))
    committer = Committer(storage, attempt="0123456789abcdef", checksum=checksum)
    committer.submit(closed_shard())
    committer.close()
    (sidecar,) = read_chain(storage, 0)
    return storage, sidecar, storage.read_bytes(shard_path(sidecar))


def expected(data: bytes, algorithm: str) -> tuple[str, dict[str, str]]:
    """The file's digest and each tensor's, from the safetensors header, as harvest.store.encoding defines them."""
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__")
    spans = sorted((entry["data_offsets"], name) for name, entry in header.items())
    chunk = encoding.CHUNK_BYTES  # a tensor's digest is that of its chunks' digests (each chunk's bytes hashed once)
    tensors = {name: HASHES[algorithm](b"".join(HASHES[algorithm](data[at : min(at + chunk, 8 + n + b)]).digest()
                                               for at in range(8 + n + a, 8 + n + b, chunk))).hexdigest()
               for (a, b), name in spans}
    whole = HASHES[algorithm](HASHES[algorithm](data[: 8 + n]).digest()
                              + b"".join(bytes.fromhex(d) for d in tensors.values()))
    return whole.hexdigest(), tensors


@pytest.mark.parametrize("checksum", [None, "sha256"], ids=["default", "sha256"])
def test_the_committer_records_its_checksum_and_each_digest_checks_the_bytes(tmp_path, checksum):
    storage, sidecar, data = committed(tmp_path, checksum)
    algorithm = checksum or "xxh3_128"
    assert sidecar.checksum == algorithm and json.loads(storage.read_bytes("stream_00000/shard_000000.json"))[
        "checksum"] == algorithm
    assert (sidecar.digest, sidecar.tensor_digests) == expected(data, algorithm)
    assert sidecar.mismatch(data) is None and read_shard(storage, sidecar)["tokens"].tolist() == list(range(8))
    header = int.from_bytes(data[:8], "little") + 8
    in_header = data.index(b'"harvest"')  # the metadata: no tensor's bytes, only the file's digest covers it
    for at, what in ((in_header + 2, f"checksum mismatch: {algorithm}"), (header + 3, "checksum mismatch in tensor"),
                     (len(data) - 1, "checksum mismatch in tensor")):
        flipped = bytearray(data)
        flipped[at] ^= 0x01
        assert what in (sidecar.mismatch(bytes(flipped)) or ""), at
    assert "cut short" in sidecar.mismatch(data[:-1])


def test_a_sidecar_written_before_the_checksum_field_reads_verifies_and_keeps_its_bytes(tmp_path):
    storage, sidecar, data = committed(tmp_path, None)
    old = {k: v for k, v in json.loads(sidecar.to_bytes()).items()
           if k not in ("checksum", "digest", "tensor_digests", "chunk_bytes", "chunk_digests")}
    old["sha256"] = hashlib.sha256(data).hexdigest()
    n = int.from_bytes(data[:8], "little")
    spans = {k: e["data_offsets"] for k, e in json.loads(data[8 : 8 + n]).items() if k != "__metadata__"}
    old["tensor_sha256"] = {k: hashlib.sha256(data[8 + n + a : 8 + n + b]).hexdigest() for k, (a, b) in spans.items()}
    raw = json.dumps(old, sort_keys=True).encode()
    storage.write_bytes("stream_00000/shard_000000.json", raw)
    (legacy,) = read_chain(storage, 0)
    assert legacy.checksum is None and legacy.algorithm == "sha256" and legacy.digest == old["sha256"]
    assert json.loads(legacy.to_bytes()) == old  # rewritten (a snapshot handed to workers) under its own keys
    assert legacy.mismatch(data) is None and read_shard(storage, legacy)["tokens"].tolist() == list(range(8))
    flipped = bytearray(data)
    flipped[len(data) - 1] ^= 0x01
    assert "checksum mismatch in tensor" in legacy.mismatch(bytes(flipped))
    del old["tensor_sha256"]  # older still: the whole file's sha256 alone
    oldest = Sidecar.from_json(old)
    assert oldest.tensor_digests is None and oldest.mismatch(data) is None
    assert "checksum mismatch: sha256" in oldest.mismatch(bytes(flipped))


def test_a_checksum_this_harvest_does_not_know_is_one_line_when_read(tmp_path):
    storage, sidecar, _ = committed(tmp_path, None)
    other = Sidecar.from_bytes(sidecar.to_bytes().replace(b"xxh3_128", b"blake9"))
    with pytest.raises(CorruptShardError) as e:
        read_shard(storage, other)
    assert "unknown checksum 'blake9'" in str(e.value) and "upgrade harvest" in str(e.value)
    assert "\n" not in str(e.value)


def test_chunk_digests_cover_each_tensor_in_fixed_chunks_in_the_same_pass(tmp_path):
    """The committer records each tensor's digest per CHUNK_BYTES (one chunk each in this small shard), and
    Sidecar.of_shard any chunk size: each the plain digest of that many of the tensor's bytes, the last shorter;
    a sidecar whose chunk digests do not match the bytes is named by Sidecar.mismatch (and so by verify)."""
    storage, sidecar, data = committed(tmp_path, None)
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__")
    spans = {name: (8 + n + e["data_offsets"][0], 8 + n + e["data_offsets"][1]) for name, e in header.items()}
    assert sidecar.chunk_bytes == encoding.CHUNK_BYTES
    assert sidecar.chunk_digests == {name: [xxhash.xxh3_128(data[a:b]).hexdigest()] if b > a else []
                                     for name, (a, b) in spans.items()}
    small = Sidecar.of_shard(data, stream=0, shard=0, stats={}, chunk_bytes=16, start=(0, 0), next=(1, 0),
                             row_start=(0, 0), samples=1, tokens=8, skipped=[], long={}, final=True, records=1)
    assert small.chunk_digests == {name: [xxhash.xxh3_128(data[at:min(at + 16, b)]).hexdigest()
                                          for at in range(a, b, 16)] for name, (a, b) in spans.items()}
    assert small.tensor_digests == {name: encoding.of_chunks(chunks, "xxh3_128")
                                    for name, chunks in small.chunk_digests.items()}
    assert small.digest != sidecar.digest  # the tensors' digests are their chunks': the chunk size is part of them
    assert small.mismatch(data) is None
    wrong = dict(small.chunk_digests, tokens=["0" * 32, *small.chunk_digests["tokens"][1:]])
    assert "checksum mismatch in a chunk of tensor tokens" in Sidecar.from_bytes(
        dataclasses.replace(small, chunk_digests=wrong).to_bytes()).mismatch(data)
    with pytest.raises(ValueError, match="go together"):
        Sidecar.from_json({**json.loads(small.to_bytes()), "chunk_bytes": None})
