"""What a family is: how its config.json becomes a ModelConfig and where its weights live in a checkpoint."""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any, Callable

from harvest.model.config import ModelConfig, ModelConfigError


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one of our tensors comes from: its HF name ({i} the layer), how HF lays it out (linear: [out, in];
    conv1d: GPT-2's [in, out]; vector or table: as ours) and, for a fused tensor, which part of it is ours:
    `fuse` (parts, index, heads): the output dim holds `parts` blocks one after the other (heads 0: GPT-2's
    c_attn) or, per head, `parts` pieces of one head each (heads H: GPT-NeoX's query_key_value)."""

    name: str
    layout: str = "vector"
    fuse: tuple[int, int, int] | None = None
    base: bool = True  # a tensor of the base model, under its prefix (model., transformer., ...); False: the head's


@dataclasses.dataclass(frozen=True)
class Family:
    """A decoder family: its config parser, the HF source of each of our tensors, its HF class, where its base
    model sits in a checkpoint (the first prefix under which the embedding is found) and the tensors a
    checkpoint may hold that we do not read (buffers, another modality's tower)."""

    config: Callable[[dict[str, Any], str], ModelConfig]
    sources: Callable[[ModelConfig], dict[str, Source]]
    architecture: str
    prefixes: tuple[str, ...] = ("model.", "")
    ignored: str = r".*rotary_emb\.inv_freq$"


def linear(name: str, fuse: tuple[int, int, int] | None = None) -> Source:
    return Source(name, "linear", fuse)


def through_transformers(hf: dict[str, Any], src: str, model_type: str) -> dict[str, Any]:
    """The config as transformers itself reads it (its class's defaults for the keys a checkpoint leaves out,
    its conversions of older keys), in the v5 dialect `save_pretrained` writes: a key a hub checkpoint omits
    means to harvest what it means to transformers, which is what the checkpoint was made to run under."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    import transformers

    given = {k: v for k, v in hf.items() if k not in ("model_type", "transformers_version", "architectures")}
    try:
        with warnings.catch_warnings():  # its deprecation notices on older keys are for its own users
            warnings.simplefilter("ignore")
            return transformers.AutoConfig.for_model(model_type, **given).to_dict()
    except Exception as e:  # transformers' validation raises several kinds; all mean a config it refuses
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelConfigError(f"{src}: not a valid {model_type} config to transformers ({message})") from None
