"""Training from scratch: init_params draws the params on the devices, sharded as the mesh's logical rules say,
with values that depend on the seed only (not on the mesh, nor on the depth), distributed as HF initializes
these families. The previous host-side draw (numpy) gave other values for a seed: what is promised is the
distribution and determinism per seed, not those numbers."""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # shapes.py: the published 7B shape
from shapes import model_config  # noqa: E402

from harvest.model.config import ModelConfig  # noqa: E402
from harvest.model.init import init_params, init_program, param_shardings  # noqa: E402
from harvest.model.weights import param_specs, tree_get  # noqa: E402
from harvest.runtime.mesh import make_mesh  # noqa: E402

FIELDS = dict(model_type="qwen2", vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=128,
              tie_word_embeddings=False)


def tiny(layers: int) -> ModelConfig:
    return ModelConfig.from_hf({**FIELDS, "num_hidden_layers": layers}, "tiny")


def host(params: dict) -> dict:
    return jax.tree.map(np.asarray, params)


@pytest.fixture(scope="module")
def drawn():
    cfg = tiny(3)
    mesh = make_mesh("fsdp=4,model=2")
    return cfg, mesh, init_params(cfg, 7, mesh)


def test_sharded_as_the_logical_rules_say(drawn):
    cfg, mesh, params = drawn
    expected = param_shardings(cfg, mesh)
    for path in param_specs(cfg, head=True):
        leaf, sharding = tree_get(params, path), tree_get(expected, path)
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim), path
        assert all(s.data.shape == sharding.shard_shape(leaf.shape) for s in leaf.addressable_shards), path
    assert any(not tree_get(expected, p).is_fully_replicated for p in param_specs(cfg, head=True))


def test_values_depend_on_the_seed_only(drawn):
    """The same seed on one device and a deeper model gives the same layers as on fsdp x model."""
    cfg, _, params = drawn
    one_device = make_mesh("data=1", jax.devices()[:1])
    deeper = host(init_params(tiny(5), 7, one_device))
    for path, spec in param_specs(cfg, head=True).items():
        mine, theirs = np.asarray(tree_get(params, path)), tree_get(deeper, path)
        np.testing.assert_array_equal(mine, theirs[: cfg.num_layers] if spec.layered else theirs, err_msg=path)
    other = host(init_params(tiny(5), 8, one_device))
    assert not np.array_equal(deeper["layers"]["q_proj"], other["layers"]["q_proj"])


def test_distributed_as_hf_initializes(drawn):
    cfg, _, params = drawn
    values = host(params)
    for path in param_specs(cfg, head=True):
        value, leaf = tree_get(values, path), path.rsplit("/", 1)[-1]
        if leaf.endswith("norm"):
            np.testing.assert_array_equal(value, 1.0, err_msg=path)
        elif leaf.endswith("bias"):
            np.testing.assert_array_equal(value, 0.0, err_msg=path)
        else:
            assert abs(value.mean()) < 0.003 and abs(value.std() - 0.02) < 0.002, path
    layers = values["layers"]["q_proj"]
    assert not np.array_equal(layers[0], layers[1])  # each layer its own draw


def test_a_7b_model_is_built_on_the_devices_without_host_arrays():
    """The 7B shape on 8 devices: the program's only input is the seed (no tensor comes from a host) and it
    writes each device's shard only (lowered, not run: 15 GB)."""
    cfg = model_config("7b")
    mesh = make_mesh("fsdp=8")
    lowered = init_program(cfg, mesh, "bfloat16").lower(np.uint32(0))
    assert [a.shape for a in jax.tree.leaves(lowered.args_info)] == [()]
    shardings = param_shardings(cfg, mesh)
    assert not shardings["embed"].is_fully_replicated
    outputs = lowered.out_info
    total = 0
    for path in param_specs(cfg, head=True):
        out, sharding = tree_get(outputs, path), tree_get(shardings, path)
        assert str(out.dtype) == "bfloat16" and out.sharding.is_equivalent_to(sharding, len(out.shape)), path
        total += np.prod(out.shape)
    assert total > 7e9
