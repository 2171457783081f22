"""Per-shard running stats: exact float64 mean and M2 whatever the tensor's size, in bounded memory."""

import tracemalloc

import ml_dtypes
import numpy as np

from harvest.store.format import RunningStats


def _whole(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The definition: the whole tensor converted to float64 at once."""
    x = np.asarray(values, np.float64)
    mean = x.mean(axis=0)
    return mean, ((x - mean) ** 2).sum(axis=0)


def test_chunked_stats_equal_the_whole_tensor_bit_for_bit():
    rng = np.random.default_rng(0)
    for rows, width, dtype in ((1, 4, np.float32), (7, 3, ml_dtypes.bfloat16), (70_001, 48, ml_dtypes.bfloat16)):
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
