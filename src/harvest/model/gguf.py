"""GGUF checkpoints (llama.cpp's single file: quantized weights, config, tokenizer) as HF checkpoint directories.

A `.gguf` given as --model (a path, a gs:// s3:// or http(s):// URL, or a directory holding exactly one) is
dequantized once, with the `gguf` package's own numpy dequantization, into `$HARVEST_CACHE/gguf/<sha256>/`:
config.json, model.safetensors (float32: a dequantized block is d*q+m, exact in float32 and not in bf16) and the
tokenizer files, chat template included, which transformers builds from the GGUF's metadata. Every command then
loads that directory as any other checkpoint.

One table per GGUF architecture (model.gguf_tables) says how llama.cpp's file maps back to HF's: tensor names, the
config keys, and how llama.cpp changed the values on the way in, undone here as transformers' own GGUF loader
undoes them: the q/k row permutation (llama only), Gemma's norms stored as w + 1, GPT-2's Conv1D
weights stored transposed, GPT-NeoX's per-head q/k/v rows regrouped as all q, all k, all v.
tests/model/test_gguf.py holds the result to transformers' loader (real SmolLM2 and Gemma 3 files, synthetic
files of the other families) and to the HF checkpoints the synthetic files were written from.
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
from typing import Any, Callable, Iterator

import numpy as np

from harvest.model.gguf_tables import COMMON, Family, GgufError, Meta, field, table_of
from harvest.runtime import cache

_URL = re.compile(r"^(gs|s3|https?)://", re.IGNORECASE)
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)\.(weight|bias)")
log = logging.getLogger(__name__)


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


def hf_config(reader, source: str) -> dict[str, Any]:
    """The HF config.json (transformers-v4 dialect, as hub checkpoints carry) of a GGUF's metadata."""
    meta = Meta(reader, source)
    table = table_of(meta)
    if "rope_freqs.weight" in meta.tensors:
        raise GgufError(f"--model {source}: per-dimension rope frequencies (rope_freqs.weight, llama3 rope "
                        "scaling) are not read from GGUF yet; use the HF checkpoint")
    config = {key: value(meta) if callable(value) else value for key, value in {**table.config, **COMMON}.items()}
    for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
        value = field(reader, f"tokenizer.ggml.{key}")
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

    grouped = {group: {name: field(reader, f"tokenizer.{key}") for key, name in renames.items()
                       if f"tokenizer.{key}" in reader.fields}
               for group, renames in GGUF_TOKENIZER_MAPPING.items()}
    tokenizer, config = grouped["tokenizer"], grouped["tokenizer_config"]
    if tokenizer.get("tokenizer_type") == "llama":  # as transformers: llama.cpp adds BOS unless told otherwise
        config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = field(reader, f"tokenizer.ggml.{key}")
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    try:
        backend, extra = convert_gguf_tokenizer(field(reader, "general.architecture"), tokenizer)
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
