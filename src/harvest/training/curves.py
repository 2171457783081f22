"""Training curves where users look at them (`--log-to`): process 0 sends each record it writes to metrics.jsonl
to Weights & Biases or to a TensorBoard event file as well. The packages stay optional (pip install
the logging extra): imported only when the flag names them, and a missing one is refused before the run starts.

A resumed run continues the same curves: the W&B run whose id the run's record (run.json) keeps, resumed;
the event file RUN/tensorboard/events.out.tfevents.0.harvest, rewritten (like metrics.jsonl) from the records
the resumed run keeps plus its new ones, so a step is never shown twice. W&B's local files go under the run's
--out (OUT/wandb/; `wandb_dir`), not into the directory the command ran in."""

from __future__ import annotations

import io
import os
from typing import Any

from harvest.config import stable_hash
from harvest.errors import UserError
from harvest.storage import Storage
from harvest.version import install_extra

LOG_TO = ("wandb", "tensorboard")
EVENT_FILE = "tensorboard/events.out.tfevents.0.harvest"  # TensorBoard finds event files by "tfevents" in the name
_PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard"}


def require(log_to: str | None) -> None:
    """Refuse in one line, before anything is written, a --log-to whose package is not installed."""
    if log_to is None:
        return
    try:
        __import__(_PACKAGES[log_to])
    except ImportError:
        raise UserError(f"--log-to {log_to}: the {_PACKAGES[log_to]} package is not installed; "
                        f"{install_extra('logging')} (or leave --log-to out)") from None


def scalars(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The record's numbers as flat tags (an SAE's per-tensor metrics as `tensors/resid_post.12/fvu`); the step is
    the x-axis and the wall time the event's own, so neither is a curve."""
    flat: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key in ("step", "time"):
            continue
        if isinstance(value, dict):
            flat.update(scalars(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[prefix + key] = float(value)
    return flat


def wandb_dir(out: Storage) -> str | None:
    """Where W&B keeps a run's local files (its `wandb/` directory: the offline run, logs, the synced copy): under
    the run's --out where that is local (OUT/wandb/), else under harvest's cache ($HARVEST_CACHE/wandb/<hash of
    the URL>/wandb/), never the current directory. None where $WANDB_DIR names one: W&B's own setting wins."""
    if os.environ.get("WANDB_DIR"):
        return None
    if out.is_local:
        path = out.path()
    else:
        from harvest.runtime.cache import root

        path = str(root() / "wandb" / stable_hash(out.url)[:16])
    os.makedirs(path, exist_ok=True)
    return path


class WandbCurves:
    """One W&B run per harvest run (project $WANDB_PROJECT, default harvest; WANDB_MODE=offline writes only the
    local run files, under `wandb_dir`), its id the run record's run_id so that every resume continues it."""

    def __init__(self, out: Storage, record: Any):
        import wandb

        run_id = record.run_id or stable_hash(out.url)[:16]  # a record written before run ids: one id per URL
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "harvest"), id=run_id, resume="allow",
                              dir=wandb_dir(out),
                              name=out.url.rstrip("/").rsplit("/", 1)[-1], job_type=record.kind,
                              config={**record.config, "mesh": record.mesh, "kernel": record.kernel})

    def append(self, records: list[dict[str, Any]]) -> None:
        self.run.log(scalars(records[-1]), step=records[-1]["step"])

    def close(self) -> None:
        self.run.finish()


class TensorBoardCurves:
    """RUN/tensorboard/: one event file of scalar summaries, written whole from the records at every append (as
    metrics.jsonl is), with tensorboard's own protos and record framing (no TensorFlow needed)."""

    def __init__(self, out: Storage, record: Any):
        self.out = out

    def append(self, records: list[dict[str, Any]]) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.record_writer import RecordWriter

        buffer = io.BytesIO()
        writer = RecordWriter(buffer)
        writer.write(Event(wall_time=records[0]["time"], file_version="brain.Event:2").SerializeToString())
        for r in records:
            values = [Summary.Value(tag=tag, simple_value=v) for tag, v in scalars(r).items()]
            writer.write(Event(wall_time=r["time"], step=r["step"], summary=Summary(value=values)).SerializeToString())
        self.out.write_bytes(EVENT_FILE, buffer.getvalue())

    def close(self) -> None:
        pass


def open_curves(log_to: str | None, out: Storage, record: Any) -> WandbCurves | TensorBoardCurves | None:
    """The sink --log-to names, or None; call it on process 0 only, after the run's record is written."""
    if log_to is None:
        return None
    return {"wandb": WandbCurves, "tensorboard": TensorBoardCurves}[log_to](out, record)
