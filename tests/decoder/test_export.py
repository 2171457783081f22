"""`harvest train export`: a HF start exports its tensors back, a trained run's export loads in transformers
with harvest's logits, and a large one is sharded."""

from __future__ import annotations

from pathlib import Path

import hf_reference as ref
import numpy as np
import pytest
from training_helpers import TINY_SHAPE, restored_params, train


def hf_logits(hf_dir: Path, tokens: np.ndarray) -> np.ndarray:
    import torch
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    with torch.no_grad():
        return hf(input_ids=torch.as_tensor(tokens)).logits.numpy()


def harvest_logits(params: dict, hf_dir: Path, tokens: np.ndarray) -> np.ndarray:
    import jax.numpy as jnp

    from harvest.model.config import ModelConfig
    from harvest.model.transformer import logits

    return np.asarray(logits(params, jnp.asarray(tokens, jnp.int32), jnp.ones(tokens.shape, jnp.int32),
                             cfg=ModelConfig.from_dir(hf_dir)))


def assert_logits_equal(ours: np.ndarray, theirs: np.ndarray):
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(theirs))))


TOKENS = np.random.RandomState(3).randint(0, 320, (2, 24))


@pytest.mark.parametrize("family", ref.FAMILIES)
def test_export_of_a_hf_start_gives_its_tensors_back_and_loads_in_transformers(family, text_data, tokenizer_dir,
                                                                               tmp_path):
    """0 steps from a HF model exports exactly the tensors it was given; transformers loads the export and
    its logits equal harvest's own LM head on the checkpointed params."""
    from safetensors.numpy import load_file

    from harvest.decoder.export import export

    ckpt = ref.build_checkpoint(family, tmp_path / "hf", num_layers=2, overrides={"vocab_size": 320})
    out = tmp_path / "run"
    train(model=str(ckpt), tokenizer=str(tokenizer_dir), data=str(text_data), out=str(out), seq_len=64,
          batch_size=8, steps=0)
    done = export(str(out), tmp_path / "export")
    assert done["step"] == 0 and done["files"] == ["model.safetensors"] and "tokenizer.json" in done["tokenizer_files"]
    given, exported = load_file(str(ckpt / "model.safetensors")), load_file(str(tmp_path / "export/model.safetensors"))
    assert set(exported) == set(given)
    for name, value in given.items():
        np.testing.assert_array_equal(exported[name], value, err_msg=name)
    assert_logits_equal(harvest_logits(restored_params(out, 0), tmp_path / "export", TOKENS),
                        hf_logits(tmp_path / "export", TOKENS))


def test_export_after_training_loads_in_transformers_with_harvests_logits(text_data, tokenizer_dir, tmp_path):
    from safetensors.numpy import load_file

    from harvest.decoder.export import export

    ckpt = ref.build_checkpoint("qwen2", tmp_path / "hf", num_layers=2, overrides={"vocab_size": 320})
    out = tmp_path / "run"
    train(model=str(ckpt), tokenizer=str(tokenizer_dir), data=str(text_data), out=str(out), seq_len=64,
          batch_size=8, steps=2, lr=1e-2, warmup=0, checkpoint_every=1, remat="none")
    export(str(out), tmp_path / "export", step=2)
    trained = load_file(str(tmp_path / "export/model.safetensors"))["model.norm.weight"]
    assert not np.allclose(trained, load_file(str(ckpt / "model.safetensors"))["model.norm.weight"])
    assert_logits_equal(harvest_logits(restored_params(out, 2), tmp_path / "export", TOKENS),
                        hf_logits(tmp_path / "export", TOKENS))


def test_export_shards_above_the_size_limit(text_data, tokenizer_dir, tmp_path):
    import transformers

    from harvest.decoder.export import export

    out = tmp_path / "run"
    train(shape=TINY_SHAPE, tokenizer=str(tokenizer_dir), data=str(text_data), out=str(out), seq_len=64,
          batch_size=8, steps=0)
    done = export(str(out), tmp_path / "hf", max_shard_bytes=40_000)
    assert len(done["files"]) > 1 and (tmp_path / "hf/model.safetensors.index.json").exists()
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
