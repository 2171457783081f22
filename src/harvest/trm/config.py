"""TrmTrainConfig: the settings of `harvest train` when its model is a TRM, on top of the runtime's: `model:
{type: trm, preset: NAME, ...}` (YAML, or --model as a JSON object, or --model NAME for a preset as it is). The
TRM's own settings are the fields of hparams.TrmConfig and TrmOptim, described there once; the model mapping
overrides any of them. A decoder-only setting given with a TRM is refused, not ignored."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from harvest import config as C
from harvest.config import ConfigError, check_settings, setting
from harvest.training.config import RuntimeConfig, like
from harvest.trm.hparams import PRESETS, Preset, TrmConfig, TrmOptim

DATASET_FIELDS = ("vocab_size", "seq_len", "num_puzzle_identifiers", "ignore_label_id")  # for_dataset fills them
MODEL_KEYS = {f.name: f for f in dataclasses.fields(TrmConfig) if f.name not in DATASET_FIELDS}
OPTIM_KEYS = {f.name: f for f in dataclasses.fields(TrmOptim) if f.name != "batch_size"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrmTrainConfig(RuntimeConfig):
    model: dict = setting("the TRM: {type: trm, preset: " + " | ".join(PRESETS) + ", and any TrmConfig or TrmOptim "
                          "field (H_cycles, hidden, lr, ema_rate, ...) as an override}")
    data: str = setting("a puzzle dataset made by `harvest puzzles build`: a local directory, gs:// or s3://")
    batch_size: int = setting("global examples per step (the reference: 768)", 768, minimum=1)
    steps: int | None = setting("train until this many steps (default: the preset's epochs over the dataset, as the "
                                "reference counts them)", None, minimum=0)
    mesh: str | None = like(RuntimeConfig, "mesh", help="data=..,fsdp=.. : the batch and the carry split over data x "
                                                         "fsdp, the TRM replicated (default: every device on data)")
    seed: int = setting("seed of the init, the halting exploration and the batches' order", 0, minimum=0)

    def preset(self) -> Preset | None:
        name = self.model.get("preset")
        if name is None:
            return None
        if name not in PRESETS:
            raise ConfigError(f"model: unknown TRM preset {name!r}; choose one of {', '.join(PRESETS)}")
        return PRESETS[name]

    def resolve(self, info: Any = None) -> tuple[TrmConfig, TrmOptim]:
        """(model, optimizer): the preset's (or the defaults), the mapping's overrides applied, the model
        sized for the dataset `info` when given."""
        chosen = self.preset()
        model, optim = (chosen.model, chosen.optim) if chosen else (TrmConfig(), TrmOptim())
        overrides = {k: C.coerce(k, v, str((MODEL_KEYS | OPTIM_KEYS)[k].type), None)
                     for k, v in self.model.items() if k not in ("type", "preset")}
        model = dataclasses.replace(model, **{k: v for k, v in overrides.items() if k in MODEL_KEYS})
        optim = dataclasses.replace(optim, batch_size=self.batch_size,
                                    **{k: v for k, v in overrides.items() if k in OPTIM_KEYS}).validate()
        if info is None:  # checked as far as it can be without the dataset
            dataclasses.replace(model, vocab_size=1, seq_len=1).validate()
            return model, optim
        return model.for_dataset(info), optim

    def validate(self) -> TrmTrainConfig:
        check_settings(self)
        if self.model.get("type") != "trm":
            raise ConfigError(f"model: a mapping is a TRM and needs type: trm (got type {self.model.get('type')!r})")
        unknown = sorted(set(self.model) - {"type", "preset"} - set(MODEL_KEYS) - set(OPTIM_KEYS))
        if unknown:
            raise ConfigError(f"model: unknown TRM settings {', '.join(unknown)} (a TrmConfig or TrmOptim field; "
                              f"the dataset gives {', '.join(DATASET_FIELDS)}, --batch-size the batch)")
        self.resolve()
        return self


def trm_model(value: Any) -> dict | None:
    """The TRM mapping `model` names (a mapping, a JSON object, or a preset's name); None for a decoder."""
    if isinstance(value, str) and value.lstrip().startswith("{"):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ConfigError(f"--model: not a JSON object ({e})") from None
    if isinstance(value, str) and value in PRESETS:
        return {"type": "trm", "preset": value}
    if isinstance(value, dict):
        return value
    return None


def build_trm(yaml_path: str | None, flags: dict[str, Any], model: dict) -> TrmTrainConfig:
    """The TRM run's config from YAML and flags (flags win); a decoder-only flag given is refused."""
    fields = {f.name for f in dataclasses.fields(TrmTrainConfig)}
    foreign = sorted(k for k, v in flags.items() if v is not None and k not in fields)
    if foreign:
        raise ConfigError(f"{', '.join(C.flag(k) for k in foreign)}: not a TRM setting (a TRM's own settings go in "
                          "its model mapping, e.g. --model '{\"type\": \"trm\", \"preset\": \"trm-sudoku-mlp\", "
                          "\"lr\": 3e-3}')")
    return C.build(TrmTrainConfig, yaml_path, {**{k: v for k, v in flags.items() if k in fields}, "model": model})
