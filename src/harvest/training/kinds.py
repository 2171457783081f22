"""The one table from a kind of training run to its config and its trainer: what `harvest train`, `harvest sae
train`, `harvest status` and the fleet ask. The families sit above the runtime, so the table names them and
imports one only when asked."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from harvest.config import build, load_yaml


@dataclasses.dataclass(frozen=True)
class Kind:
    name: str  # run.json's kind
    trainer_name: str  # as the fleet's plan says it
    command: tuple[str, ...]  # the harvest command that trains it
    config_path: str  # "module:Class", imported when asked
    trainer_path: str
    default_mesh: str  # every device on one axis, "{}" the device count
    loss: str  # the metric a status shows as the loss
    unit: str  # what one step's batch counts

    def config(self) -> type:
        return _load(self.config_path)

    def trainer(self) -> type:
        return _load(self.trainer_path)


KINDS = {k.name: k for k in (
    Kind("train", "decoder", ("train",), "harvest.decoder.config:TrainConfig", "harvest.decoder.trainer:DecoderTrainer",
         "fsdp={}", "loss", "rows"),
    Kind("trm", "trm", ("train",), "harvest.trm.config:TrmTrainConfig", "harvest.trm.trainer:TrmTrainer", "data={}",
         "loss", "examples"),
    Kind("sae", "sae", ("sae", "train"), "harvest.sae.config:SaeConfig", "harvest.sae.trainer:SaeTrainer", "data={}",
         "fvu", "tokens"),
)}
BY_TRAINER = {k.trainer_name: k for k in KINDS.values()}


def _load(path: str) -> Any:
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def trm_presets() -> tuple[str, ...]:
    """The TRM presets' names (`--model trm-sudoku-mlp` trains a TRM)."""
    return tuple(_load("harvest.trm.hparams:PRESETS"))


def train_kind(model: Any) -> Kind:
    """The kind `harvest train` trains for its --model: a TRM's mapping or preset, else a decoder."""
    return KINDS["trm" if _trm_model(model) is not None else "train"]


def _trm_model(model: Any) -> dict | None:
    return _load("harvest.trm.config:trm_model")(model)


def train_config(yaml_path: str | None, flags: dict[str, Any]) -> Any:
    """`harvest train`'s config from YAML and flags: a TRM's when the model is one, else a decoder's."""
    trm = _trm_model(flags["model"] if flags.get("model") is not None else load_yaml(yaml_path).get("model"))
    if trm is not None:
        return _load("harvest.trm.config:build_trm")(yaml_path, flags, trm)
    return build(KINDS["train"].config(), yaml_path, flags)


def trainer_for(cfg: Any) -> Any:
    """The trainer of cfg's kind, on cfg."""
    return next(k for k in KINDS.values() if type(cfg) is k.config()).trainer()(cfg)
