"""Fresh params from a shape alone (training from scratch), drawn on the devices straight into their shardings.

The layout is `weights.param_specs` (the one description of our tensors); values follow HF's
initialization of these families: normal(0, initializer_range) for matrices, ones for norms, zeros
for biases. One jitted program draws the whole tree with `out_shardings` set, so each device computes only
its own shard and no host ever holds a whole tensor (a 7B model in bf16 is 15 GB: drawn on a host and copied,
it took minutes). Each (tensor, layer) has its own key, folded from the seed, and jax's partitionable threefry
(its default since 0.5) makes the values independent of the mesh: one seed gives the same params on 1 device
or on a pod.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from harvest.model.config import ModelConfig
from harvest.model.weights import ParamSpec, param_specs, tree_set
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


@functools.lru_cache(maxsize=8)
def init_program(cfg: ModelConfig, mesh: Mesh, dtype: str = "float32", initializer_range: float = 0.02):
    """The jitted program seed -> params (one per shape: every seed and every later job load it compiled; lower it
    to see its cost without running it)."""
    specs = sorted(param_specs(cfg, head=True).items())

    def build(seed: jax.Array) -> dict:
        params: dict = {}
        root = jax.random.key(seed)
        for index, (path, spec) in enumerate(specs):
            tree_set(params, path, _draw(cfg, path, spec, jax.random.fold_in(root, index), initializer_range, dtype))
        return params

    return jax.jit(build, out_shardings=param_shardings(cfg, mesh))


def init_params(cfg: ModelConfig, seed: int, mesh: Mesh, dtype: str = "float32",
                initializer_range: float = 0.02) -> dict:
    """Params for `cfg` (drawn in fp32, stored as `dtype`), sharded over `mesh` as its logical rules say."""
    return init_program(cfg, mesh, dtype, initializer_range)(np.uint32(seed & 0xFFFFFFFF))  # jax keys: 32 bits


def _draw(cfg: ModelConfig, path: str, spec: ParamSpec, key: jax.Array, scale: float, dtype: str) -> jax.Array:
    """One tensor, drawn in fp32 and stored as `dtype`; a layered one draws layer by layer (lax.map: one layer's
    scratch at a time, not the whole stack's) from each layer's own key, so layer i does not depend on depth."""
    leaf, layers = path.rsplit("/", 1)[-1], cfg.num_layers
    if leaf.endswith("norm"):  # the identity: w = 1, or w = 0 where the norm scales by (1 + w) (Gemma)
        fill = jnp.zeros if cfg.norm == "rms_one_plus" else jnp.ones
        return fill(((layers,) if spec.layered else ()) + spec.shape, dtype)
    if leaf.endswith("bias"):
        return jnp.zeros(((layers,) if spec.layered else ()) + spec.shape, dtype)

    def normal(k: jax.Array) -> jax.Array:
        return (scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)

    if not spec.layered:
        return normal(key)
    return jax.lax.map(lambda layer: normal(jax.random.fold_in(key, layer)), jnp.arange(layers))
