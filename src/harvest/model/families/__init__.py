"""The decoder families harvest runs, by HF model_type. A family is its own module (config parsing, weight
names; its block's differences are switches of ModelConfig) and one line here."""

from __future__ import annotations

from typing import Any

from harvest.model.config import ModelConfigError
from harvest.model.families import gemma, gpt2, gpt_neox, llama, olmo
from harvest.model.families.base import Family, Source

FAMILIES: dict[str, Family] = {
    **llama.FAMILIES,  # qwen2, llama, mistral, qwen3
    "gemma": gemma.GEMMA,
    "gemma2": gemma.GEMMA2,
    "gemma3_text": gemma.GEMMA3_TEXT,
    "gemma3": gemma.GEMMA3,
    "gpt2": gpt2.GPT2,
    "gpt_neox": gpt_neox.GPT_NEOX,
    "olmo2": olmo.OLMO2,
    "olmo3": olmo.OLMO3,
}
SUPPORTED = tuple(FAMILIES)

__all__ = ["FAMILIES", "SUPPORTED", "Family", "Source", "family", "family_of"]


def family(model_type: str) -> Family:
    return FAMILIES[model_type]


def family_of(hf: dict[str, Any], src: str) -> Family:
    """The family a config.json names, or one line naming those harvest has."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ModelConfigError(f"{src}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED)})")
    return FAMILIES[model_type]
