"""Closed shards made here, as the host thread cuts them, for tests of the Committer alone."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from harvest.store.committer import ClosedShard


def closed_shard(shard: int = 0, final: bool = True) -> ClosedShard:
    """Stream 0's shard `shard`: two samples (records 2k and 2k+1) in two captured pieces, chained after the
    shards before it."""
    rng = np.random.default_rng(shard)
    blocks = [rng.normal(size=(n, 8)).astype(ml_dtypes.bfloat16) for n in (3, 5)]
    start, after = (2 * shard, 0), (2 * shard + 2, 0)
    return ClosedShard(stream=0, shard=shard, tensors={"resid_post.1": blocks, "mlp_out.0": [b[:, :4] for b in blocks]},
                       tokens=np.arange(8, dtype=np.int32), lengths=np.array([3, 5]),
                       sample_ids=np.array([2 * shard, 2 * shard + 1]), variants=np.zeros(2, np.int32), start=start,
                       next=after, row_start=after, skipped=[], long={}, final=final, records=2,
                       moments={name: ([None, None], [None, None]) for name in ("resid_post.1", "mlp_out.0")})
