"""TrainConfig: the settings of `harvest train` (a decoder) on top of the runtime's, from a YAML file and flags
(flags win), validated with one-line errors."""

from __future__ import annotations

import dataclasses
from harvest.config import ATTENTION_HELP, ConfigError, ExtractConfig, check_settings, setting
from harvest.training.config import RuntimeConfig, compute_dtype_setting, like, param_dtype_setting


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig(RuntimeConfig):
    data: str = setting("a streams directory (holding streams.json) or a source: file, glob, gs://, s3://")
    model: str | None = setting("HF checkpoint directory, hub id or GGUF (a .gguf file or URL, or a directory "
                                "holding one) to start from (or --shape); or a TRM: a preset "
                                "(trm-sudoku-mlp, trm-maze, trm-arc) or {type: trm, preset: ..., overrides} (YAML, or "
                                "JSON as the flag), --data then a puzzle dataset", None)
    shape: dict | None = setting("start from scratch: a config.json's fields as a JSON object or JSON file "
                                 "(model_type, sizes, ...)", None)
    tokenizer: str | None = setting("tokenizer checkpoint directory or hub id (default: --model's)", None)
    format: str = like(ExtractConfig, "format", "text")
    text_field: str = like(ExtractConfig, "text_field", "text")
    long: str = like(ExtractConfig, "long", "chunk", "samples longer than --seq-len, always counted")
    seq_len: int = setting("tokens per packed row", 2048, minimum=2)
    batch_size: int = setting("global packed rows per optimizer step", 8, minimum=1)
    steps: int = setting("train until this many steps", 1000, minimum=0)
    lr: float = setting("peak learning rate", 3e-4, minimum=0)
    warmup: int = setting("linear warmup steps", 100, minimum=0)
    schedule: str = setting("learning rate after warmup", "cosine", choices=("cosine", "linear", "constant"))
    min_lr_ratio: float = setting("final lr as a fraction of --lr (0..1)", 0.1, minimum=0)
    weight_decay: float = setting("AdamW decoupled weight decay on matrices", 0.1, minimum=0)
    b1: float = setting("AdamW beta1 (0..1)", 0.9, minimum=0)
    b2: float = setting("AdamW beta2 (0..1)", 0.95, minimum=0)
    grad_clip: float = setting("clip gradients to this global norm, 0 = off", 1.0, minimum=0)
    grad_accum: int = setting("micro-batches per step, gradients accumulated", 1, minimum=1)
    mesh: str | None = like(RuntimeConfig, "mesh", help="1d | 2d | 3d | data=..,fsdp=..,model=.. (default: every "
                                                         "device on fsdp)")
    param_dtype: str = param_dtype_setting()
    compute_dtype: str | None = compute_dtype_setting()
    remat: str = setting("recompute in the backward pass", "layer", choices=("none", "layer", "dots"))
    attention: str = like(ExtractConfig, "attention", "auto",
                          ATTENTION_HELP.format(cpu="dense on CPU (blocks has no backward pass)"))
    checkpoint_every: int = like(RuntimeConfig, "checkpoint_every", 100)
    seed: int = setting("seed of a from-scratch init", 0, minimum=0)
    log_every: int = like(RuntimeConfig, "log_every", 10)

    # Settings a resumed run must keep: they decide which data and which model the checkpoint holds.
    RUN_FIELDS = ("model", "shape", "tokenizer", "data", "format", "text_field", "long", "seq_len", "batch_size",
                  "seed", "param_dtype")

    def validate(self) -> TrainConfig:
        if (self.model is None) == (self.shape is None):
            raise ConfigError("give exactly one of --model (a HF checkpoint to start from) and --shape "
                              "(a config.json's fields, to start from scratch)")
        if self.shape is not None and self.tokenizer is None:
            raise ConfigError("--shape starts from scratch: also give --tokenizer (a checkpoint dir or hub id)")
        check_settings(self)
        for name, value in (("--min-lr-ratio", self.min_lr_ratio), ("--b1", self.b1), ("--b2", self.b2)):
            if value > 1:
                raise ConfigError(f"{name} {value}: must be in [0, 1]")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"--batch-size {self.batch_size} is not a multiple of --grad-accum {self.grad_accum}")
        return self
