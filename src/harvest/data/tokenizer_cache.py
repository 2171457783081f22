"""A checkpoint's tokenizer as transformers builds it, kept for the next job that only encodes text.

transformers builds a checkpoint's tokenizer from its model type and files (for qwen2 a Qwen2Tokenizer with its
own normalizer and split, not tokenizer.json as it stands), and building it imports transformers (and torch,
where installed): ~2.5 s of CPU at every start. What a text or ARC job then calls, `tokenizer(texts, add_special_tokens=...)`, is for
transformers' TokenizersBackend classes its Rust backend's `encode_batch` (TokenizersBackend._encode_plus, no
truncation, no padding, `encode_special_tokens` set from `split_special_tokens`). So once built, that backend,
serialized by the tokenizers library itself, is kept under $HARVEST_CACHE/tokenizers, keyed by the checkpoint's
tokenizer files and the versions of transformers and tokenizers; a later job that only encodes loads it with
tokenizers alone. A class that encodes another way (its own batch path) is never kept (its record says so).

Where nothing is kept yet, a child process builds and keeps it (`python -m harvest.data.tokenizer_cache DIR`):
its seconds of imports hold the child's interpreter lock, not that of the job starting beside it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harvest.errors import UserError
from harvest.runtime import cache

# Every file AutoTokenizer may read from a checkpoint (config.json: the model type picks the class).
FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
         "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


@dataclasses.dataclass(frozen=True)
class KeptTokenizer:
    """The record under $HARVEST_CACHE/tokenizers/<key>.json."""

    built_by: str  # the transformers class that built the backend
    split_special_tokens: bool
    backend: str  # tokenizers.Tokenizer.to_str(); "" where the class encodes another way (never kept)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "KeptTokenizer":
        raw = json.loads(text)
        if not isinstance(raw, dict) or set(raw) != {f.name for f in dataclasses.fields(cls)}:
            raise ValueError("not a kept tokenizer")
        if not (isinstance(raw["built_by"], str) and isinstance(raw["split_special_tokens"], bool)
                and isinstance(raw["backend"], str)):
            raise ValueError("not a kept tokenizer")
        return cls(**raw)


class BackendEncoder:
    """`tokenizer(texts, add_special_tokens=...)["input_ids"]` as the kept backend encodes them."""

    def __init__(self, kept: KeptTokenizer):
        import tokenizers

        self.built_by = kept.built_by
        self.backend = tokenizers.Tokenizer.from_str(kept.backend)
        self.backend.encode_special_tokens = kept.split_special_tokens

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        return {"input_ids": [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]}


def _key(checkpoint: Path) -> str | None:
    """The checkpoint's tokenizer files and the libraries that build and run them; None where a version is
    unknown."""
    digest = hashlib.sha256()
    try:
        for package in ("transformers", "tokenizers"):
            digest.update(f"{package} {importlib.metadata.version(package)}\n".encode())
    except importlib.metadata.PackageNotFoundError:
        return None
    for name in FILES:
        path = checkpoint / name
        if path.is_file():
            digest.update(f"{name} {path.stat().st_size}\n".encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _path(key: str) -> Path:
    return cache.root() / "tokenizers" / f"{key}.json"


def load(checkpoint: Path) -> BackendEncoder | None:
    """The kept encoder of this checkpoint's tokenizer, or None (not kept, or unreadable: built afresh)."""
    key = _key(checkpoint)
    if key is None:
        return None
    try:
        kept = KeptTokenizer.from_json(_path(key).read_text(encoding="utf-8"))
        return BackendEncoder(kept) if kept.backend else None
    except Exception:  # missing, partial or foreign (tokenizers raises its own kind): transformers builds it again
        return None


def build_apart(checkpoint: Path) -> BackendEncoder | None:
    """Build and keep the tokenizer in a child process, then load what it kept; None where nothing could be kept
    (a class that encodes another way, a tokenizer that does not load, a cache that cannot be written): the
    caller then builds it itself, and says what is wrong. Asked once per tokenizer: a record, kept or not, stands."""
    key = _key(checkpoint)
    if key is None or _path(key).exists():
        return load(checkpoint)
    try:  # a child whose record could not be kept would only add its seconds to the caller's own build
        _path(key).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(_path(key).parent, os.W_OK):
        return None
    try:
        subprocess.run([sys.executable, "-m", __name__, str(checkpoint)], stdin=subprocess.DEVNULL,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return load(checkpoint)


def keep(checkpoint: Path, tokenizer: Any) -> None:
    """Keep what `tokenizer` (as transformers built it) encodes with, where its class encodes through the backend
    alone; best effort: a cache that cannot be written costs the next job its ~2 s, nothing else."""
    from transformers import TokenizersBackend

    key = _key(checkpoint)
    if key is None or _path(key).exists():
        return
    cls = type(tokenizer)
    if not isinstance(tokenizer, TokenizersBackend) or any(
            getattr(cls, name) is not getattr(TokenizersBackend, name) for name in ("__call__", "_encode_plus")):
        kept = KeptTokenizer(cls.__name__, False, "")
    else:
        backend = tokenizer.backend_tokenizer
        backend.no_truncation()  # as _encode_plus sets it for a call without truncation or padding
        backend.no_padding()
        kept = KeptTokenizer(cls.__name__, bool(tokenizer.split_special_tokens), backend.to_str())
    path = _path(key)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False, encoding="utf-8") as f:
            temp = Path(f.name)
            f.write(kept.to_json())
        temp.replace(path)  # whole or not at all, for a job reading it meanwhile
    except OSError:
        if "temp" in locals():
            temp.unlink(missing_ok=True)


def build(checkpoint: Path) -> Any:
    """The checkpoint's tokenizer as transformers builds it (fast, chat template included), kept for the next job."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # "PyTorch was not found" is no news to harvest
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    except Exception as e:  # transformers raises many kinds; all mean an unusable tokenizer
        raise UserError(f"--model {checkpoint}: cannot load its tokenizer ({type(e).__name__}: {e})") from None
    tokenizer.model_max_length = 2**62  # lengths are --max-seq-len's business, not a warning's
    keep(checkpoint, tokenizer)
    return tokenizer


if __name__ == "__main__":  # build_apart's child: transformers builds the tokenizer, build keeps it
    # Without torch: building a tokenizer never needs it, and transformers would import it (~1 s of CPU) only
    # because it is installed. A None entry makes `import torch` fail and transformers find no torch.
    sys.modules["torch"] = None  # type: ignore[assignment]
    build(Path(sys.argv[1]))
