"""Bad configs, checkpoints, layer specs and meshes each end in one clear line naming the input."""

import json
import shutil

import hf_reference as ref
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from harvest.errors import UserError
from harvest.model.config import ModelConfig
from harvest.model.points import parse_points
from harvest.model.weights import load_params
from harvest.runtime.mesh import make_mesh, mesh_shape


def one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message and message
    return message


@pytest.fixture(scope="module")
def qwen2_config(tmp_path_factory):
    ckpt = ref.build_checkpoint("qwen2", tmp_path_factory.mktemp("q"))
    ref.to_v4_dialect(ckpt)
    return json.loads((ckpt / "config.json").read_text())


@pytest.mark.parametrize(
    "change,expected",
    [
        ({"model_type": "mamba"}, "model_type 'mamba' is not supported"),
        ({"rope_theta": None}, "missing 'rope_theta'"),
        ({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope_type 'longrope' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' needs 'rope_scaling.original_max_position"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "needs 'rope_scaling.low_freq_factor'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 4}, "not a multiple of num_key_value_heads 4"),
        ({"num_hidden_layers": "3"}, "'num_hidden_layers' = '3' is not a int"),
        ({"vocab_size": None}, "missing 'vocab_size'"),
        ({"use_sliding_window": True, "sliding_window": 0, "max_window_layers": 0}, "'sliding_window' = 0"),
        ({"rms_norm_eps": None}, "missing 'rms_norm_eps'"),
    ],
)
def test_bad_config_is_refused_naming_the_field(qwen2_config, change, expected):
    hf = {**qwen2_config, **change}
    with pytest.raises(UserError) as e:
        ModelConfig.from_hf(hf)
    assert expected in one_line(e)


def test_v5_config_without_rope_theta_and_qwen3_without_head_dim(tmp_path):
    llama = json.loads((ref.build_checkpoint("llama", tmp_path / "l") / "config.json").read_text())
    del llama["rope_parameters"]["rope_theta"]
    with pytest.raises(UserError, match="rope_theta"):
        ModelConfig.from_hf(llama)
    qwen3 = json.loads((ref.build_checkpoint("qwen3", tmp_path / "q") / "config.json").read_text())
    del qwen3["head_dim"]
    with pytest.raises(UserError, match="missing 'head_dim', which qwen3 needs"):
        ModelConfig.from_hf(qwen3)


def test_v4_and_v5_dialects_parse_to_the_same_config(tmp_path):
    for family in ref.FAMILIES:
        ckpt = ref.build_checkpoint(family, tmp_path / family)
        v5 = ModelConfig.from_dir(ckpt)
        ref.to_v4_dialect(ckpt)
        assert ModelConfig.from_dir(ckpt) == v5, family


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("resid_post:3", "layer 3 does not exist; the model has layers 0-2"),
        ("resid:1", "unknown point 'resid'"),
        ("resid_post:1-x", "'1-x' is not a layer"),
        ("resid_post:2-1", "runs backwards"),
        ("3", "has no point"),
        ("resid_post:1,,mlp_out:2", "empty item"),
        # TransformerLens hook names: refused where harvest has no such point, naming the hooks it has
        ("blocks.0.attn.hook_pattern", "no TransformerLens hook 'blocks.0.attn.hook_pattern'; it has blocks.N.hook_resid_pre"),
        ("resid_post:1,hook_embed", "no TransformerLens hook 'hook_embed'"),
        ("blocks.5.hook_resid_post", "layer 5 does not exist; the model has layers 0-2"),
        ("blocks.1.hook_resid_post,2", "'2' has no point"),
    ],
)
def test_bad_points_spec(spec, expected):
    with pytest.raises(UserError) as e:
        parse_points(spec, num_layers=3)
    assert expected in one_line(e)


def test_points_spec_grammar():
    plan = parse_points("resid_post:20-22,mlp_out:12,attn_out:0,3,5", num_layers=28)
    assert plan.points == (("attn_out", (0, 3, 5)), ("mlp_out", (12,)), ("resid_post", (20, 21, 22)))
    assert plan.num_layers == 23
    assert plan.spec() == "attn_out:0,3,5,mlp_out:12,resid_post:20-22"


@pytest.fixture
def llama(tmp_path):
    return ref.build_checkpoint("llama", tmp_path / "llama")


def rewrite(ckpt, edit):
    file = ckpt / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file)


def test_missing_tensor_is_named(llama):
    rewrite(llama, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(UserError) as e:
        load_params(llama, ModelConfig.from_dir(llama))
    assert "missing tensors model.layers.1.mlp.up_proj.weight" in one_line(e)


def test_unexpected_tensor_is_named(llama):
    rewrite(llama, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": np.zeros(72, np.float32)}))
    with pytest.raises(UserError) as e:
        load_params(llama, ModelConfig.from_dir(llama))
    assert "unexpected tensors model.layers.0.self_attn.q_proj.bias" in one_line(e)


def test_misshaped_tensor_is_named(llama):
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(UserError) as e:
        load_params(llama, ModelConfig.from_dir(llama))
    assert "tensor model.layers.0.mlp.gate_proj.weight has shape [100, 72], config.json implies [96, 72]" in one_line(e)


@pytest.mark.parametrize(
    "model,expected",
    [("/no/such/dir", "no such directory, and not a hub id"),
     ("nobody/no-such-model", "not a local directory and not fetched from the hub")],
)
def test_unreadable_model_path(model, expected):
    with pytest.raises(UserError) as e:
        load_params(model, None)
    assert expected in one_line(e)


def test_directory_without_weights_or_config(tmp_path):
    with pytest.raises(UserError, match="config.json: not found"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize(
    "spec,devices,expected",
    [
        ("data=4,model=4", 8, "data=4 x fsdp=1 x model=4 = 16 devices, but there are 8"),
        ("data=2,tensor=4", 8, "expected 1d, 2d, 3d or sizes"),
        ("3d", 6, "divisible by data=2 x fsdp=2, have 6 devices"),
    ],
)
def test_mesh_that_does_not_fit_is_refused_with_numbers(spec, devices, expected):
    with pytest.raises(UserError) as e:
        mesh_shape(spec, devices)
    assert expected in one_line(e)


def test_mesh_shorthands():
    assert mesh_shape("1d", 8) == {"data": 1, "fsdp": 1, "model": 8}
    assert mesh_shape("2d", 8, num_processes=2) == {"data": 2, "fsdp": 1, "model": 4}
    assert mesh_shape("3d", 8) == {"data": 2, "fsdp": 2, "model": 2}
    assert dict(make_mesh("data=4,model=2").shape) == {"data": 4, "fsdp": 1, "model": 2}


def test_sharded_checkpoint_and_hub_id_from_the_offline_cache(tmp_path):
    """A sharded checkpoint with model.safetensors.index.json loads; so does a hub id found in the HF cache
    (conftest points HF_HUB_CACHE at a temp dir and sets HF_HUB_OFFLINE=1)."""
    import os

    ckpt = ref.build_sharded_checkpoint("mistral", tmp_path / "sharded")
    cfg = ModelConfig.from_dir(ckpt)
    local = load_params(ckpt, cfg)
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = os.path.join(os.environ["HF_HUB_CACHE"], "models--harvest-test--tiny-mistral")
    shutil.copytree(ckpt, os.path.join(repo, "snapshots", commit))
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(commit)
    hub = load_params("harvest-test/tiny-mistral", cfg)
    for a, b in zip(np.asarray(local["layers"]["down_proj"]), np.asarray(hub["layers"]["down_proj"])):
        np.testing.assert_array_equal(a, b)
