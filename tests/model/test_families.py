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


@pytest.mark.parametrize("name", ref.NEW_FAMILIES)
def test_the_hub_dialect_of_config_json_reads_as_the_one_transformers_5_writes(name, tmp_path):
    """Hub checkpoints carry transformers-4 keys (rope_theta, rope_local_base_freq, rotary_pct, ...)."""
    ckpt = ref.build_checkpoint(name, tmp_path, num_layers=2)
    v5 = ModelConfig.from_dir(ckpt)
    ref.to_v4_dialect(ckpt)
    assert ModelConfig.from_dir(ckpt) == v5


@pytest.mark.parametrize("name,convert", [("gpt2", ref.to_bare_gpt2), ("gemma3", ref.to_new_gemma3_keys)],
                         ids=["gpt2-hub-names-and-mask-buffers", "gemma3-language-model-under-model."])
def test_the_other_layouts_of_a_checkpoint_load_to_the_same_values(name, convert, tmp_path):
    ckpt = ref.build_checkpoint(name, tmp_path, num_layers=2)
    tokens = np.random.RandomState(1).randint(0, 211, (2, 11))
    before = run(ckpt, tokens)
    convert(ckpt)
    after = run(ckpt, tokens)
    for key, values in before.items():
        np.testing.assert_array_equal(after[key], values, err_msg=str(key))


def test_a_sharded_bf16_checkpoint_loads_as_hf_reads_it(tmp_path):
    ckpt = ref.build_sharded_checkpoint("gemma2", tmp_path, dtype="bfloat16", max_shard_size="20KB")
    tokens = np.random.RandomState(2).randint(0, 211, (2, 11))
    ours = run(ckpt, tokens, dtype=np.float32)
    theirs = ref.hf_captures(ckpt, tokens, dtype="float32")  # bf16 weights, float32 compute in both
    assert_close(ours, theirs, rtol=1e-5)


def test_a_family_it_does_not_know_is_one_line_naming_those_it_does(tmp_path):
    from harvest.errors import UserError
    from harvest.model.families import SUPPORTED

    with pytest.raises(UserError) as refused:
        ModelConfig.from_hf({"model_type": "mamba"}, "x/config.json")
    assert str(refused.value) == f"x/config.json: model_type 'mamba' is not supported (supported: {', '.join(SUPPORTED)})"
    assert {"gpt2", "gpt_neox", "gemma", "gemma2", "gemma3_text", "gemma3", "olmo2", "olmo3"} <= set(SUPPORTED)
