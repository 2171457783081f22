"""GPT-NeoX (Pythia): attention and MLP side by side on the same input (use_parallel_residual), LayerNorm with
bias, rotary on the first part of each head (partial_rotary_factor), a plain gelu MLP, one fused
query_key_value laid out per head ([heads, q k v, head_dim]), an untied head (embed_out)."""

from __future__ import annotations

from typing import Any

from harvest.model.config import Fields, ModelConfig
from harvest.model.families.base import Family, Source, linear, through_transformers


def config(hf: dict[str, Any], src: str) -> ModelConfig:
    hf = through_transformers(hf, src, "gpt_neox")
    f = Fields(hf, src)
    sizes = f.sizes()  # GPT-NeoX has no kv heads of its own: num_kv_heads = num_heads
    head_dim, layers = sizes["head_dim"], sizes["num_layers"]
    rotary = int(head_dim * f.partial_rotary())
    if rotary % 2 or not rotary:
        raise f.error(f"partial_rotary_factor gives {rotary} rotary dims of {head_dim}; they must be even and > 0")
    bias = bool(hf.get("attention_bias", True))
    return ModelConfig(
        model_type="gpt_neox",
        **sizes,
        norm_eps=float(f.need("layer_norm_eps", (int, float))),
        rope=f.rope(head_dim),
        rotary_dim=rotary,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=True,
        sliding_windows=(None,) * layers,
        norm="layer",
        block="parallel" if hf.get("use_parallel_residual", True) else "pre",
        gated_mlp=False,
        act=f.activation("hidden_act"),
    )


def sources(cfg: ModelConfig) -> dict[str, Source]:
    a, m, heads = "layers.{i}.attention.", "layers.{i}.mlp.", cfg.num_heads
    fused = {f"layers/{x}_proj": linear(a + "query_key_value.weight", (3, n, heads)) for n, x in enumerate("qkv")}
    fused.update({f"layers/{x}_bias": Source(a + "query_key_value.bias", "vector", (3, n, heads))
                  for n, x in enumerate("qkv")})
    return {
        "embed": Source("embed_in.weight", "table"),
        "layers/attn_norm": Source("layers.{i}.input_layernorm.weight"),
        "layers/attn_norm_bias": Source("layers.{i}.input_layernorm.bias"),
        **fused,
        "layers/o_proj": linear(a + "dense.weight"), "layers/o_bias": Source(a + "dense.bias"),
        "layers/mlp_norm": Source("layers.{i}.post_attention_layernorm.weight"),
        "layers/mlp_norm_bias": Source("layers.{i}.post_attention_layernorm.bias"),
        "layers/up_proj": linear(m + "dense_h_to_4h.weight"), "layers/up_bias": Source(m + "dense_h_to_4h.bias"),
        "layers/down_proj": linear(m + "dense_4h_to_h.weight"), "layers/down_bias": Source(m + "dense_4h_to_h.bias"),
        "final_norm": Source("final_layer_norm.weight"), "final_norm_bias": Source("final_layer_norm.bias"),
        "lm_head": Source("embed_out.weight", "linear", base=False),
    }


# Pythia's files keep each layer's causal-mask buffers and rotary frequencies.
GPT_NEOX = Family(config, sources, "GPTNeoXForCausalLM", prefixes=("gpt_neox.", ""),
                  ignored=r".*attention\.(bias|masked_bias|rotary_emb\.inv_freq)$")
