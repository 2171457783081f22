"""Self-tests of the HF reference helper (tests/hf_reference.py)."""

import json

import numpy as np
import pytest

import hf_reference as H  # noqa: E402

IDS = np.random.default_rng(0).integers(0, 211, size=(2, 7))


@pytest.mark.parametrize("family", H.FAMILIES)
def test_captures_all_points_and_v4_dialect(family, tmp_path):
    ckpt = H.build_checkpoint(family, tmp_path / family, num_layers=2)
    cfg = json.loads((ckpt / "config.json").read_text())
    heads_wide = cfg["num_attention_heads"] * cfg.get("head_dim", 72 // cfg["num_attention_heads"])
    caps = H.hf_captures(ckpt, IDS)
    assert set(caps) == {(p, layer) for p in H.POINTS for layer in range(2)}
    for (point, layer), arr in caps.items():
        assert arr.dtype == np.float32
        assert arr.shape == (2, 7, {"mlp_hidden": 100, "attn_z": heads_wide}.get(point, 72))
    # Residual bookkeeping of the capture points.
    for layer in range(2):
        np.testing.assert_allclose(
            caps["resid_mid", layer], caps["resid_pre", layer] + caps["attn_out", layer], atol=1e-5
        )
        np.testing.assert_allclose(
            caps["resid_post", layer], caps["resid_mid", layer] + caps["mlp_out", layer], atol=1e-5
        )

    H.to_v4_dialect(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert "rope_parameters" not in cfg and "layer_types" not in cfg and "rope_theta" in cfg
    caps_v4 = H.hf_captures(ckpt, IDS)
    for key, arr in caps.items():
        np.testing.assert_array_equal(caps_v4[key], arr)


def test_sharded_bf16_with_padding(tmp_path):
    ckpt = H.build_sharded_checkpoint("llama", tmp_path / "sharded", dtype="bfloat16", num_layers=2)
    assert (ckpt / "model.safetensors.index.json").exists()
    assert len(list(ckpt.glob("model-*.safetensors"))) > 1
    mask = np.ones_like(IDS)
    mask[0, :2] = 0  # left padding
    caps = H.hf_captures(ckpt, IDS, dtype="bfloat16", attention_mask=mask)
    assert caps["resid_post", 1].dtype == np.float32
    assert np.isfinite(caps["resid_post", 1][:, 2:]).all()
