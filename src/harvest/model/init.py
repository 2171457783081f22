"""Fresh params from a shape alone (training from scratch), created straight into their shardings.

The layout is `weights.param_specs` (the one description of our tensors); values follow HF's
initialization of these families: normal(0, initializer_range) for matrices, ones for norms, zeros
for biases.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from harvest.model.config import ModelConfig
from harvest.model.weights import param_specs, tree_set
from harvest.runtime.mesh import logical_sharding


def param_shardings(cfg: ModelConfig, mesh: Mesh) -> dict:
    """The params pytree's shardings (final norm and LM head included), by the mesh's logical rules."""
    shardings: dict = {}
    for path, spec in param_specs(cfg, head=True).items():
        shape = ((cfg.num_layers,) if spec.layered else ()) + spec.shape
        axes = ((None,) if spec.layered else ()) + spec.axes
        tree_set(shardings, path, logical_sharding(shape, axes, mesh))
    return shardings


def init_params(cfg: ModelConfig, seed: int, mesh: Mesh, dtype: str = "float32",
                initializer_range: float = 0.02) -> dict:
    """Params for `cfg` (drawn in fp32, stored as `dtype`), each tensor from its own key (fold_in of its
    position in the sorted specs)."""
    specs = param_specs(cfg, head=True)

    def make(key):
        params: dict = {}
        for index, (path, spec) in enumerate(sorted(specs.items())):
            shape = ((cfg.num_layers,) if spec.layered else ()) + spec.shape
            leaf = path.rsplit("/", 1)[-1]
            if leaf.endswith("norm"):
                value = jnp.ones(shape, jnp.float32)
            elif leaf.endswith("bias"):
                value = jnp.zeros(shape, jnp.float32)
            else:
                value = initializer_range * jax.random.normal(jax.random.fold_in(key, index), shape, jnp.float32)
            tree_set(params, path, value.astype(dtype))
        return params

    return jax.jit(make, out_shardings=param_shardings(cfg, mesh))(jax.random.key(seed))
