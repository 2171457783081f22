"""Synthetic runs written with encoding.encode_shard/sidecar, as the extractor would write them: 2 round-robin
streams, records with 1 or 2 variants, skipped records, shards of a few pieces, the last one final (stream 1's
final shard is empty), bf16 activations. Every token id is unique in the run, so a token identifies its row."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from harvest.storage import Storage
from harvest.store import encoding, format as fmt
from harvest.store.records import Sidecar
from harvest.store.stats import RunningStats

TENSORS = {"mlp_out.0": 16, "resid_post.1": 8}
COUNTS = [9, 8]
PIECES_PER_SHARD = 4
SKIPPED = {(0, 3), (1, 5)}  # (stream, record index)


@dataclasses.dataclass
class Piece:
    sample_id: int
    index: int
    variant: int
    tokens: np.ndarray
    acts: dict[str, np.ndarray]


@dataclasses.dataclass
class FakeRun:
    url: str
    storage: Storage
    pieces: dict[tuple[int, int], Piece]  # (sample_id, variant) -> piece
    shards: dict[int, list[tuple[list[Piece], list[dict], tuple[int, int], tuple[int, int], bool, int]]]

    def all_tokens(self) -> np.ndarray:
        return np.concatenate([p.tokens for p in self.pieces.values()])

    def all_acts(self, name: str) -> np.ndarray:
        return np.concatenate([p.acts[name] for p in self.pieces.values()])


def write_shard(storage: Storage, stream: int, shard: int, pieces: list[Piece], skipped: list[dict],
                start, next_, final: bool, records: int) -> None:
    acts = {name: (np.concatenate([p.acts[name] for p in pieces]) if pieces
                   else np.zeros((0, w), ml_dtypes.bfloat16)) for name, w in TENSORS.items()}
    tokens = np.concatenate([p.tokens for p in pieces]) if pieces else np.zeros(0, np.int32)
    data = encoding.encode_shard(acts, tokens, np.array([len(p.tokens) for p in pieces], np.int64),
                                 np.array([p.sample_id for p in pieces], np.int64),
                                 np.array([p.variant for p in pieces], np.int32),
                                 metadata={"stream": str(stream), "shard": str(shard)})
    manifest = Sidecar.of_shard(data, stream=stream, shard=shard, start=tuple(start), next=tuple(next_),
                                row_start=tuple(start), samples=len(pieces), tokens=len(tokens),
                                stats={name: RunningStats.of(a) for name, a in acts.items()}, skipped=skipped,
                                long={"truncated": 0, "chunked": 0, "skipped": 0}, final=final, records=records)
    base = f"{fmt.stream_dir(stream)}/{fmt.shard_stem(shard)}"
    storage.write_bytes(base + ".safetensors", data)
    storage.write_bytes(base + ".json", manifest.to_bytes())


def fake_run(root, name: str = "run", seed: int = 0, counts: list[int] = COUNTS, known: bool = True) -> FakeRun:
    """known=False: a plain source of unknown length (data.counts null, one stream)."""
    url = str(root / name)
    storage = Storage(url)
    rng = np.random.default_rng(seed)
    num_streams = len(counts)
    storage.write_json("run.json", {
        "format_version": fmt.FORMAT_VERSION, "harvest_version": "0.0.test",
        "model": {"source": "tiny", "model_type": "qwen2", "config_sha256": "0" * 64, "num_layers": 2,
                  "hidden_size": 8, "intermediate_size": 16},
        "tokenizer_sha256": "1" * 64, "points": [["mlp_out", [0]], ["resid_post", [1]]], "tensors": TENSORS,
        "dtype": "bfloat16", "compute_dtype": "float32", "max_seq_len": 16, "long": "chunk", "format": "text",
        "data": {"source": "data.jsonl", "num_streams": num_streams, "counts": counts if known else None, "mapping": "round_robin"},
        "config": {}, "config_sha256": "2" * 64})
    next_token = 1
    pieces: dict[tuple[int, int], Piece] = {}
    shards = {}
    for s, count in enumerate(counts):
        events = []  # Piece or skipped dict, in stream order
        for i in range(count):
            sample_id = i * num_streams + s
            if (s, i) in SKIPPED:
                events.append({"sample_id": sample_id, "location": f"data.jsonl:{sample_id + 1}", "reason": "bad"})
                continue
            for v in range(2 if i % 3 == 1 else 1):
                n = int(rng.integers(1, 8))
                tokens = np.arange(next_token, next_token + n, dtype=np.int32)
                next_token += n
                acts = {name: (rng.normal(size=(n, w)) * (1 + k) + 1.5 + k).astype(ml_dtypes.bfloat16)
                        for k, (name, w) in enumerate(TENSORS.items())}
                piece = Piece(sample_id, i, v, tokens, acts)
                pieces[(sample_id, v)] = piece
                events.append(piece)
        stream_shards = []
        current, skipped, start = [], [], (0, 0)
        for event in events:  # as the writer does: a shard closes before the piece that overflows it
            if isinstance(event, dict):
                skipped.append(event)
                continue
            if len(current) == PIECES_PER_SHARD:
                stream_shards.append((current, skipped, start, (event.index, event.variant), False, event.index))
                current, skipped, start = [], [], (event.index, event.variant)
            current.append(event)
        if s == 1:  # an empty final shard
            stream_shards.append((current, skipped, start, (count, 0), False, count))
            current, skipped, start = [], [], (count, 0)
        stream_shards.append((current, skipped, start, (count, 0), True, count))
        for k, shard in enumerate(stream_shards):
            write_shard(storage, s, k, *shard)
        shards[s] = stream_shards
        done_tokens = sum(len(p.tokens) for sh in stream_shards for p in sh[0])
        storage.write_json(f"{fmt.stream_dir(s)}/progress.json", {
            "stream": s, "records_done": count, "total": count, "samples": sum(len(sh[0]) for sh in stream_shards),
            "tokens": done_tokens, "shards": len(stream_shards), "tokens_per_s": 0.0, "worker": f"w{s}",
            "updated_at": "2024-01-01T00:00:00+00:00", "done": True})
    return FakeRun(url, storage, pieces, shards)
