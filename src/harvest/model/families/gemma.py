"""Gemma 1, 2 and 3 (and Gemma 3's multimodal checkpoints, of which harvest runs the language model).

All three: RMSNorm (1 + w) computed in float32, embeddings times sqrt(hidden_size), gelu-tanh gated MLP, an
explicit head_dim, tied embeddings. Gemma 2 and 3 norm each sublayer's output too (four norms a block), scale
queries by query_pre_attn_scalar, and slide a window on some layers; Gemma 2 softcaps attention scores and
logits; Gemma 3 adds per-head q/k-norm and a separate rope base for its sliding layers."""

from __future__ import annotations

import dataclasses
from typing import Any

from harvest.model.config import Fields, ModelConfig
from harvest.model.families import llama
from harvest.model.families.base import Family, Source, through_transformers


def config(hf: dict[str, Any], src: str) -> ModelConfig:
    model_type = hf["model_type"]
    if model_type == "gemma3":  # Gemma3ForConditionalGeneration: the language model's config is text_config
        text = hf.get("text_config")
        if not isinstance(text, dict):
            raise Fields(hf, src).error("a gemma3 config needs 'text_config', its language model's config")
        hf = through_transformers(text, src, "gemma3_text")
    else:
        hf = through_transformers(hf, src, model_type)
    f = Fields(hf, src)
    sizes = f.sizes(head_dim_required=True)
    later = model_type != "gemma"  # Gemma 2 and 3
    sliding = f.sliding(sizes["num_layers"]) if later else [False] * sizes["num_layers"]
    return ModelConfig(
        model_type=model_type,
        **sizes,
        norm_eps=float(f.need("rms_norm_eps", (int, float))),
        **f.ropes(sizes["head_dim"], sliding),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=False,
        qk_norm="head" if model_type in ("gemma3_text", "gemma3") else None,
        sliding_windows=f.windows(sliding),
        norm="rms_one_plus",
        block="sandwich" if later else "pre",
        act=f.activation("hidden_activation" if "hidden_activation" in hf else "hidden_act"),
        embed_scale=True,
        attn_scale=float(f.need("query_pre_attn_scalar", (int, float))) ** -0.5 if later else None,
        # transformers applies the score softcap on Gemma 2 only, and Gemma3ForConditionalGeneration no logit softcap.
        attn_softcap=_cap(f, "attn_logit_softcapping") if model_type == "gemma2" else None,
        final_softcap=_cap(f, "final_logit_softcapping") if model_type != "gemma3" else None,
    )


def _cap(f: Fields, key: str) -> float | None:
    value = f.get(key, None, (int, float))
    return None if value is None else float(value)


def sources(cfg: ModelConfig) -> dict[str, Source]:
    names = llama.sources(cfg)
    if cfg.block == "sandwich":
        names.update({
            "layers/attn_post_norm": Source("layers.{i}.post_attention_layernorm.weight"),
            "layers/mlp_norm": Source("layers.{i}.pre_feedforward_layernorm.weight"),
            "layers/mlp_post_norm": Source("layers.{i}.post_feedforward_layernorm.weight"),
        })
    return names


GEMMA = Family(config, sources, "GemmaForCausalLM")
GEMMA2 = dataclasses.replace(GEMMA, architecture="Gemma2ForCausalLM")
GEMMA3_TEXT = dataclasses.replace(GEMMA, architecture="Gemma3ForCausalLM")
# The multimodal checkpoint (Gemma 3 4B-27B): its language model, saved by transformers 5 under
# model.language_model., by earlier versions (the hub's files) under language_model.model.; the vision tower,
# the projector and an untied copy of the tied head are not read.
GEMMA3 = dataclasses.replace(
    GEMMA, architecture="Gemma3ForConditionalGeneration",
    prefixes=("model.language_model.", "language_model.model.", "model.", ""),
    ignored=r"(.*rotary_emb\.inv_freq|(model\.)?(vision_tower|multi_modal_projector)\..*|language_model\.lm_head\.weight)$")
