"""TrainConfig: every setting of `harvest train`, from a YAML file and flags (flags win), validated with
one-line errors. The same dataclass machinery as ExtractConfig (harvest.config.build)."""

from __future__ import annotations

import dataclasses
from typing import Any

from harvest.config import COMPUTE_DTYPES, FORMATS, LONG_POLICIES, ConfigError

SCHEDULES = ("cosine", "linear", "constant")
REMATS = ("none", "layer", "dots")
PARAM_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    data: str
    out: str
    model: str | None = None  # a HF checkpoint dir or hub id to start from ...
    shape: dict | None = None  # ... or a HF config.json's fields, to start from scratch
    tokenizer: str | None = None  # default: the --model checkpoint's own
    format: str = "text"
    text_field: str = "text"
    long: str = "chunk"
    seq_len: int = 2048
    batch_size: int = 8  # global packed rows per optimizer step
    steps: int = 1000
    lr: float = 3e-4
    warmup: int = 100
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    grad_accum: int = 1
    mesh: str | None = None  # None: every device on fsdp
    param_dtype: str = "float32"
    compute_dtype: str | None = None  # None: float32 on CPU, bfloat16 on accelerators
    remat: str = "layer"
    checkpoint_every: int = 100
    keep: int = 3
    seed: int = 0
    log_every: int = 10
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    peer_timeout: int = 60

    # Settings a resumed run must keep: they decide which data and which model the checkpoint holds.
    RUN_FIELDS = ("model", "shape", "tokenizer", "data", "format", "text_field", "long", "seq_len", "batch_size",
                  "seed", "param_dtype")
    # Settings of one process only: never compared across processes.
    LOCAL_FIELDS = ("process_id",)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def run_settings(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.RUN_FIELDS}

    def shared_settings(self) -> dict[str, Any]:
        return {k: v for k, v in self.to_dict().items() if k not in self.LOCAL_FIELDS}

    def validate(self) -> TrainConfig:
        if (self.model is None) == (self.shape is None):
            raise ConfigError("give exactly one of --model (a HF checkpoint to start from) and --shape "
                              "(a config.json's fields, to start from scratch)")
        if self.shape is not None and self.tokenizer is None:
            raise ConfigError("--shape starts from scratch: also give --tokenizer (a checkpoint dir or hub id)")
        for name, value, allowed in (("--format", self.format, FORMATS), ("--long", self.long, LONG_POLICIES),
                                     ("--schedule", self.schedule, SCHEDULES), ("--remat", self.remat, REMATS),
                                     ("--param-dtype", self.param_dtype, PARAM_DTYPES)):
            if value not in allowed:
                raise ConfigError(f"{name} {value!r}: choose one of {', '.join(allowed)}")
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"--compute-dtype {self.compute_dtype!r}: choose one of {', '.join(COMPUTE_DTYPES)}")
        for name, value, low in (("--seq-len", self.seq_len, 2), ("--batch-size", self.batch_size, 1),
                                 ("--steps", self.steps, 0), ("--warmup", self.warmup, 0),
                                 ("--grad-accum", self.grad_accum, 1), ("--checkpoint-every", self.checkpoint_every, 1),
                                 ("--keep", self.keep, 1), ("--log-every", self.log_every, 1), ("--seed", self.seed, 0)):
            if value < low:
                raise ConfigError(f"{name} {value}: must be at least {low}")
        for name, value, low, high in (("--lr", self.lr, 0.0, None), ("--min-lr-ratio", self.min_lr_ratio, 0.0, 1.0),
                                       ("--weight-decay", self.weight_decay, 0.0, None), ("--b1", self.b1, 0.0, 1.0),
                                       ("--b2", self.b2, 0.0, 1.0), ("--grad-clip", self.grad_clip, 0.0, None)):
            if value < low or (high is not None and value > high):
                raise ConfigError(f"{name} {value}: must be in [{low}, {high if high is not None else 'inf'}]")
        if self.batch_size % self.grad_accum:
            raise ConfigError(f"--batch-size {self.batch_size} is not a multiple of --grad-accum {self.grad_accum}")
        return self
