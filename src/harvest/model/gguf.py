"""GGUF checkpoints (llama.cpp's single file: quantized weights, config, tokenizer) as HF checkpoint directories.

A `.gguf` given as --model (a path, a gs:// s3:// or http(s):// URL, or a directory holding exactly one) is
dequantized once, with the `gguf` package's own numpy dequantization, into `$HARVEST_CACHE/gguf/<sha256>/`:
config.json, model.safetensors (float32: a dequantized block is d*q+m, exact in float32 and not in bf16) and the
tokenizer files, chat template included, which transformers builds from the GGUF's metadata. Every command then
loads that directory as any other checkpoint. Tensor names and llama.cpp's q/k row permutation are mapped back
as transformers' own GGUF loader does (tests/model/test_gguf.py holds the two to the same tensors).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from harvest.errors import UserError
from harvest.runtime import cache

# GGUF general.architecture -> the HF model_type harvest has a forward for (llama.cpp files Mistral as llama).
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_URL = re.compile(r"^(gs|s3|https?)://", re.IGNORECASE)
# llama.cpp's tensor names -> HF's ({i} the layer).
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
log = logging.getLogger(__name__)


class GgufError(UserError):
    pass


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
    from safetensors.numpy import save_file

    tensors = hf_tensors(reader, config, source)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer(reader, out, source)


def hf_config(reader, source: str) -> dict[str, Any]:
    """The HF config.json (transformers-v4 dialect, as hub checkpoints carry) of a GGUF's metadata."""
    arch = _field(reader, "general.architecture")
    if arch not in MODEL_TYPES:
        raise GgufError(f"--model {source}: GGUF architecture {arch!r} has no forward in harvest "
                        f"(supported: {', '.join(MODEL_TYPES)})")
    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise GgufError(f"--model {source}: per-dimension rope frequencies (rope_freqs.weight, llama3 rope "
                        "scaling) are not read from GGUF yet; use the HF checkpoint")

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise GgufError(f"--model {source}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or heads)
    head_dim = _field(reader, f"{arch}.attention.key_length") or _field(reader, f"{arch}.rope.dimension_count")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    rope_scaling = None
    if scaling == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise GgufError(f"--model {source}: GGUF rope scaling {scaling!r} is not supported (none, linear)")
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": [_CLASSES[arch]],
        "model_type": MODEL_TYPES[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(head_dim or hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, f"{arch}.rope.freq_base") or 10000.0),  # llama.cpp's default
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "torch_dtype": "float32",
    }
    for key in ("bos_token_id", "eos_token_id"):
        value = _field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            config[key] = int(value)
    if arch == "qwen2":
        config["use_sliding_window"] = False
    return config


def hf_tensors(reader, config: dict[str, Any], source: str) -> dict[str, np.ndarray]:
    """Every tensor dequantized to float32 under its HF name, in HF's layout ([out, in])."""
    from gguf import dequantize

    tensors = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise GgufError(f"--model {source}: GGUF tensor {tensor.name!r} has no place in a "
                            f"{config['model_type']} model")
        weights = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        weights = weights.reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if config["model_type"] == "llama" and tensor.name.endswith((".attn_q.weight", ".attn_k.weight")):
            heads = config["num_attention_heads" if ".attn_q." in tensor.name else "num_key_value_heads"]
            weights = unpermute(weights, heads)
        tensors[name] = np.ascontiguousarray(weights)
    return tensors


def hf_name(name: str) -> str | None:
    if name in _GLOBAL:
        return _GLOBAL[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    return None


def unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order (each head's rotary halves interleaved) to HF's: rows [heads, 2, dim/2]
    were stored as [heads, dim/2, 2]."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


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
