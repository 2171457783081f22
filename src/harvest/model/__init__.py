"""The decoder family: `load_decoder` gives a ready, jitted forward with captures on a mesh."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from harvest.model.config import ModelConfig
from harvest.model.moments import piece_moments
from harvest.model.points import POINTS, CapturePlan, parse_points
from harvest.model.transformer import forward
from harvest.model.weights import load_params, resolve_checkpoint
from harvest.runtime import cores
from harvest.runtime.mesh import constrainer, describe, logical_sharding

__all__ = ["POINTS", "CapturePlan", "Decoder", "ModelConfig", "default_compute_dtype", "load_decoder", "parse_points"]


def default_compute_dtype() -> str:
    """float32 on CPU (XLA's CPU bf16 is ~50x slower), bfloat16 on accelerators."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


@dataclasses.dataclass
class Decoder:
    """Config, capture plan and resident params on a mesh, with the forward jitted once per shape."""

    cfg: ModelConfig
    plan: CapturePlan
    params: dict
    mesh: Mesh
    out_dtype: str | None = None  # cast captures on device (halves device->host bytes for bf16 storage)
    attention: str = "auto"  # model.attention.KINDS; auto: the backend's best (blocks on a one-device CPU mesh)
    replicas: list = dataclasses.field(default_factory=list)  # one-device mesh: more devices that take batches in turn
    moment_slots: int = 0  # > 0: `step` also gives each row's first pieces' mean and M2 (harvest.model.moments)

    def __post_init__(self):
        one_device = self.mesh.devices.size == 1
        if self.replicas and not one_device:
            raise ValueError("replicas need a one-device mesh")
        # One constrain function for the Decoder's life: a new one per call would be a new static arg, a recompile.
        # On one device there is nothing to pin (and a replica's device is not the mesh's).
        constrain = None if one_device else constrainer(self.mesh)
        run = partial(forward, cfg=self.cfg, plan=self.plan, constrain=constrain, attention=self.attention,
                      mesh=None if one_device else self.mesh)
        dtype = self.out_dtype and jnp.dtype(self.out_dtype)
        slots = self.moment_slots

        def step(params, tokens, segment_ids):
            captures = {p: v.astype(dtype or v.dtype) for p, v in run(params, tokens, segment_ids).items()}
            moments = {p: piece_moments(v, segment_ids, slots) for p, v in captures.items()} if slots else {}
            if constrain is not None:  # whole rows at full width, as the captures (the host slices them by row)
                moments = jax.tree.map(lambda m: constrain(m, ("capture", "batch", None, None)), moments)
            return captures, moments

        self._forward = jax.jit(step)
        # (device, its params) in turn; None: the mesh's own placement.
        self._copies = [(d, jax.device_put(self.params, d)) for d in self.replicas]
        self._turns = itertools.cycle([None, *self._copies])

    def describe(self) -> str:
        """Where forwards run, for the end summary."""
        extra = len(self.replicas)
        return describe(self.mesh) + (f", and {extra} more CPU device{'s' * (extra > 1)} taking batches in turn"
                                      if extra else "")

    def shard_batch(self, array: np.ndarray) -> jax.Array:
        """A [batch, seq] host array (the same on every process) placed along the mesh's data axes."""
        sharding = logical_sharding(array.shape, ("batch", None), self.mesh)
        return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])

    def compile(self, shape: tuple[int, int]) -> None:
        """With replicas: compile the forward for batches of `shape` on every device at once, each in a thread
        (XLA lets go of the GIL while it compiles), so that no device's first batch stalls the run compiling
        its own copy while the others wait for work. Without replicas the first call compiles, as before."""
        if not self.replicas:
            return
        tokens = np.zeros(shape, np.int32)
        placed = [(self.params, self.shard_batch(tokens), self.shard_batch(tokens)),
                  *((params, *jax.device_put((tokens, tokens), device)) for device, params in self._copies)]
        with concurrent.futures.ThreadPoolExecutor(len(placed)) as pool:
            list(pool.map(lambda args: self._forward.lower(*args).compile(), placed))

    def __call__(self, tokens: np.ndarray, segment_ids: np.ndarray) -> dict[str, jax.Array]:
        """{point: [n_layers_captured, batch, seq, width]} on device (the mesh, or the replica whose turn it is;
        dispatched asynchronously, so that replicas run side by side)."""
        return self.step(tokens, segment_ids)[0]

    def step(self, tokens: np.ndarray, segment_ids: np.ndarray) -> tuple[dict[str, jax.Array], dict[str, tuple]]:
        """The captures, and {point: (mean, M2)} [n_layers_captured, batch, moment_slots, width] float32 of each
        row's first `moment_slots` pieces ({} without moment slots)."""
        tokens, segment_ids = np.asarray(tokens, np.int32), np.asarray(segment_ids, np.int32)
        turn = next(self._turns)
        if turn is None:
            return self._forward(self.params, self.shard_batch(tokens), self.shard_batch(segment_ids))
        device, params = turn
        return self._forward(params, *jax.device_put((tokens, segment_ids), device))


def load_decoder(model: str | Path, points: str, mesh: Mesh, compute_dtype: str | None = None,
                 out_dtype: str | None = None, replicas: bool = False, moment_slots: int = 0,
                 attention: str = "auto") -> Decoder:
    """Read config and weights (only the layers the points need) straight into the mesh; with `replicas`, a copy
    on each further CPU device that runtime.cores made room for."""
    path = resolve_checkpoint(str(model))
    cfg = ModelConfig.from_dir(path)
    plan = parse_points(points, cfg.num_layers)
    dtype = jnp.dtype(compute_dtype or default_compute_dtype())
    params = load_params(path, cfg, dtype=dtype, mesh=mesh, num_layers=plan.num_layers)
    return Decoder(cfg, plan, params, mesh, out_dtype, attention,
                   replicas=cores.replica_devices(cores.tree_bytes(params)) if replicas else [], moment_slots=moment_slots)
