"""TransformerLens hook names in --points: the six points harvest captures under the names TransformerLens's
own HookedTransformer gives them, mixed with harvest's spec; a TL hook harvest has no point for is one line
naming those it has; an extraction named either way writes the same run; `sae train --tensors` takes them too."""

from __future__ import annotations

import pytest
from extract_helpers import text_streams

from harvest.errors import UserError
from harvest.model.points import POINTS, parse_points
from harvest.tl_hooks import tl_hook_name, tl_hook_of_tensor


def test_the_names_are_transformer_lens_own_hooks():
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    tl = HookedTransformer(HookedTransformerConfig(n_layers=2, d_model=16, n_ctx=8, d_head=4, d_vocab=10,
                                                   act_fn="gelu"))
    names = [tl_hook_name(point, layer) for point in POINTS for layer in (0, 1)]
    assert set(names) <= set(tl.hook_dict), sorted(set(names) - set(tl.hook_dict))
    assert tl_hook_name("mlp_hidden", 1) == "blocks.1.mlp.hook_post"
    assert "blocks.0.attn.hook_pattern" in tl.hook_dict  # a TL hook harvest does not capture
    assert tl_hook_of_tensor("resid_post.12") == "blocks.12.hook_resid_post" and tl_hook_of_tensor("tokens") is None


def test_tl_names_and_harvest_spec_mix_to_one_plan():
    tl = parse_points("blocks.12.hook_resid_post,blocks.3.hook_mlp_out,blocks.0.hook_resid_pre,"
                      "blocks.0.hook_resid_mid,blocks.0.hook_attn_out,blocks.0.mlp.hook_post,resid_post:1-2", 24)
    ours = parse_points("resid_pre:0,attn_out:0,resid_mid:0,mlp_hidden:0,mlp_out:3,resid_post:1,2,12", 24)
    assert tl == ours


def test_an_extraction_named_in_tl_hooks_writes_the_same_run(tmp_path):
    from harvest.config import ExtractConfig
    from harvest.extract.job import run_extract
    from harvest.read.run import open_run

    checkpoint, _, streams = text_streams(tmp_path, 2, n=40)
    runs = {}
    specs = {"tl": "blocks.0.mlp.hook_post,blocks.1.hook_resid_post", "ours": "mlp_hidden:0,resid_post:1"}
    for name, points in specs.items():
        out = tmp_path / name
        run_extract(ExtractConfig(model=str(checkpoint), data=str(streams), out=str(out), points=points,
                                  dtype="float32", max_seq_len=64, batch_size=4).validate())
        runs[name] = open_run(str(out))
    assert set(runs["tl"].tensors) == {"mlp_hidden.0", "resid_post.1"} and runs["tl"].tensors == runs["ours"].tensors
    for a, b in zip(*(sorted((tmp_path / n).rglob("shard_*.safetensors")) for n in ("tl", "ours"))):
        assert a.read_bytes() == b.read_bytes()


def test_sae_tensors_take_tl_names_and_refuse_a_hook_harvest_lacks():
    from harvest.sae.config import SaeConfig

    cfg = SaeConfig(run=["RUN"], tensors=["blocks.12.hook_resid_post", "mlp_out.3", "blocks.0.mlp.hook_post"],
                    out="OUT").validate()
    assert cfg.tensor_names == ("resid_post.12", "mlp_out.3", "mlp_hidden.0")
    with pytest.raises(UserError) as e:
        SaeConfig(run=["RUN"], tensors=["blocks.0.attn.hook_pattern"], out="OUT").validate()
    assert "\n" not in str(e.value) and str(e.value).startswith("--tensors 'blocks.0.attn.hook_pattern': harvest captures no")
