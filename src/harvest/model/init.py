"""Fresh params from a shape alone (training from scratch), placed straight into their shardings.

The layout is `weights.param_specs` (the one description of our tensors); values follow HF's
initialization of these families: normal(0, initializer_range) for matrices, ones for norms, zeros
for biases. Each (tensor, layer) is drawn on the host from its own seed, so the values do not depend on
the mesh, and each process draws only the layers its devices hold (XLA compiles jax.random slowly on
CPU: ~2 s per tensor).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from harvest.model.config import ModelConfig
from harvest.model.weights import ParamSpec, param_specs, tree_get, tree_set
from harvest.runtime.mesh import logical_sharding


def _full_shape(cfg: ModelConfig, spec: ParamSpec) -> tuple[int, ...]:
    return ((cfg.num_layers,) if spec.layered else ()) + spec.shape


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> dict:
    """The params pytree's shardings (final norm and LM head included), by the mesh's logical rules."""
    shardings: dict = {}
    for path, spec in param_specs(cfg, head=True).items():
        axes = ((None,) if spec.layered else ()) + spec.axes
        tree_set(shardings, path, logical_sharding(_full_shape(cfg, spec), axes, mesh))
    return shardings


def init_params(cfg: ModelConfig, seed: int, mesh: Mesh, dtype: str = "float32",
                initializer_range: float = 0.02) -> dict:
    """Params for `cfg` (drawn in fp32, stored as `dtype`)."""
    params: dict = {}
    shardings = param_shardings(cfg, mesh)
    for index, (path, spec) in enumerate(sorted(param_specs(cfg, head=True).items())):
        shape = _full_shape(cfg, spec)
        leaf = path.rsplit("/", 1)[-1]
        kind = "ones" if leaf.endswith("norm") else "zeros" if leaf.endswith("bias") else "normal"

        def block(index_in, index=index, kind=kind, spec=spec, shape=shape):
            layers = range(*index_in[0].indices(shape[0])) if spec.layered else [None]
            inner = index_in[1:] if spec.layered else index_in
            parts = [_draw(kind, spec.shape, (seed, index, -1 if layer is None else layer), initializer_range)[inner]
                     for layer in layers]
            return (np.stack(parts) if spec.layered else parts[0]).astype(dtype)

        tree_set(params, path, jax.make_array_from_callback(shape, tree_get(shardings, path), block))
    return params


def _draw(kind: str, shape: tuple[int, ...], key: tuple[int, int, int], scale: float) -> np.ndarray:
    if kind == "ones":
        return np.ones(shape, np.float32)
    if kind == "zeros":
        return np.zeros(shape, np.float32)
    return scale * np.random.default_rng([key[0], key[1], key[2] + 1]).standard_normal(shape, np.float32)
