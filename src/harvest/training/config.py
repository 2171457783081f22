"""RuntimeConfig: the settings every trainer shares (where the run goes, the mesh, the processes, checkpoints,
logging), declared once; each trainer's config extends it and redeclares a field only to change its default or
its help (`like`). The fields are keyword-only so a trainer's own required settings may follow them."""

from __future__ import annotations

import dataclasses
from typing import Any

from harvest.config import ExtractConfig, RunSettings, setting
from harvest.training.curves import LOG_TO

def like(cls: type, name: str, default: Any = dataclasses.MISSING, help: str | None = None):
    """`cls`'s setting `name` with another default (or help): a trainer's own default for a shared setting."""
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    meta = field.metadata
    return setting(help or meta["help"], field.default if default is dataclasses.MISSING else default,
                   choices=meta["choices"], minimum=meta["minimum"])


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeConfig(RunSettings):
    out: str = setting("the run's URL (checkpoints, metrics, run.json): a local directory, gs:// or s3://")
    mesh: str | None = setting("data=..,fsdp=..,model=.. (default: every device on data)", None)
    checkpoint_every: int = setting("save a checkpoint every N steps", 1000, minimum=1)
    keep: int = setting("checkpoints to keep", 3, minimum=1)
    log_every: int = setting("metrics every N steps", 100, minimum=1)
    log_to: str | None = setting("also send process 0's metrics (those of RUN/metrics.jsonl) to Weights & Biases "
                                 "(project $WANDB_PROJECT, default harvest; a resumed run continues the same W&B "
                                 "run, its id kept in run.json) or to TensorBoard (RUN/tensorboard/, one event file a "
                                 "resumed run continues); needs the logging extra (pip install -e '.[logging]' in "
                                 "harvest's checkout)", None, choices=LOG_TO)
    coordinator: str | None = like(ExtractConfig, "coordinator", None)
    num_processes: int | None = like(ExtractConfig, "num_processes", None)
    process_id: int | None = like(ExtractConfig, "process_id", None)
    peer_timeout: int = like(ExtractConfig, "peer_timeout", 60)
    no_compile_cache: bool = like(ExtractConfig, "no_compile_cache", False)


def compute_dtype_setting():
    """--compute-dtype, as `harvest extract` has it (the decoder and the SAE trainers)."""
    return like(ExtractConfig, "compute_dtype", None)


def param_dtype_setting():
    """--param-dtype: master params and optimizer state (the decoder and the SAE trainers)."""
    return setting("master params and optimizer state", "float32", choices=("float32", "bfloat16"))
