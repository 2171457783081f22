"""What a model family gives the runtime to be trained by it (harvest.training.run): its record, its state and
data position (fresh or restored), its step, and its metrics' record and line. The runtime owns the order and
everything the three families share; a trainer owns what only its model knows."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

from harvest.storage import Storage
from harvest.training.checkpoint import Checkpoints
from harvest.training.config import RuntimeConfig
from harvest.training.record import RunRecord


class Trainer(abc.ABC):
    kind: ClassVar[str]  # run.json's kind (harvest.training.kinds)
    what: ClassVar[str]  # the run, as refusals name it: "a training run"
    settings_what: ClassVar[str]  # its settings, as the agreement across processes names them

    def __init__(self, cfg: RuntimeConfig):
        self.cfg = cfg
        self.steps = 0  # the run's last step; prepare may decide it (a TRM's comes from its dataset)

    @abc.abstractmethod
    def prepare(self, mesh, out: Storage) -> RunRecord:
        """Refuse what the user got wrong (before anything is written) and describe the run."""

    def agreed(self) -> dict[str, Any]:
        """What every process must agree on beyond the shared settings and the mesh."""
        return {}

    @abc.abstractmethod
    def abstract_state(self) -> Any:
        """The checkpoint's tree as shapes and shardings, to restore into."""

    @abc.abstractmethod
    def resume(self, state: Any, data: dict | None, checkpoints: Checkpoints) -> int:
        """Take the restored state and data position (None and None: start fresh); returns the step reached."""

    @abc.abstractmethod
    def advance(self, step: int) -> dict:
        """Run the step that ends at `step`; its metrics, still on the device."""

    def log_now(self, metrics: dict) -> bool:
        """Whether this step's metrics must be logged whatever --log-every says (an evaluation's)."""
        return False

    @abc.abstractmethod
    def save(self, checkpoints: Checkpoints, step: int) -> None:
        """Checkpoint the state and the data position at `step`."""

    @abc.abstractmethod
    def record(self, step: int, metrics: list[dict], steps: int, seconds: float) -> dict[str, Any]:
        """metrics.jsonl's record of the `steps` steps (their metrics fetched) that took `seconds`."""

    @abc.abstractmethod
    def line(self, record: dict[str, Any]) -> str:
        """The terminal's line for a record."""

    @abc.abstractmethod
    def final(self, step: int, last: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """The summary's own part at the step reached (`last`: the newest record), and how the command prints it
        ("loss 2.3")."""
