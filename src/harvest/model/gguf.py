"""GGUF checkpoints (llama.cpp's single file: quantized weights, config, tokenizer) as HF checkpoint directories.

A `.gguf` given as --model (a path, a gs:// s3:// or http(s):// URL, or a directory holding exactly one) is
dequantized once, with the `gguf` package's own numpy dequantization, into `$HARVEST_CACHE/gguf/<sha256>/`:
config.json, model.safetensors (float32: a dequantized block is d*q+m, exact in float32 and not in bf16) and the
tokenizer files, chat template included, which transformers builds from the GGUF's metadata. Every command then
loads that directory as any other checkpoint.

One table per GGUF architecture (FAMILIES) says how llama.cpp's file maps back to HF's: tensor names, the config
keys (a GGUF key, a constant, or a function of the metadata where HF's value is derived, as transformers' and
llama.cpp's loaders derive it), and how llama.cpp changed the values on the way in, undone as transformers' own
GGUF loader undoes them: the q/k row permutation (llama only), Gemma's norms stored as w + 1, GPT-2's Conv1D
weights stored transposed, GPT-NeoX's per-head q/k/v rows regrouped as all q, all k, all v.
tests/model/test_gguf.py holds the result to transformers' loader (real SmolLM2 and Gemma 3 files, synthetic
files of the other families) and to the HF checkpoints the synthetic files were written from.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from harvest.errors import UserError
from harvest.runtime import cache

_URL = re.compile(r"^(gs|s3|https?)://", re.IGNORECASE)
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)\.(weight|bias)")
log = logging.getLogger(__name__)


class GgufError(UserError):
    pass


class Meta:
    """A GGUF's metadata (keys under its architecture's prefix) and tensor names, read by the config tables."""

    def __init__(self, reader, source: str):
        self.reader, self.source = reader, source
        self.arch = _field(reader, "general.architecture")
        self.tensors = {t.name for t in reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        value = _field(self.reader, f"{self.arch}.{key}")
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
_COMMON = {"vocab_size": _vocab, "tie_word_embeddings": _tied, "torch_dtype": "float32"}
SUPPORTED = tuple(arch for arch in FAMILIES if arch not in {v for _, v in _VARIANTS.values()})


def is_gguf(model: str) -> bool:
    return model.lower().endswith(".gguf")


def gguf_in(directory: Path) -> Path | None:
    """The one .gguf of a directory that is not itself a HF checkpoint (no config.json), else None."""
    if (directory / "config.json").exists():
        return None
    found = sorted(directory.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found[:4])
        raise GgufError(f"--model {directory}: holds {len(found)} .gguf files ({names}); name the one to use")
    return found[0] if found else None


def model_name(model: str) -> str:
    """The model as people name it: a hub id's last part, a checkpoint directory's name, or, for a directory this
    module converted (named by a digest), the GGUF file's name without .gguf (SmolLM2-135M-Instruct.Q4_1)."""
    base = model.rstrip("/").rsplit("/", 1)[-1]
    record = Path(model) / "gguf.json"
    if record.is_file():
        try:
            source = str(json.loads(record.read_text())["source"])
        except (ValueError, KeyError, TypeError):
            return base
        base = source.rstrip("/").rsplit("/", 1)[-1]
    return base[:-len(".gguf")] if base.endswith(".gguf") else base


def materialize(model: str) -> Path:
    """The HF checkpoint directory of the GGUF file or URL `model`, converted on first use."""
    local = _local_copy(model)
    digest = _sha256(str(local), *_stamp(local))
    out = cache.root() / "gguf" / digest
    if (out / "model.safetensors").exists():
        return out
    reader = _reader(local, model)
    config = hf_config(reader, model)  # refused before anything is written
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("%s: dequantizing into %s (once; later commands find it there)", model, out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{digest[:12]}-", dir=out.parent))
    try:
        convert(reader, config, tmp, source=model)
        (tmp / "gguf.json").write_text(json.dumps({"source": model, "sha256": digest}, indent=1) + "\n")
        try:
            tmp.rename(out)
        except OSError:  # another process converted it first: same bytes
            if not (out / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def convert(reader, config: dict[str, Any], out: Path, source: str) -> None:
    """Write config.json, model.safetensors (float32) and the tokenizer of a GGUF (its reader and hf_config)."""
    _save_safetensors(out / "model.safetensors", hf_tensors(reader, config, source))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer(reader, out, source)


def _save_safetensors(path: Path, tensors: list[tuple[str, tuple[int, ...], Callable[[], Iterator[np.ndarray]]]]
                      ) -> None:
    """A float32 safetensors file written piece by piece: safetensors' save_file holds every tensor and then the
    file's bytes (twice the float32 checkpoint in memory); this holds a few rows of one tensor."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, _ in tensors:
        size = 4 * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for name, shape, pieces in tensors:
            rows = 0
            for piece in pieces():
                assert piece.dtype == np.float32 and piece.shape[1:] == shape[1:], (name, piece.shape, shape)
                f.write(np.ascontiguousarray(piece).data)
                rows += piece.shape[0] if piece.ndim else 1
            assert rows == (shape[0] if shape else 1), (name, rows, shape)


def table_of(meta: Meta) -> Family:
    """The table of a GGUF's architecture; refused in one line naming the supported ones."""
    if meta.arch not in SUPPORTED:
        raise GgufError(f"--model {meta.source}: GGUF architecture {meta.arch!r} has no forward in harvest "
                        f"(supported: {', '.join(SUPPORTED)})")
    key, variant = _VARIANTS.get(meta.arch, (None, None))
    return FAMILIES[variant if key is not None and meta.get(key) is not None else meta.arch]


def hf_config(reader, source: str) -> dict[str, Any]:
    """The HF config.json (transformers-v4 dialect, as hub checkpoints carry) of a GGUF's metadata."""
    meta = Meta(reader, source)
    table = table_of(meta)
    if "rope_freqs.weight" in meta.tensors:
        raise GgufError(f"--model {source}: per-dimension rope frequencies (rope_freqs.weight, llama3 rope "
                        "scaling) are not read from GGUF yet; use the HF checkpoint")
    config = {key: value(meta) if callable(value) else value for key, value in {**table.config, **_COMMON}.items()}
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[key.replace("padding", "pad")] = int(value)
    return config


def hf_tensors(reader, config: dict[str, Any], source: str
               ) -> list[tuple[str, tuple[int, ...], Callable[[], Iterator[np.ndarray]]]]:
    """Every tensor's HF name, its shape in HF's layout ([out, in]; GPT-2's Conv1D [in, out]) and a function that
    dequantizes it to float32 in that layout, in pieces of whole rows. Names are all checked before anything is
    dequantized."""
    table = table_of(Meta(reader, source))
    tensors = []
    for tensor in reader.tensors:
        name, stem = hf_name(tensor.name, table)
        if name is None:
            raise GgufError(f"--model {source}: GGUF tensor {tensor.name!r} has no place in a "
                            f"{config['model_type']} model")
        shape = tuple(int(d) for d in reversed(tensor.shape))
        transpose = stem in table.transposed and name.endswith(".weight")
        tensors.append((name, shape[::-1] if transpose else shape,
                        functools.partial(_dequantize, tensor, shape, stem, table, config, transpose)))
    return tensors


_PIECE = 2**26  # bytes of float32 rows dequantized at a time where each row stands alone


def _dequantize(tensor, shape: tuple[int, ...], stem: str, table: Family, config: dict[str, Any],
                transpose: bool) -> Iterator[np.ndarray]:
    """One tensor as float32, llama.cpp's changes undone as transformers' GGUF loader undoes them: row by row
    (ggml blocks never span rows) where nothing reorders rows, else whole."""
    from gguf import dequantize

    heads = None
    if table.unpermute_qk and stem in ("attn_q", "attn_k") and tensor.name.endswith(".weight"):
        heads = config["num_attention_heads" if stem == "attn_q" else "num_key_value_heads"]
    regroup = table.regroup_qkv and stem == "attn_qkv"
    offset = table.norm_offset if tensor.name.endswith("norm.weight") else 0.0
    rows = shape[0] if len(shape) > 1 and not (heads or regroup or transpose) else None
    step = max(1, _PIECE // (4 * int(np.prod(shape[1:])))) if rows else None
    for start in range(0, rows or 1, step or 1):
        data = tensor.data[start:start + step] if rows else tensor.data
        weights = np.asarray(dequantize(data, tensor.tensor_type), dtype=np.float32)
        weights = weights.reshape(-1, *shape[1:]) if rows else weights.reshape(shape)
        if offset:
            weights = weights - np.float32(offset)
        if heads:
            weights = unpermute(weights, heads)
        if regroup:
            weights = regroup_qkv(weights, config["num_attention_heads"])
        yield weights.T if transpose else weights


def hf_name(name: str, table: Family) -> tuple[str | None, str]:
    """A llama.cpp tensor's HF name (None: not of this family) and its llama.cpp stem (attn_q, ...)."""
    m = _BLOCK.fullmatch(name)
    if m:
        layer, stem, suffix = m.groups()
    else:
        layer, (stem, _, suffix) = None, name.rpartition(".")
    hf = table.names.get(stem)
    if hf is None or ("{i}" in hf) != (layer is not None):
        return None, stem
    return f"{hf.format(i=layer)}.{suffix}", stem


def unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (each head's rotary halves interleaved) to HF's: rows [heads, 2, dim/2]
    were stored as [heads, dim/2, 2]."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def regroup_qkv(weights: np.ndarray, heads: int) -> np.ndarray:
    """GPT-NeoX's fused query_key_value rows (or bias) back to HF's per-head [q, k, v] from llama.cpp's [all q,
    all k, all v] (transformers' Bloom processor, the same undoing)."""
    dim = weights.shape[0] // 3 // heads
    return weights.reshape(3, heads, dim, *weights.shape[1:]).swapaxes(0, 1).reshape(weights.shape)


def _write_tokenizer(reader, out: Path, source: str) -> None:
    """The fast tokenizer (and chat template) the GGUF's metadata describes, built by transformers' own GGUF
    tokenizer builder (as AutoTokenizer(gguf_file=...) does, whose reader needs torch), saved as files."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (_SPECIAL_TOKENS, GGUF_TOKENIZER_MAPPING,
                                                                        convert_gguf_tokenizer)

    grouped = {group: {name: _field(reader, f"tokenizer.{key}") for key, name in renames.items()
                       if f"tokenizer.{key}" in reader.fields}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":  # as transformers: llama.cpp adds BOS unless told otherwise
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = _field(reader, f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    try:
        backend, extra = convert_gguf_tokenizer(_field(reader, "general.architecture"), tokenizer)
        built = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
    except Exception as e:  # transformers raises many kinds; all mean no usable tokenizer
        raise GgufError(f"--model {source}: cannot build its tokenizer ({type(e).__name__}: {e})") from None
    built.save_pretrained(str(out))


def _reader(path: Path, source: str):
    from gguf import GGUFReader

    try:
        return GGUFReader(str(path))
    except Exception as e:  # a truncated or foreign file: gguf raises ValueError, struct.error, ...
        raise GgufError(f"--model {source}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _local_copy(model: str) -> Path:
    """The GGUF as a local file: itself, or its download under $HARVEST_CACHE/gguf/downloads (kept)."""
    if not _URL.match(model):
        path = Path(model).expanduser()
        if not path.is_file():
            raise GgufError(f"--model {model}: no such file")
        return path
    name = re.sub(r"[^\w.-]", "_", model.rsplit("/", 1)[-1])
    path = cache.root() / "gguf" / "downloads" / hashlib.sha256(model.encode()).hexdigest()[:16] / name
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    log.info("%s: downloading to %s", model, path)
    tmp = path.with_name(f".{name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            _download(model, f)
        tmp.rename(path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _download(url: str, f) -> None:
    if url.lower().startswith(("gs://", "s3://")):
        from harvest.storage import Storage

        parent, name = url.rsplit("/", 1)
        with Storage(parent).open_binary(name) as src:
            shutil.copyfileobj(src, f, 2**22)
        return
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=60) as src:
            shutil.copyfileobj(src, f, 2**22)
    except OSError as e:
        raise GgufError(f"--model {url}: download failed ({e})") from None


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """The file's sha256, once per process for a file that has not changed (size and mtime)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(2**22):
            digest.update(block)
    return digest.hexdigest()
