"""The (data, fsdp, model) device mesh and the logical sharding rules for params and activations.

Code names array dimensions logically ("batch", "embed", "heads", ...); RULES maps each name to mesh
axes, MaxText-style. A dimension that the mapped axes do not divide stays replicated, so odd widths
still run on any mesh (correct, if less parallel).
"""

from __future__ import annotations

import math
import re
from typing import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from harvest.errors import UserError

AXES = ("data", "fsdp", "model")
RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp"),
    "embed": ("fsdp",),
    "vocab": ("model",),
    "heads": ("model",),
    "kv_heads": ("model",),
    "mlp": ("model",),
}
SHORTHANDS = ("1d", "2d", "3d")


class MeshError(UserError):
    pass


def mesh_shape(spec: str, num_devices: int, num_processes: int = 1) -> dict[str, int]:
    """Axis sizes for `--mesh`.

    1d: every device on `model`.  2d: `data` across processes (2 on one process), `model` within.
    3d: like 2d with `fsdp`=2 taken out of `model`.  Explicit: `data=4,fsdp=2,model=8` (missing axes = 1).
    """
    spec = spec.strip()
    if spec in SHORTHANDS:
        if spec == "1d":
            return {"data": 1, "fsdp": 1, "model": num_devices}
        data = num_processes if num_processes > 1 else 2
        fsdp = 2 if spec == "3d" else 1
        if num_devices % (data * fsdp):
            raise MeshError(
                f"--mesh {spec}: needs a device count divisible by data={data} x fsdp={fsdp}, have {num_devices} devices"
            )
        return {"data": data, "fsdp": fsdp, "model": num_devices // (data * fsdp)}
    sizes = {axis: 1 for axis in AXES}
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\w+)\s*=\s*(\d+)\s*", item)
        if not match or match.group(1) not in AXES or int(match.group(2)) < 1:
            raise MeshError(f"--mesh {spec!r}: expected 1d, 2d, 3d or sizes like data=4,fsdp=2,model=8")
        sizes[match.group(1)] = int(match.group(2))
    if math.prod(sizes.values()) != num_devices:
        shown = " x ".join(f"{a}={s}" for a, s in sizes.items())
        raise MeshError(f"--mesh {spec}: {shown} = {math.prod(sizes.values())} devices, but there are {num_devices}")
    return sizes


def make_mesh(spec: str = "1d", devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build the mesh; `data` is the outermost axis so that it spans processes (hosts) first."""
    devices = list(devices if devices is not None else jax.devices())
    num_processes = len({d.process_index for d in devices})
    sizes = mesh_shape(spec, len(devices), num_processes)
    shape = tuple(sizes[a] for a in AXES)
    if devices[0].platform == "tpu":
        from jax.experimental import mesh_utils

        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    else:
        grid = np.array(sorted(devices, key=lambda d: (d.process_index, d.id))).reshape(shape)
    return Mesh(grid, AXES)


def logical_spec(shape: Sequence[int], logical_axes: Sequence[str | None], mesh: Mesh) -> PartitionSpec:
    """PartitionSpec for an array: each dim gets its rule's mesh axes when they divide it, else stays whole."""
    used: set[str] = set()
    parts = []
    for dim, name in zip(shape, logical_axes):
        axes = tuple(a for a in RULES.get(name or "", ()) if mesh.shape[a] > 1 and a not in used)
        if axes and dim % math.prod(mesh.shape[a] for a in axes) == 0:
            used.update(axes)
            parts.append(axes[0] if len(axes) == 1 else axes)
        else:
            parts.append(None)
    return PartitionSpec(*parts)


def logical_sharding(shape: Sequence[int], logical_axes: Sequence[str | None], mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(shape, logical_axes, mesh))


def constrainer(mesh: Mesh | None) -> Callable | None:
    """A `constrain(x, logical_axes)` for model code: pins activation shardings inside jit."""
    if mesh is None:
        return None

    def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, logical_sharding(x.shape, logical_axes, mesh))

    return constrain


def data_slots(mesh: Mesh) -> int:
    """How many parts a batch splits into: its rows go over the data axes (data x fsdp), one block per slot."""
    return math.prod(mesh.shape[a] for a in RULES["batch"])


def describe(mesh: Mesh) -> str:
    return " x ".join(f"{a}={mesh.shape[a]}" for a in AXES)
