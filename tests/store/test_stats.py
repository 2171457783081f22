"""Per-shard running stats: exact float64 mean and M2 whatever the tensor's size, in bounded memory; shard
bytes exactly as safetensors writes them."""

import json
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save

from harvest.store import encoding, format as fmt
from harvest.store.stats import RunningStats


def _whole(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The definition: the whole tensor converted to float64 at once."""
    x = np.asarray(values, np.float64)
    mean = x.mean(axis=0)
    return mean, ((x - mean) ** 2).sum(axis=0)


def test_chunked_stats_equal_the_whole_tensor_bit_for_bit():
    rng = np.random.default_rng(0)
    for rows, width, dtype in ((1, 4, np.float32), (7, 3, ml_dtypes.bfloat16), (70_001, 48, ml_dtypes.bfloat16),
                                (3_000, 16, np.float16)):
        values = (rng.standard_normal((rows, width)) * 5 + 2).astype(dtype)
        stats = RunningStats.of(values)
        mean, m2 = _whole(values)
        assert stats.count == rows
        np.testing.assert_array_equal(stats.mean, mean)
        np.testing.assert_array_equal(stats.m2, m2)
    empty = RunningStats.of(np.zeros((0, 5), ml_dtypes.bfloat16))
    assert empty.count == 0 and empty.mean.shape == (5,)


def test_stats_of_a_512mb_tensor_allocate_at_most_64mb():
    values = np.ones((2**18, 2**10), ml_dtypes.bfloat16)  # 512 MiB
    values[::3] = 3
    tracemalloc.start()
    try:
        stats = RunningStats.of(values)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= 64 * 2**20, f"{peak / 2**20:.0f} MiB allocated"
    expected = np.full(2**10, (3 * 87382 + (2**18 - 87382)) / 2**18)
    np.testing.assert_allclose(stats.mean, expected, rtol=1e-12)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_shard_parts_are_the_bytes_safetensors_writes(dtype):
    rng = np.random.default_rng(2)
    acts = {f"resid_post.{k}": rng.standard_normal((11, 6)).astype(fmt.DTYPES[dtype]) for k in (3, 12, 7)}
    acts["mlp_out.0"] = rng.standard_normal((11, 4)).astype(fmt.DTYPES[dtype])
    tokens, lengths, sample_ids, variants = np.arange(11, dtype=np.int32), np.array([4, 7]), np.array([5, 9]), np.array([0, 2], np.int32)
    parts = encoding.shard_parts(acts, tokens, lengths, sample_ids, variants, metadata={"stream": "3", "shard": "12"})
    offsets = np.array([0, 4, 11], np.int64)
    fields = {"format": "harvest", "format_version": str(fmt.FORMAT_VERSION), "shard": "12", "stream": "3"}
    expected = save({**acts, "tokens": tokens, "offsets": offsets, "sample_ids": sample_ids.astype(np.int64),
                     "variants": variants}, metadata={"harvest": json.dumps(fields, sort_keys=True)})
    assert b"".join(parts) == expected
    assert encoding.digest(parts, "sha256") == encoding.digest(expected, "sha256")
    empty = encoding.shard_parts({"resid_post.0": np.zeros((0, 6), fmt.DTYPES[dtype])}, np.zeros(0, np.int32),
                                 np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int32), metadata={})
    assert encoding.decode_shard(b"".join(empty))["resid_post.0"].shape == (0, 6)


def test_device_piece_moments_merge_to_the_exact_stats_of_the_pieces():
    """Rows of packed pieces: the device's per-piece mean and M2 (first `slots` pieces of a row; the host's own
    for the rest), merged in float64, equal the exact stats of all pieces' values to float32 rounding."""
    import jax.numpy as jnp

    from harvest.model.moments import piece_moments

    rng = np.random.default_rng(3)
    layers, rows, seq, width, slots = 2, 3, 40, 6, 2
    segments = np.zeros((rows, seq), np.int32)
    for r, lengths in enumerate(([5, 17, 3, 9], [40], [1, 1, 30])):
        segments[r, : sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    values = (rng.standard_normal((layers, rows, seq, width)) * 3 + 50).astype(ml_dtypes.bfloat16)
    mean, m2 = (np.asarray(a) for a in piece_moments(jnp.asarray(values), jnp.asarray(segments), slots))
    assert mean.shape == m2.shape == (layers, rows, slots, width)
    for j in range(layers):
        pieces, means, m2s = [], [], []
        for r in range(rows):
            for k, piece in enumerate(range(1, segments[r].max() + 1)):
                pieces.append(values[j, r][segments[r] == piece])
                means.append(mean[j, r, k] if k < slots else None)
                m2s.append(m2[j, r, k] if k < slots else None)
                if k < slots:
                    want = RunningStats.of(pieces[-1])
                    np.testing.assert_allclose(means[-1], want.mean, rtol=1e-6)
                    np.testing.assert_allclose(m2s[-1], want.m2, rtol=1e-5)
        merged, exact = RunningStats.of_pieces(pieces, means, m2s), RunningStats.of(np.concatenate(pieces))
        assert merged.count == exact.count == 106
        np.testing.assert_allclose(merged.mean, exact.mean, rtol=1e-6)
        np.testing.assert_allclose(merged.m2, exact.m2, rtol=1e-5)
