"""llama.cpp's GGUF architectures, one table each (FAMILIES): how a file's metadata becomes the HF config
transformers builds for it (a GGUF key, a constant, or a function of the metadata where HF's value is derived, as
transformers' and llama.cpp's loaders derive it), its tensor names HF's, and how llama.cpp changed the values on
the way in (model.gguf undoes them). Adding an architecture is a table here."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from harvest.errors import UserError


class GgufError(UserError):
    pass


class Meta:
    """A GGUF's metadata (keys under its architecture's prefix) and tensor names, read by the config tables."""

    def __init__(self, reader, source: str):
        self.reader, self.source = reader, source
        self.arch = field(reader, "general.architecture")
        self.tensors = {t.name for t in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        value = field(self.reader, f"{self.arch}.{key}")
        return default if value is None else value

    def need(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GgufError(f"--model {self.source}: GGUF metadata lacks {self.arch}.{key}")
        return value


Value = Callable[[Meta], Any]


def _need(key: str, kind: type = int) -> Value:
    return lambda m: kind(m.need(key))


def _opt(key: str, default: Any, kind: type = float) -> Value:
    return lambda m: None if m.get(key, default) is None else kind(m.get(key, default))


def _vocab(m: Meta) -> int:
    return int(m.get("vocab_size") or len(m.reader.fields["tokenizer.ggml.tokens"].data))


def _kv_heads(m: Meta) -> int:
    return int(m.get("attention.head_count_kv") or m.need("attention.head_count"))


def _per_head(m: Meta) -> int:
    return int(m.need("embedding_length")) // int(m.need("attention.head_count"))


def _head_dim(m: Meta) -> int:
    return int(m.get("attention.key_length") or _per_head(m))


def _llama_head_dim(m: Meta) -> int:  # transformers maps llama's rope.dimension_count to head_dim
    return int(m.get("attention.key_length") or m.get("rope.dimension_count") or _per_head(m))


def _tied(m: Meta) -> bool:  # llama.cpp writes output.weight only when it is not the embedding
    return "output.weight" not in m.tensors


def _rope_scaling(m: Meta) -> dict | None:
    """HF's rope_scaling of llama.cpp's rope.scaling.* keys (yarn: OLMo 3, long-context Qwen)."""
    scaling = m.get("rope.scaling.type")
    if scaling in (None, "none"):
        return None
    if scaling not in _ROPE_SCALING:
        raise GgufError(f"--model {m.source}: GGUF rope scaling {scaling!r} is not supported "
                        f"(none, {', '.join(_ROPE_SCALING)})")
    found = {hf: kind(m.get(key)) for hf, (key, kind) in _ROPE_SCALING[scaling].items() if m.get(key) is not None}
    return {"rope_type": scaling, "factor": float(m.need("rope.scaling.factor")), **found}


# Per rope scaling type: HF's key -> (llama.cpp's key, type); absent keys take HF's defaults.
_ROPE_SCALING = {
    "linear": {},
    "yarn": {"original_max_position_embeddings": ("rope.scaling.original_context_length", int),
             "attention_factor": ("rope.scaling.attn_factor", float),
             "beta_fast": ("rope.scaling.yarn_beta_fast", float), "beta_slow": ("rope.scaling.yarn_beta_slow", float)},
}


def _layer_types(pattern: Callable[[Meta, int], bool]) -> Value:
    """HF's layer_types: per layer, sliding where `pattern(meta, layer)` (and the file has a window at all)."""
    def types(m: Meta) -> list[str]:
        window = m.get("attention.sliding_window")
        return ["sliding_attention" if window and pattern(m, i) else "full_attention"
                for i in range(int(m.need("block_count")))]
    return types


def _query_scale(layers_27b: int) -> Value:
    """Gemma 2/3's query_pre_attn_scalar, which no GGUF key holds: llama.cpp scales queries by head_dim, but by
    hidden/heads in the 27B (known by its layer count), as HF's 27B configs say (144, 168)."""
    return lambda m: _per_head(m) if int(m.need("block_count")) == layers_27b else _head_dim(m)


@dataclasses.dataclass(frozen=True)
class Family:
    """How one GGUF architecture maps back to a HF checkpoint."""

    config: dict[str, Any]  # HF config key -> a constant, or a function of the Meta
    names: dict[str, str]  # llama.cpp tensor name (no .weight/.bias) -> HF's, {i} the layer
    norm_offset: float = 0.0  # llama.cpp stores every *norm.weight as w + offset (Gemma's (1 + w) norms)
    unpermute_qk: bool = False  # attn_q/attn_k rows in llama.cpp's rotary order (llama)
    transposed: tuple[str, ...] = ()  # stored [out, in] where HF keeps [in, out] (GPT-2's Conv1D)
    regroup_qkv: bool = False  # attn_qkv rows stored [all q, all k, all v]; HF interleaves per head (GPT-NeoX)


# The per-architecture tables. Config values are what transformers builds for the file (its GGUF_CONFIG_MAPPING,
# then its config class's derivations: layer_types, the Gemma constants), in the keys hub checkpoints carry.
_HIDDEN = {"hidden_size": _need("embedding_length"), "intermediate_size": _need("feed_forward_length"),
           "num_hidden_layers": _need("block_count"), "num_attention_heads": _need("attention.head_count"),
           "num_key_value_heads": _kv_heads, "max_position_embeddings": _need("context_length")}
_RMS = {**_HIDDEN, "head_dim": _head_dim, "rms_norm_eps": _need("attention.layer_norm_rms_epsilon", float),
        "rope_theta": _opt("rope.freq_base", 10000.0), "rope_scaling": _rope_scaling}  # 10000: llama.cpp's default
_LLAMA_NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "model.layers.{i}.input_layernorm", "ffn_norm": "model.layers.{i}.post_attention_layernorm",
    "attn_q": "model.layers.{i}.self_attn.q_proj", "attn_k": "model.layers.{i}.self_attn.k_proj",
    "attn_v": "model.layers.{i}.self_attn.v_proj", "attn_output": "model.layers.{i}.self_attn.o_proj",
    "attn_q_norm": "model.layers.{i}.self_attn.q_norm", "attn_k_norm": "model.layers.{i}.self_attn.k_norm",
    "ffn_gate": "model.layers.{i}.mlp.gate_proj", "ffn_up": "model.layers.{i}.mlp.up_proj",
    "ffn_down": "model.layers.{i}.mlp.down_proj",
}
_SANDWICH_NAMES = {**_LLAMA_NAMES, "ffn_norm": "model.layers.{i}.pre_feedforward_layernorm",
                   "post_attention_norm": "model.layers.{i}.post_attention_layernorm",
                   "post_ffw_norm": "model.layers.{i}.post_feedforward_layernorm"}
_POST_NAMES = {k: v for k, v in _SANDWICH_NAMES.items() if k not in ("attn_norm", "ffn_norm")}  # OLMo 2


def _llama_like(hf_class: str, model_type: str, **more: Any) -> Family:
    return Family(config={"architectures": [hf_class], "model_type": model_type, **_RMS, "head_dim": _llama_head_dim,
                          "hidden_act": "silu", "attention_bias": lambda m: "blk.0.attn_q.bias" in m.tensors, **more},
                  names=_LLAMA_NAMES, unpermute_qk=model_type == "llama")


FAMILIES: dict[str, Family] = {
    "llama": _llama_like("LlamaForCausalLM", "llama"),  # llama.cpp files Mistral as llama
    "qwen2": _llama_like("Qwen2ForCausalLM", "qwen2", use_sliding_window=False),
    "qwen3": _llama_like("Qwen3ForCausalLM", "qwen3"),
    "gemma": Family(
        config={"architectures": ["GemmaForCausalLM"], "model_type": "gemma", **_RMS,
                "hidden_act": "gelu_pytorch_tanh", "attention_bias": False},
        names=_LLAMA_NAMES, norm_offset=1.0),
    "gemma2": Family(
        config={"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **_RMS,
                "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                "query_pre_attn_scalar": _query_scale(46),
                "sliding_window": _opt("attention.sliding_window", None, int),
                "layer_types": _layer_types(lambda m, i: i % 2 == 0),  # llama.cpp's and HF's pattern of 2
                "attn_logit_softcapping": _opt("attn_logit_softcapping", 50.0),  # llama.cpp's defaults, HF's too
                "final_logit_softcapping": _opt("final_logit_softcapping", 30.0)},
        names=_SANDWICH_NAMES, norm_offset=1.0),
    "gemma3": Family(
        config={"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **_RMS,
                "hidden_activation": "gelu_pytorch_tanh", "attention_bias": False,
                "query_pre_attn_scalar": _query_scale(62),
                "rope_theta": _opt("rope.freq_base", 1000000.0), "rope_local_base_freq": 10000.0,  # llama.cpp's
                "sliding_window": _opt("attention.sliding_window", None, int),
                "layer_types": _layer_types(lambda m, i: (i + 1) % 6 != 0),  # llama.cpp's and HF's pattern of 6
                "attn_logit_softcapping": None, "final_logit_softcapping": _opt("final_logit_softcapping", None),
                "use_bidirectional_attention": False},
        names=_SANDWICH_NAMES, norm_offset=1.0),
    "olmo2": Family(
        config={"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", **_RMS, "hidden_act": "silu",
                "attention_bias": False},
        names=_POST_NAMES),
    "olmo3": Family(  # llama.cpp files OLMo 3 as olmo2 with a window: _VARIANTS
        config={"architectures": ["Olmo3ForCausalLM"], "model_type": "olmo3", **_RMS, "hidden_act": "silu",
                "attention_bias": False, "sliding_window": _need("attention.sliding_window"),
                "layer_types": _layer_types(lambda m, i: bool(m.need("attention.sliding_window_pattern")[i]))},
        names=_POST_NAMES),
    "gpt2": Family(
        config={"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": _need("embedding_length"),
                "n_layer": _need("block_count"), "n_head": _need("attention.head_count"),
                "n_inner": _need("feed_forward_length"), "n_ctx": _need("context_length"),
                "n_positions": _need("context_length"),  # llama.cpp's position table has context_length rows
                "layer_norm_epsilon": _need("attention.layer_norm_epsilon", float), "activation_function": "gelu_new"},
        names={"token_embd": "transformer.wte", "position_embd": "transformer.wpe", "output_norm": "transformer.ln_f",
               "output": "lm_head", "attn_norm": "transformer.h.{i}.ln_1", "attn_qkv": "transformer.h.{i}.attn.c_attn",
               "attn_output": "transformer.h.{i}.attn.c_proj", "ffn_norm": "transformer.h.{i}.ln_2",
               "ffn_up": "transformer.h.{i}.mlp.c_fc", "ffn_down": "transformer.h.{i}.mlp.c_proj"},
        transposed=("attn_qkv", "attn_output", "ffn_up", "ffn_down")),
    "gptneox": Family(
        config={"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", **_HIDDEN,
                "layer_norm_eps": _need("attention.layer_norm_epsilon", float), "hidden_act": "gelu",
                "rotary_pct": lambda m: int(m.need("rope.dimension_count")) / _per_head(m),
                "rotary_emb_base": _opt("rope.freq_base", 10000.0),
                "use_parallel_residual": _opt("use_parallel_residual", True, bool), "attention_bias": True},
        names={"token_embd": "gpt_neox.embed_in", "output_norm": "gpt_neox.final_layer_norm", "output": "embed_out",
               "attn_norm": "gpt_neox.layers.{i}.input_layernorm",
               "attn_qkv": "gpt_neox.layers.{i}.attention.query_key_value",
               "attn_output": "gpt_neox.layers.{i}.attention.dense",
               "ffn_norm": "gpt_neox.layers.{i}.post_attention_layernorm",
               "ffn_up": "gpt_neox.layers.{i}.mlp.dense_h_to_4h", "ffn_down": "gpt_neox.layers.{i}.mlp.dense_4h_to_h"},
        regroup_qkv=True),
}
# Architectures llama.cpp writes under another's name, told apart by a key: (GGUF key, our table).
_VARIANTS = {"olmo2": ("attention.sliding_window", "olmo3")}
# Every family's: the vocabulary (the embedding's rows: llama.cpp pads the token list to it), tied embeddings.
COMMON = {"vocab_size": _vocab, "tie_word_embeddings": _tied, "torch_dtype": "float32"}
SUPPORTED = tuple(arch for arch in FAMILIES if arch not in {v for _, v in _VARIANTS.values()})


def table_of(meta: Meta) -> Family:
    """The table of a GGUF's architecture; refused in one line naming the supported ones."""
    if meta.arch not in SUPPORTED:
        raise GgufError(f"--model {meta.source}: GGUF architecture {meta.arch!r} has no forward in harvest "
                        f"(supported: {', '.join(SUPPORTED)})")
    key, variant = _VARIANTS.get(meta.arch, (None, None))
    return FAMILIES[variant if key is not None and meta.get(key) is not None else meta.arch]


def field(reader, key: str) -> Any:
    """A GGUF metadata value (None where the file has no such key)."""
    found = reader.fields.get(key)
    return None if found is None else found.contents()
