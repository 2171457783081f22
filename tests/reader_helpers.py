"""Runs for the reader tests, written shard by shard as the extractor writes them (encoding.shard_parts, a
sidecar with the file's and each tensor's sha256), remembering every row.

Every token id is unique except the special ones (0 and 1, left out by default), so a token names its row.
"""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np

from harvest.storage import Storage
from harvest.store import encoding, format as fmt
from harvest.store.records import Sidecar
from harvest.store.stats import RunningStats

SPECIAL = (0, 1)
TENSORS = {"resid_post.3": 24, "mlp_out.3": 16}


class RunWriter:
    """Writes a run shard by shard, remembering every row: token id -> {tensor: values}."""

    def __init__(self, url: str, tensors: dict[str, int] = TENSORS, streams: int = 3, seed: int = 0,
                 special: bool = True, tensor_sha256: bool = True, chunk_bytes: int | None = encoding.CHUNK_BYTES):
        """tensor_sha256=False: sidecars as harvest wrote them before it recorded each tensor's checksum;
        chunk_bytes=None: as it wrote them before chunk digests."""
        self.storage, self.tensors, self.streams = Storage(url), tensors, streams
        self.tensor_sha256, self.chunk_bytes = tensor_sha256, chunk_bytes
        self.rng = np.random.default_rng(seed)
        self.rows: dict[int, dict[str, np.ndarray]] = {}
        self.next_token, self.shards = 100, [0] * streams
        self.positions = [0] * streams
        self.storage.write_json("run.json", {
            "format_version": fmt.FORMAT_VERSION, "harvest_version": "0.0.test", "model": {"source": f"tiny{seed}"},
            "tokenizer_sha256": "1" * 64, "points": [], "tensors": tensors, "dtype": "bfloat16",
            "compute_dtype": "float32", "max_seq_len": 64, "long": "truncate", "format": "text",
            "data": {"source": "data.jsonl", "num_streams": streams, "counts": None, "mapping": "round_robin"},
            **({"special_token_ids": list(SPECIAL)} if special else {}), "config": {}, "config_sha256": "2" * 64})

    def shard(self, stream: int, lengths: list[int], *, final: bool = False, commit: bool = True) -> str:
        """One shard of samples of `lengths` tokens, each starting with a special token."""
        n = sum(lengths)
        tokens = np.arange(self.next_token, self.next_token + n, dtype=np.int32)
        self.next_token += n
        starts = np.cumsum([0, *lengths[:-1]])
        tokens[starts] = self.rng.choice(SPECIAL, len(starts))
        acts = {k: (self.rng.normal(size=(n, w)) * 3 + 1).astype(ml_dtypes.bfloat16) for k, w in self.tensors.items()}
        for i, t in enumerate(tokens.tolist()):
            if t not in SPECIAL:
                self.rows[t] = {k: a[i] for k, a in acts.items()}
        k, first = self.shards[stream], self.positions[stream]
        parts = encoding.shard_parts(acts, tokens, np.array(lengths),
                                     np.arange(first, first + len(lengths)) * self.streams + stream,
                                     np.zeros(len(lengths), np.int32), {"stream": str(stream), "shard": str(k)})
        data = b"".join(parts)
        chunked = self.chunk_bytes is not None and self.tensor_sha256  # else each tensor's plain digest, as before
        manifest = Sidecar.of_shard(data, stream=stream, shard=k, start=(first, 0), next=(first + len(lengths), 0),
                                    row_start=(first, 0), samples=len(lengths), tokens=n,
                                    stats={name: RunningStats.of(a) for name, a in acts.items()}, skipped=[],
                                    long={}, final=final, records=first + len(lengths),
                                    **({"chunk_bytes": self.chunk_bytes} if chunked else {"digests": encoding.shard_digests(
                                        encoding.file_parts(data), encoding.default_checksum())}))
        if not self.tensor_sha256:
            manifest = dataclasses.replace(manifest, checksum=None, digest=encoding.digest(data, "sha256"),
                                           tensor_digests=None)
        rel = f"{fmt.stream_dir(stream)}/{fmt.shard_stem(k)}"
        self.storage.write_bytes(rel + ".safetensors", data)
        if commit:
            self.storage.write_bytes(rel + ".json", manifest.to_bytes())
            self.shards[stream] += 1
            self.positions[stream] += len(lengths)
        return rel + ".safetensors"


def small_run(url: str, **kw) -> RunWriter:
    """3 streams, 2-3 shards each, samples of 3..40 tokens."""
    w = RunWriter(url, **kw)
    for s in range(3):
        for k in range(2 + (s == 0)):
            w.shard(s, [int(x) for x in w.rng.integers(3, 40, 6)], final=k == 1 + (s == 0))
    return w


