"""Top-k over latents split across the mesh's `model` axis, without gathering the [rows, latents] array.

A per-row top-k runs in two stages: each device takes the k largest of its own latents per row, the
candidates (k x model per row: values and global latent ids) are gathered over `model`, and the k largest
of those are the result. It equals one global lax.top_k, ties included: each device's candidates come
ordered by (value desc, id asc) and the devices' blocks follow each other in id order, so the second
top-k, which prefers the earlier position among equals, prefers the lower id as the first would.

BatchTopK's threshold (the n-th largest value of the whole batch) is found by bisection on the float's
bits instead (exact for values >= 0, whose bit patterns sort as the values do): 31 counts, each summed
over every device, and no candidates at all, where k x rows candidates from every device would be
k x rows x devices values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

DATA_AXES = ("data", "fsdp")
FLOAT32_INF_BITS = 0x7F800000


def _sharded(mesh: Mesh | None, latents: int) -> bool:
    return mesh is not None and mesh.shape["model"] > 1 and latents % mesh.shape["model"] == 0


def top_k(x: jax.Array, k: int, mesh: Mesh | None = None) -> tuple[jax.Array, jax.Array]:
    """(values [B, k], global ids [B, k]) of each row's k largest, as lax.top_k gives them; with `mesh`, x's
    rows over its data axes and latents over `model`, in two stages."""
    if not _sharded(mesh, x.shape[-1]):
        return jax.lax.top_k(x, k)
    per_device = x.shape[-1] // mesh.shape["model"]

    def local(block):
        values, ids = jax.lax.top_k(block, min(k, per_device))
        ids = ids + jax.lax.axis_index("model") * per_device
        values = jax.lax.all_gather(values, "model", axis=1, tiled=True)
        ids = jax.lax.all_gather(ids, "model", axis=1, tiled=True)
        values, picked = jax.lax.top_k(values, k)
        return values, jnp.take_along_axis(ids, picked, axis=1)

    rows = PartitionSpec(DATA_AXES, None)
    return jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec(DATA_AXES, "model"), out_specs=(rows, rows),
                         check_vma=False)(x)  # the gathered candidates are the same on every `model` device


def kth_value(x: jax.Array, k: int, mesh: Mesh | None = None) -> jax.Array:
    """Each row's k-th largest, [B, 1] (top_k's last value). Sliced straight out of lax.top_k, XLA:CPU sorts
    whole rows instead (~25x slower at 4,096 latents); the barrier keeps the top-k whole."""
    return jax.lax.optimization_barrier(top_k(x, k, mesh)[0])[:, -1:]


def kth_largest(x: jax.Array, n: int, mesh: Mesh | None = None) -> jax.Array:
    """The n-th largest element of x [B, L] (values >= 0); with `mesh` (rows over its data axes, latents over
    `model`) by bisection on the bits, every device counting its own block."""
    if not _sharded(mesh, x.shape[-1]):
        return jax.lax.optimization_barrier(jax.lax.top_k(x.reshape(-1), n)[0])[-1]  # as kth_value

    def local(block):
        bits = jax.lax.bitcast_convert_type(block.astype(jnp.float32) + 0.0, jnp.int32)  # -0.0 becomes 0.0

        def halve(_, bounds):
            lo, hi = bounds  # invariant: at least n elements >= lo; fewer than n > hi
            mid = lo + (hi - lo + 1) // 2
            mine = jnp.minimum(jnp.sum(bits >= mid, dtype=jnp.int32), n)  # capped: the sum stays in int32
            count = jax.lax.psum(mine, mesh.axis_names)
            return jnp.where(count >= n, mid, lo), jnp.where(count >= n, hi, mid - 1)

        lo, _ = jax.lax.fori_loop(0, 31, halve, (jnp.int32(0), jnp.int32(FLOAT32_INF_BITS)))
        return jax.lax.bitcast_convert_type(lo, jnp.float32)

    return jax.shard_map(local, mesh=mesh, in_specs=PartitionSpec(DATA_AXES, "model"), out_specs=PartitionSpec())(x)
