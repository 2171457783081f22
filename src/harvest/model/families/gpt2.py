"""GPT-2: learned absolute positions, LayerNorm with bias before each sublayer, a plain gelu-tanh MLP, biases
everywhere, Conv1D weights ([in, out]) and one fused c_attn for q, k and v; the head is the tied embedding."""

from __future__ import annotations

from typing import Any

from harvest.model.config import Fields, ModelConfig
from harvest.model.families.base import Family, Source, through_transformers


def config(hf: dict[str, Any], src: str) -> ModelConfig:
    hf = through_transformers(hf, src, "gpt2")
    f = Fields(hf, src)
    hidden, heads, layers = f.need("n_embd"), f.need("n_head"), f.need("n_layer")
    if hidden % heads:
        raise f.error(f"n_embd {hidden} is not divisible by n_head {heads}")
    if hf.get("scale_attn_by_inverse_layer_idx"):
        raise f.error("scale_attn_by_inverse_layer_idx is not supported (GPT-2 and its ports leave it off)")
    head_dim = hidden // heads
    return ModelConfig(
        model_type="gpt2",
        vocab_size=f.need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=f.get("n_inner", 4 * hidden),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=head_dim,
        norm_eps=float(f.need("layer_norm_epsilon", (int, float))),
        rope=None,
        max_positions=f.need("n_positions"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        sliding_windows=(None,) * layers,
        norm="layer",
        gated_mlp=False,
        act=f.activation("activation_function"),
        attn_scale=None if hf.get("scale_attn_weights", True) else 1.0,
    )


def sources(cfg: ModelConfig) -> dict[str, Source]:
    a, m = "h.{i}.attn.", "h.{i}.mlp."
    fused = {f"layers/{x}_proj": Source(a + "c_attn.weight", "conv1d", (3, n, 0)) for n, x in enumerate("qkv")}
    fused.update({f"layers/{x}_bias": Source(a + "c_attn.bias", "vector", (3, n, 0)) for n, x in enumerate("qkv")})
    return {
        "embed": Source("wte.weight", "table"), "pos_embed": Source("wpe.weight", "table"),
        "layers/attn_norm": Source("h.{i}.ln_1.weight"), "layers/attn_norm_bias": Source("h.{i}.ln_1.bias"),
        **fused,
        "layers/o_proj": Source(a + "c_proj.weight", "conv1d"), "layers/o_bias": Source(a + "c_proj.bias"),
        "layers/mlp_norm": Source("h.{i}.ln_2.weight"), "layers/mlp_norm_bias": Source("h.{i}.ln_2.bias"),
        "layers/up_proj": Source(m + "c_fc.weight", "conv1d"), "layers/up_bias": Source(m + "c_fc.bias"),
        "layers/down_proj": Source(m + "c_proj.weight", "conv1d"), "layers/down_bias": Source(m + "c_proj.bias"),
        "final_norm": Source("ln_f.weight"), "final_norm_bias": Source("ln_f.bias"),
        "lm_head": Source("lm_head.weight", "linear", base=False),
    }


# The hub's gpt2 files name the base model's tensors bare and keep each layer's causal-mask buffers.
GPT2 = Family(config, sources, "GPT2LMHeadModel", prefixes=("transformer.", ""),
              ignored=r"(.*\.attn\.(bias|masked_bias))$")
