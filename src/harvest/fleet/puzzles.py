"""A TRM fleet's puzzle dataset, built once before the trainers read it.

fleet.yaml's `puzzles:` (the `kind` and any `harvest puzzles build` setting) makes the plan add one build
job, `{fleet}.puzzles`, on a CPU VM in the trainers' regions, writing the dataset to the fleet's `data`.
`fleet up` launches it while `data` holds no dataset and starts the trainers once the dataset's commit
marker is there (harvest.fleet.launch): a pod slice is never held while a CPU builds its data, and a
dataset is never built twice (a build is refused where a complete one exists). Without `puzzles:`, a TRM
fleet's `data` must already hold a dataset: the plan says so in one line when it does not.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from harvest import config
from harvest.errors import UserError
from harvest.fleet.jobs import flag_args
from harvest.fleet.spec import FleetError, FleetSpec, Group
from harvest.puzzles.config import KINDS, PuzzlesConfig
from harvest.puzzles.format import MARKER
from harvest.storage import Storage

BUILD_NAME = "puzzles"  # {fleet}.puzzles: two parts, where a worker's job name has three
BUILD_CPUS = "8+"
PLANNED = {"out": "the fleet's data", "overwrite": "never: a rebuild would change the data under the trainers"}


@dataclasses.dataclass(frozen=True)
class PuzzlesBuild:
    fleet: str
    kind: str  # sudoku | maze | arc
    settings: dict[str, Any]  # PuzzlesConfig settings, `out` included
    group: Group  # the trainers' group: its regions, spot and out's neighbourhood
    present: bool  # the dataset was already complete when planned

    @property
    def job_name(self) -> str:
        return f"{self.fleet}.{BUILD_NAME}"

    @property
    def out(self) -> str:
        return self.settings["out"]

    def args(self) -> list[str]:
        return ["puzzles", "build", self.kind, *flag_args(PuzzlesConfig, self.settings)]


def dataset_present(url: str) -> bool:
    """The dataset's commit marker is there (a build cut short leaves none)."""
    return Storage(url).exists(MARKER)


def check_puzzles(spec: FleetSpec, trainer: str, group: Group) -> PuzzlesBuild | None:
    """The build a TRM fleet needs (None without `puzzles:`), or one line: a setting `harvest puzzles build`
    refuses, or a TRM fleet whose data holds no dataset and says nothing of building one."""
    present = trainer == "trm" and dataset_present(spec.data)
    if spec.puzzles is None:
        if trainer == "trm" and not present:
            raise FleetError(f"{spec.path}: data {spec.data} holds no puzzle dataset ({MARKER} is missing): build "
                             f"it first (harvest puzzles build KIND --out {spec.data}), or add a puzzles: section "
                             f"(kind: sudoku|maze|arc and its settings) so that `fleet up` builds it once before "
                             f"the trainers start")
        return None
    if trainer != "trm":
        raise FleetError(f"{spec.path}: puzzles: builds a TRM's dataset, but train: model is a decoder; remove it")
    settings = {str(k).replace("-", "_"): v for k, v in spec.puzzles.items()}
    kind = settings.pop("kind", None)
    if kind not in KINDS:
        raise FleetError(f"{spec.path}: puzzles: kind {kind!r}: choose one of {', '.join(KINDS)}")
    fields = {f.name for f in dataclasses.fields(PuzzlesConfig)}
    for key in settings:
        if key not in fields:
            raise FleetError(f"{spec.path}: puzzles: unknown setting {key!r} (settings are those of "
                             f"`harvest puzzles build --help`)")
        if key in PLANNED:
            raise FleetError(f"{spec.path}: puzzles: {key} is set by the plan: {PLANNED[key]}; remove it")
    settings["out"] = spec.data
    try:
        config.build(PuzzlesConfig, None, settings).check(kind)
    except UserError as e:
        raise FleetError(f"{spec.path}: puzzles: {e}") from None
    return PuzzlesBuild(spec.name, kind, settings, group, present)
