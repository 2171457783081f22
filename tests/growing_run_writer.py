"""A run still being written, for tests/read/test_reader_consumers.py: commits shards with harvest's own commit code
(store.commit.commit: the data object under this attempt's name, then the sidecar created only if absent),
round robin over the streams, until it has written MAX_SHARDS or is stopped.

argv: URL STREAMS MAX_SHARDS PAUSE_S. Every token id is unique: shard k of stream s holds ids
base(k, s) .. base(k, s) + TOKENS - 1; activation row of token t is t + [0, 1, ..., WIDTH-1] (float32, exact).
"""

import sys
import time
import uuid

import numpy as np

from harvest.storage import Storage
from harvest.store import encoding, format as fmt
from harvest.store.commit import commit
from harvest.store.records import RunInfo, Sidecar
from harvest.store.stats import RunningStats

NAME, WIDTH, SAMPLES, SAMPLE_TOKENS = "resid_post.1", 8, 4, 10
TOKENS = SAMPLES * SAMPLE_TOKENS


def run_info(streams: int) -> RunInfo:
    return RunInfo(format_version=fmt.FORMAT_VERSION, harvest_version="0.0.test", model={"source": "growing"},
                   tokenizer_sha256="1" * 64, points=[], tensors={NAME: WIDTH}, dtype="float32",
                   compute_dtype="float32", max_seq_len=64, long="truncate", format="text",
                   data={"source": "data.jsonl", "num_streams": streams, "counts": None, "mapping": "round_robin"},
                   config={}, config_sha256="2" * 64, special_token_ids=[])


def main(url: str, streams: int, max_shards: int, pause: float) -> None:
    storage, attempt = Storage(url), uuid.uuid4().hex[:16]
    storage.create_exclusive("run.json", run_info(streams).to_bytes())
    for n in range(max_shards):
        k, s = divmod(n, streams)
        tokens = np.arange(1000 + n * TOKENS, 1000 + (n + 1) * TOKENS, dtype=np.int32)
        acts = tokens[:, None].astype(np.float32) + np.arange(WIDTH, dtype=np.float32)
        first = k * SAMPLES
        parts = encoding.shard_parts({NAME: acts}, tokens, np.full(SAMPLES, SAMPLE_TOKENS),
                                     (np.arange(first, first + SAMPLES) * streams + s).astype(np.int64),
                                     np.zeros(SAMPLES, np.int32), {"stream": str(s), "shard": str(k)})
        sidecar = Sidecar.of_shard(
            parts, stream=s, shard=k, attempt=attempt, start=(first, 0), next=(first + SAMPLES, 0),
            row_start=(first, 0), samples=SAMPLES, tokens=TOKENS, stats={NAME: RunningStats.of(acts)},
            skipped=[], long={}, final=False, records=first + SAMPLES)
        commit(storage, sidecar, parts, guard=lambda stream: None)
        time.sleep(pause)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
