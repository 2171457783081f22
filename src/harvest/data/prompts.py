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
from harvest.data.arc import ArcOptions
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


def load_tokenizer(checkpoint, encode_only: bool = False) -> Any:
    """The checkpoint's own tokenizer (transformers, fast), chat template included. `encode_only`: all the caller
    does is `tokenizer(texts, add_special_tokens=...)`, which the tokenizer kept by an earlier job (or built and
    kept by a child process now) does without importing transformers here (harvest.data.tokenizer_cache)."""
    from pathlib import Path

    from harvest.data import tokenizer_cache

    path = Path(checkpoint)
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise UserError(f"--model {path}: no tokenizer files (tokenizer.json) in the checkpoint directory")
    if encode_only and (kept := tokenizer_cache.load(path) or tokenizer_cache.build_apart(path)) is not None:
        return kept
    return tokenizer_cache.build(path)


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
