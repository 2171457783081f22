"""The run's model, for its tokenizer (token ids -> the strings a page shows) and its unembedding: --model, or
the checkpoint the run's run.json names, resolved as `harvest extract --model` resolves it. Without one that
loads, ids show as "<id N>" and the logit tables stay empty, each said once in a warning line."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from harvest.errors import UserError

log = logging.getLogger(__name__)


def checkpoint_of(model: str | None, run_model: dict[str, Any]) -> tuple[str | None, Path | None]:
    """(the model named, its checkpoint directory or None when it cannot be had here)."""
    from harvest.model.weights import resolve_checkpoint

    name = model or run_model.get("source")
    if not name:
        log.warning("features: the run's run.json names no model and no --model was given: token ids are shown "
                    "as <id N>, and no logits")
        return None, None
    try:
        return str(name), resolve_checkpoint(str(name))
    except UserError as e:
        log.warning("features: the model %s does not load here (%s): token ids are shown as <id N>, and no "
                    "logits; give --model", name, e)
        return str(name), None


class Vocab:
    """Token ids -> strings, each id decoded once."""

    def __init__(self, checkpoint: Path | None):
        self.tokenizer = None
        self._seen: dict[int, str] = {}
        if checkpoint is not None:
            from harvest.data.prompts import load_tokenizer

            try:
                self.tokenizer = load_tokenizer(checkpoint)
            except UserError as e:
                log.warning("features: %s: token ids are shown as <id N>", e)

    def __call__(self, ids) -> list[str]:
        out = []
        for i in (int(t) for t in ids):
            text = self._seen.get(i)
            if text is None:
                text = self._seen[i] = (f"<id {i}>" if self.tokenizer is None
                                        else self.tokenizer.decode([i], clean_up_tokenization_spaces=False))
            out.append(text)
        return out
