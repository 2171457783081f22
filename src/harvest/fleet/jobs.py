"""The kinds of job a fleet runs (fleet.yaml's `extract:`, `train:`, `sae:` or `features:`) and what the plan
needs of each: the harvest command, the settings the plan sets itself, and the check of the fleet's section
as that command checks its own settings (the command's config validation, called, not copied).

A training job (`train:` a decoder or a TRM, `sae:`) is one group of `workers: 1`: one pod slice or one
multi-node GPU group whose hosts run one multi-controller JAX program. The plan refuses here, in one line,
what its first start would: a mesh that does not fit the slice, a batch that does not split over the data
axes (data x fsdp), a setting the command refuses.

A features job (`harvest sae features`) is many one-host workers, each one rank of the pass: every worker of
every group reads its share of the run's shards and writes its part into the one `out` they share, and the
last to finish merges the parts and writes the site. A rerun of a worker's command resumes its pass, so a
preempted worker is recovered by relaunching it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from harvest import config
from harvest.config import ExtractConfig
from harvest.errors import UserError
from harvest.fleet.spec import FleetError, FleetSpec, Group
from harvest.fleet.topology import Topology
from harvest.runtime.mesh import mesh_shape
from harvest.sae.features.config import FeaturesConfig
from harvest.training import kinds
from harvest.training.kinds import KINDS

_PROCESS = {"coordinator": "SkyPilot's env", "num_processes": "SkyPilot's env", "process_id": "SkyPilot's env"}
# Settings the plan sets per worker; the job's section may not.
PLANNED = {
    "extract": {"data": "the fleet's data", "out": "each group's out", "streams": "each group's streams",
                "mesh": "each group's mesh", "worker_id": "the plan ({name}/{group}/{k})", **_PROCESS},
    "train": {"data": "the fleet's data", "out": "the group's out", **_PROCESS},
    "sae": {"run": "the fleet's data", "out": "the group's out", **_PROCESS},
    "features": {"sae": "the fleet's data", "out": "the groups' out (one for every rank)",
                 "rank": "the plan (one rank per worker)", "world": "the plan (every worker of every group)"},
}
REFUSED = {"overwrite": "a recovered worker would delete what it wrote before its preemption"}
COMMAND = {"extract": ("extract",), "train": KINDS["train"].command, "sae": KINDS["sae"].command,
           "features": ("sae", "features")}  # features: then the SAE run, its one positional argument
INPUT = {"extract": "data", "train": "data", "sae": "run", "features": "sae"}  # what the fleet's `data` fills
DEFAULT_MESH = {k.trainer_name: k.default_mesh for k in KINDS.values()}  # as each trainer defaults


@dataclasses.dataclass(frozen=True)
class TrainingShape:
    """A training job on its group: the mesh it will run on and how its global batch splits."""

    trainer: str  # "decoder" | "trm" | "sae"
    mesh: dict[str, int]  # axis sizes
    batch: str  # e.g. "256 rows, 8 per data slot"
    steps: int | None  # the run's last step, where the settings say (a TRM's default comes from its dataset)

    @property
    def mesh_text(self) -> str:
        return ",".join(f"{axis}={size}" for axis, size in self.mesh.items() if size > 1) or "data=1"


def trainer(spec: FleetSpec) -> str:
    """decoder, trm or sae (the train: section's model names a TRM, as `harvest train` reads it)."""
    if spec.job == "sae":
        return "sae"
    try:
        return kinds.train_kind(spec.settings.get("model")).trainer_name
    except UserError as e:
        raise FleetError(f"{spec.path}: train: {e}") from None


def config_class(spec: FleetSpec) -> type:
    if spec.job == "extract":
        return ExtractConfig
    if spec.job == "features":
        return FeaturesConfig
    return kinds.BY_TRAINER[trainer(spec)].config()


def check_job(spec: FleetSpec) -> Any:
    """Every key of the job's section is a setting of its command with a valid value, checked by the
    command's own validation; returns the config the command would run with (its `out` a placeholder)."""
    job = spec.job
    command = "harvest " + " ".join(COMMAND[job])
    # train: a decoder's setting given to a TRM (or the reverse) is refused by `harvest train` itself, below
    classes = (KINDS["train"].config(), KINDS["trm"].config()) if job == "train" else (config_class(spec),)
    fields = {f.name for cls in classes for f in dataclasses.fields(cls)}
    for key in spec.settings:
        if key not in fields:
            raise FleetError(f"{spec.path}: {job}: unknown setting {key!r} (settings are those of "
                             f"`{command} --help`)")
        if key in PLANNED[job]:
            raise FleetError(f"{spec.path}: {job}: {key} is set per worker from {PLANNED[job][key]}; remove it")
        if key in REFUSED and spec.settings[key]:
            raise FleetError(f"{spec.path}: {job}: {key} is refused in a fleet: {REFUSED[key]}")
    flags = {**spec.settings, INPUT[job]: spec.data, "out": "planned"}
    try:
        if job == "train":
            return kinds.train_config(None, flags)  # exactly as `harvest train` builds and checks its settings
        return config.build(config_class(spec), None, flags)
    except UserError as e:
        raise FleetError(f"{spec.path}: {job}: {e}") from None


def check_features(spec: FleetSpec, shapes: dict[str, Topology]) -> None:
    """Every rank writes its part into one out, on one host (the pass is one process per rank)."""
    outs = {g.out for g in spec.groups}
    if len(outs) > 1:
        raise FleetError(f"{spec.path}: features: every rank writes its part into one out, where the last merges "
                         f"them, but the groups name {len(outs)}: {', '.join(sorted(outs))}; give them one out")
    for g in spec.groups:
        where, shape = f"{spec.path}: group {g.name}", shapes[g.name]
        if g.streams != "auto":
            raise FleetError(f"{where}: streams {g.streams}: a features: job deals the run's shards to its ranks "
                             f"itself; remove it")
        if g.mesh is not None:
            raise FleetError(f"{where}: mesh {g.mesh}: a features: worker encodes on every device of its host; "
                             f"remove it")
        if shape.hosts > 1:
            raise FleetError(f"{where}: {shape.accelerator} is {shape.describe()}: a features: worker is one "
                             f"process on one host; use a one-host accelerator and more workers (each a rank)")


def world(spec: FleetSpec) -> int:
    """A features pass's ranks: every worker of every group."""
    return sum(g.workers for g in spec.groups)


def training_shape(spec: FleetSpec, group: Group, shape: Topology, cfg: Any) -> TrainingShape:
    """The group's mesh on its slice and the batch's split over the data axes, or one line saying why not."""
    where = f"{spec.path}: group {group.name}"
    if group.workers != 1:
        raise FleetError(f"{where}: workers {group.workers}: a {spec.job}: job runs on one pod slice or GPU group "
                         f"(workers: 1; a bigger accelerator, e.g. tpu-v4-64, or num_nodes for GPUs, for more chips)")
    if group.streams != "auto":
        raise FleetError(f"{where}: streams {group.streams}: streams are dealt to extraction workers; remove it")
    kind = trainer(spec)
    if group.mesh is not None and cfg.mesh is not None and group.mesh != cfg.mesh:
        raise FleetError(f"{where}: mesh {group.mesh} and {spec.job}: mesh {cfg.mesh} differ; give the mesh once")
    spec_text = group.mesh or cfg.mesh or DEFAULT_MESH[kind].format(shape.devices)
    try:
        mesh = mesh_shape(spec_text, shape.devices, shape.hosts)
    except UserError as e:
        raise FleetError(f"{where}: mesh {spec_text} does not fit {shape.accelerator} ({shape.describe()}, "
                         f"{shape.devices} devices): {e}") from None
    if kind == "sae" and cfg.follow and shape.hosts > 1:
        raise FleetError(f"{where}: sae: follow reads a run still being written with one process, and "
                         f"{shape.accelerator} runs {shape.hosts} hosts; follow on one host, or train once the run "
                         f"is complete")
    if kind == "trm" and mesh["model"] > 1:
        raise FleetError(f"{where}: mesh {spec_text}: a TRM is replicated, not split over model; put the devices "
                         f"on data and fsdp")
    slots = mesh["data"] * mesh["fsdp"]
    rows, what = _batch_rows(kind, cfg)
    if rows % slots:
        raise FleetError(f"{where}: {what} = {rows} does not split over the mesh's {slots} data slots (data x fsdp "
                         f"of {spec_text} on {shape.accelerator}); use a multiple of {slots}")
    unit = kinds.BY_TRAINER[kind].unit
    return TrainingShape(kind, mesh, f"{rows} {unit}, {rows // slots} per data slot", cfg.steps)


def _batch_rows(kind: str, cfg: Any) -> tuple[int, str]:
    """What each trainer splits over its data slots per step (a micro-batch, a batch, one run's part)."""
    if kind == "decoder":
        return cfg.batch_size // cfg.grad_accum, f"batch_size {cfg.batch_size} / grad_accum {cfg.grad_accum}"
    if kind == "trm":
        return cfg.batch_size, "batch_size"
    runs = len(cfg.run)
    return cfg.batch_tokens // runs, f"batch_tokens {cfg.batch_tokens}" + (f" / {runs} runs" if runs > 1 else "")


def flag_args(cls: type, settings: dict[str, Any]) -> list[str]:
    """The flags (in the config's field order) for `settings`: what the command's CLI parses back."""
    args: list[str] = []
    for field in dataclasses.fields(cls):
        value = settings.get(field.name)
        if value is None or value is False:
            continue
        args += [config.flag(field.name)] if value is True else [config.flag(field.name), _flag_value(value)]
    return args


def _flag_value(value: Any) -> str:
    """A mapping as the JSON object its flag takes (--model of a TRM, --shape), a list comma-separated."""
    if isinstance(value, dict):
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)
