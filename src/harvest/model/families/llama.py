"""The Llama family: Llama 2/3, Mistral, Qwen2/2.5, Qwen3. A pre-norm block (RMSNorm w * x), SwiGLU, full
rotary, GQA; Qwen2's q/k/v biases, Qwen3's per-head q/k-norm, Mistral's and Qwen2's windows."""

from __future__ import annotations

from typing import Any

from harvest.model.config import Fields, ModelConfig
from harvest.model.families.base import Family, Source, linear

# transformers' own defaults for tie_word_embeddings when the key is absent (HF semantics, not a guess).
_TIE_DEFAULT = {"qwen2": False, "llama": False, "mistral": False, "qwen3": False}
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


def config(hf: dict[str, Any], src: str) -> ModelConfig:
    f = Fields(hf, src)
    model_type = hf["model_type"]
    f.one_of("hidden_act", hf.get("hidden_act", "silu"), {"silu": "silu"})
    sizes = f.sizes(head_dim_required=model_type == "qwen3")
    if sizes["head_dim"] % 2:
        raise f.error(f"head_dim {sizes['head_dim']} must be even for rotary embeddings")
    if f.partial_rotary() != 1.0:
        raise f.error(f"partial_rotary_factor {f.partial_rotary()!r} is not supported (only 1.0)")
    attention_bias = bool(hf.get("attention_bias", False))
    return ModelConfig(
        model_type=model_type,
        **sizes,
        norm_eps=float(f.need("rms_norm_eps", (int, float))),
        rope=f.rope(sizes["head_dim"]),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", _TIE_DEFAULT[model_type])),
        qkv_bias=True if model_type == "qwen2" else (attention_bias and model_type != "mistral"),
        o_bias=attention_bias and model_type in ("llama", "qwen3"),
        mlp_bias=bool(hf.get("mlp_bias", False)) and model_type == "llama",
        qk_norm="head" if model_type == "qwen3" else None,
        sliding_windows=f.windows(_sliding(f, model_type, sizes["num_layers"])),
    )


def _sliding(f: Fields, model_type: str, num_layers: int) -> list[bool]:
    """Which layers attend through a sliding window, in both dialects."""
    if f.layer_types(num_layers) is not None:
        return f.sliding(num_layers)
    window = f.hf.get("sliding_window")
    if model_type == "mistral":
        return [window is not None] * num_layers
    if model_type in ("qwen2", "qwen3"):
        on = bool(f.hf.get("use_sliding_window", False)) and window is not None
        first = f.hf.get("max_window_layers", num_layers)
        return [on and i >= first for i in range(num_layers)]
    return [False] * num_layers


def sources(cfg: ModelConfig) -> dict[str, Source]:
    """HF's names of the Llama layout, which Gemma and OLMo reuse."""
    a, m = "layers.{i}.self_attn.", "layers.{i}.mlp."
    return {
        "embed": Source("embed_tokens.weight", "table"),
        "layers/attn_norm": Source("layers.{i}.input_layernorm.weight"),
        "layers/q_proj": linear(a + "q_proj.weight"), "layers/k_proj": linear(a + "k_proj.weight"),
        "layers/v_proj": linear(a + "v_proj.weight"), "layers/o_proj": linear(a + "o_proj.weight"),
        "layers/q_bias": Source(a + "q_proj.bias"), "layers/k_bias": Source(a + "k_proj.bias"),
        "layers/v_bias": Source(a + "v_proj.bias"), "layers/o_bias": Source(a + "o_proj.bias"),
        "layers/q_norm": Source(a + "q_norm.weight"), "layers/k_norm": Source(a + "k_norm.weight"),
        "layers/mlp_norm": Source("layers.{i}.post_attention_layernorm.weight"),
        "layers/gate_proj": linear(m + "gate_proj.weight"), "layers/up_proj": linear(m + "up_proj.weight"),
        "layers/down_proj": linear(m + "down_proj.weight"),
        "layers/gate_bias": Source(m + "gate_proj.bias"), "layers/up_bias": Source(m + "up_proj.bias"),
        "layers/down_bias": Source(m + "down_proj.bias"),
        "final_norm": Source("norm.weight"),
        "lm_head": Source("lm_head.weight", "linear", base=False),
    }


FAMILIES = {model_type: Family(config, sources, architecture) for model_type, architecture in _ARCHITECTURES.items()}
