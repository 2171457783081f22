"""Every family equals HF transformers at every capture point: on one device and on 8 CPU devices with the
model sharded, over packed rows whose samples are longer than the sliding windows (each sample gets the
values it gets alone in HF), in fp32; the LM head's logits (softcapped where the family caps them) too. bf16:
test_model.test_bf16_is_as_close_to_fp32_as_hf_bf16_is, for every family."""

import hf_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_model import assert_close, packed_rows, run

from harvest.model.config import ModelConfig
from harvest.model.transformer import logits
from harvest.model.weights import load_params
from harvest.runtime.mesh import make_mesh

# Rows of 128 tokens: samples crossing the 64-token blocks, a whole-row sample, padding; every sample is longer
# than the 5-token windows of the windowed families.
LENGTHS = [[40, 25, 63], [128], [7, 90]]


@pytest.fixture(scope="module", params=ref.NEW_FAMILIES)
def family(request, tmp_path_factory):
    """(name, checkpoint, rows, segments, HF's captures of each sample alone)."""
    name = request.param
    ckpt = ref.build_checkpoint(name, tmp_path_factory.mktemp(name))
    ids, segments = packed_rows(LENGTHS, 128, seed=5)
    alone = []
    for row, lens in enumerate(LENGTHS):
        start = 0
        for n in lens:
            alone.append((row, start, n, ref.hf_captures(ckpt, ids[row:row + 1, start:start + n])))
            start += n
    return name, ckpt, ids, segments, alone


def check_samples(ours, alone, rtol=1e-5):
    for row, start, n, theirs in alone:
        assert set(ours) == set(theirs)
        assert_close({k: v[row:row + 1, start:start + n] for k, v in ours.items()}, theirs, rtol=rtol)


@pytest.mark.parametrize("attention", ["dense", "blocks"])
def test_every_point_of_each_packed_sample_equals_hf_on_one_device(family, attention):
    _, ckpt, ids, segments, alone = family
    check_samples(run(ckpt, ids, segments, block_sparse=attention == "blocks"), alone)


def test_every_point_equals_hf_with_the_model_sharded_over_8_devices(family):
    _, ckpt, ids, segments, alone = family
    ids, segments = np.concatenate([ids, ids[:1]]), np.concatenate([segments, segments[:1]])  # 4 rows: data=2
    check_samples(run(ckpt, ids, segments, mesh=make_mesh("data=2,fsdp=2,model=2")), alone)


def test_the_logits_equal_hf(family):
    _, ckpt, ids, _, _ = family
    tokens = ids[:1, :40]
    cfg = ModelConfig.from_dir(ckpt)
    params = load_params(ckpt, cfg, head=True)
    ours = jax.jit(logits, static_argnames="cfg")(params, jnp.asarray(tokens), jnp.ones_like(tokens), cfg=cfg)
    theirs = ref.hf_logits(ckpt, tokens)
    np.testing.assert_allclose(np.asarray(ours), theirs, rtol=1e-5, atol=1e-5 * float(np.abs(theirs).max()))
