"""OLMo 2 and 3: no norm before a sublayer, an RMSNorm (w * x in float32) after it, before the residual add;
q/k-norm over all heads of the projection at once; SwiGLU. OLMo 3 slides a window on three layers of four."""

from __future__ import annotations

import dataclasses
from typing import Any

from harvest.model.config import Fields, ModelConfig
from harvest.model.families import llama
from harvest.model.families.base import Family, Source, through_transformers


def config(hf: dict[str, Any], src: str) -> ModelConfig:
    model_type = hf["model_type"]
    hf = through_transformers(hf, src, model_type)
    f = Fields(hf, src)
    sizes = f.sizes()
    sliding = f.sliding(sizes["num_layers"])
    bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        model_type=model_type,
        **sizes,
        norm_eps=float(f.need("rms_norm_eps", (int, float))),
        **f.ropes(sizes["head_dim"], sliding),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=False,
        qk_norm="full",
        sliding_windows=f.windows(sliding),
        norm="rms_fp32",
        block="post",
        act=f.activation("hidden_act", "silu"),
    )


def sources(cfg: ModelConfig) -> dict[str, Source]:
    names = llama.sources(cfg)
    names.update({"layers/attn_post_norm": Source("layers.{i}.post_attention_layernorm.weight"),
                  "layers/mlp_post_norm": Source("layers.{i}.post_feedforward_layernorm.weight")})
    return names


OLMO2 = Family(config, sources, "Olmo2ForCausalLM")
OLMO3 = dataclasses.replace(OLMO2, architecture="Olmo3ForCausalLM")
