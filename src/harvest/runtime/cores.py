"""A CPU host's cores as JAX devices, for a one-process CPU run.

XLA:CPU runs one device's programs one after another, and a loop inside a program (block-sparse
attention is one) on a single thread: one device leaves the other cores idle for half of a packed
forward. So before the backend starts, a one-process run gives JAX one CPU device per core (at most
MAX_DEVICES), and extraction puts them on the mesh's data axis as one slot: each step's batch is split
over them, each device holding a copy of the weights and running the same compiled program on its own
rows (so the program compiles once, and a row's values are the same bits whatever the core count).
"""

from __future__ import annotations

import os

import jax
import numpy as np

MAX_DEVICES = 4
WEIGHTS_SHARE = 4  # the weights' copies together take at most 1/WEIGHTS_SHARE of the host's memory
_exposed = False  # this process's CPU device count was set here


def expose_cores(other_layout: bool) -> bool:
    """One JAX CPU device per core, unless the devices are laid out otherwise (`other_layout`: several
    processes, or a --mesh), their count is already someone else's choice (XLA_FLAGS, jax config), or the
    backend has started. True where the CPU devices are the cores, as this call (or an earlier one) set them."""
    global _exposed
    if other_layout or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return False
    if not _exposed and jax.config.jax_num_cpu_devices < 0:
        try:
            jax.config.update("jax_num_cpu_devices", max(1, min(os.cpu_count() or 1, MAX_DEVICES)))
            _exposed = True
        except RuntimeError:  # the backend has started: its device count stands
            pass
    return _exposed


def core_devices(weight_bytes: int) -> list[jax.Device]:
    """The CPU devices that split a one-process run's batches (see expose_cores): as many as there are, fewer
    where the weights' copies would take more than their share of memory."""
    if jax.default_backend() != "cpu":
        return jax.local_devices()[:1]
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    fit = int(memory // WEIGHTS_SHARE // max(weight_bytes, 1))
    return jax.local_devices()[: max(1, min(jax.local_device_count(), fit))]


def tree_bytes(tree) -> int:
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree)))
