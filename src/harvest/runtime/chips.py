"""The accelerators harvest runs on, as their vendors publish them: peak bf16 FLOP/s, HBM size and bandwidth,
chip-to-chip bandwidth. One table, read by training's MFU, the benches and the on-paper model (docs/performance.md).

Numbers are per JAX device: one per chip on TPU v4/v5e/v5p/v6e (a v4 chip's two TensorCores are one device)
and per GPU. Peaks are dense (no structured sparsity).
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    kinds: tuple[str, ...]  # jax.Device.device_kind prefixes that mean this chip
    bf16_flops: float  # peak dense bf16 FLOP/s
    hbm_bytes: float
    hbm_bytes_per_s: float
    link_bytes_per_s: float | None  # chip to chip: TPU ICI (bidirectional, per chip), GPU NVLink; None: unpublished
    source: str


GB = 1e9
GIB = 2**30
CHIPS = (
    Chip("TPU v4", ("TPU v4",), 275e12, 32 * GIB, 1200 * GB, None, "https://cloud.google.com/tpu/docs/v4"),
    Chip("TPU v5e", ("TPU v5 lite", "TPU v5e"), 197e12, 16 * GB, 819 * GB, 400 * GB,
         "https://cloud.google.com/tpu/docs/v5e"),
    Chip("TPU v5p", ("TPU v5p", "TPU v5"), 459e12, 95 * GIB, 2765 * GB, 1200 * GB,
         "https://cloud.google.com/tpu/docs/v5p"),
    Chip("TPU v6e", ("TPU v6 lite", "TPU v6e"), 918e12, 32 * GB, 1638 * GB, 800 * GB,
         "https://cloud.google.com/tpu/docs/v6e"),
    Chip("NVIDIA H100 SXM", ("NVIDIA H100",), 989e12, 80 * GB, 3350 * GB, 900 * GB,
         "https://www.nvidia.com/en-us/data-center/h100/"),
    Chip("NVIDIA H200", ("NVIDIA H200",), 989e12, 141 * GB, 4800 * GB, 900 * GB,
         "https://www.nvidia.com/en-us/data-center/h200/"),
    Chip("NVIDIA A100 SXM 80GB", ("NVIDIA A100",), 312e12, 80 * GB, 2039 * GB, 600 * GB,
         "https://www.nvidia.com/en-us/data-center/a100/"),
)


def chip_named(name: str) -> Chip:
    for chip in CHIPS:
        if chip.name == name:
            return chip
    raise KeyError(name)


def this_chip() -> Chip | None:
    """The table's row for this process's devices; None on CPU or an accelerator not in the table."""
    kind = jax.devices()[0].device_kind
    # Longest prefix first: "TPU v5 lite" (v5e) must not be read as "TPU v5" (v5p).
    matches = [(len(prefix), chip) for chip in CHIPS for prefix in chip.kinds if kind.startswith(prefix)]
    return max(matches, key=lambda m: m[0])[1] if matches else None


def peak_flops_per_device(dtype: str) -> float:
    """The table's peak for this accelerator (fp32 counted at half of bf16); on CPU or an unknown accelerator a
    measured matmul rate in that dtype, so MFU still reads as a share of what the device can do."""
    chip = this_chip()
    if chip is not None:
        return chip.bf16_flops if dtype == "bfloat16" else chip.bf16_flops / 2
    return measured_matmul_flops()


def measured_matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    device = jax.local_devices()[0]
    a = jax.device_put(np.random.default_rng(0).standard_normal((n, n), np.float32), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    start = time.perf_counter()
    for _ in range(repeats):
        matmul(a).block_until_ready()
    return 2 * n**3 * repeats / (time.perf_counter() - start)
