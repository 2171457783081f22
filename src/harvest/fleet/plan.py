"""`harvest fleet plan`: deal the streams to workers, check everything a launch could trip on, and write
one SkyPilot task per worker. Needs no cloud: only streams.json is read.

A worker is `{fleet}/{group}/{k}` for good: its job name, lease holder and task are the same after every
recovery, so a recovered worker takes its own leases back and resumes its own streams. Job names join the
names with dots, which no name holds: two fleets never share a job name, so `status`, `up` and `down` see
only their own fleet's jobs.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
from pathlib import Path
from typing import Any

import yaml
from rich.table import Table

from harvest import config
from harvest.config import ExtractConfig
from harvest.data.streams import StreamSet
from harvest.errors import RetryLater, UserError
from harvest.fleet.container import docker_run
from harvest.fleet.spec import PLAN_ENVS, FleetError, FleetSpec, Group
from harvest.fleet.topology import Topology, topology
from harvest.ranges import format_ranges, parse_ranges
from harvest.runtime.mesh import mesh_shape

# Settings the plan sets per worker; a fleet.yaml `extract` section may not.
PER_WORKER = {"data": "the fleet's data", "out": "each group's out", "streams": "each group's streams",
              "mesh": "each group's mesh", "worker_id": "the plan ({name}/{group}/{k})",
              "coordinator": "SkyPilot's env", "num_processes": "SkyPilot's env", "process_id": "SkyPilot's env"}
REFUSED = {"overwrite": "a recovered worker would delete what it wrote before its preemption"}
RETRYABLE_EXIT_CODES = (RetryLater.exit_code,)  # storage unreachable for now: a rerun resumes
COORDINATOR_PORT = 8476
JOB_RECOVERY = "EAGER_NEXT_REGION"
MAX_RESTARTS_ON_ERRORS = 3


@dataclasses.dataclass(frozen=True)
class Worker:
    fleet: str
    group: Group
    index: int
    streams: tuple[int, ...]
    topology: Topology

    @property
    def worker_id(self) -> str:
        """The lease holder's name, stable across recoveries."""
        return f"{self.fleet}/{self.group.name}/{self.index}"

    @property
    def job_name(self) -> str:
        """SkyPilot's job name: no slashes there; dots, which fleet and group names never hold."""
        return f"{self.fleet}.{self.group.name}.{self.index}"


@dataclasses.dataclass(frozen=True)
class Plan:
    spec: FleetSpec
    num_streams: int
    counts: tuple[int, ...] | None  # records per stream, from streams.json
    workers: tuple[Worker, ...]

    def group_workers(self, group: str) -> list[Worker]:
        return [w for w in self.workers if w.group.name == group]


def make_plan(spec: FleetSpec) -> Plan:
    """Check the fleet against its data (streams.json of spec.data) and deal the streams."""
    streams = StreamSet.open(spec.data)
    num_streams, counts = streams.num_streams, streams.meta.get("counts")
    check_extract(spec)
    shapes = {g.name: _topology(spec, g) for g in spec.groups}
    dealt = deal(spec, num_streams)
    workers = tuple(Worker(spec.name, g, k, tuple(streams), shapes[g.name])
                    for g in spec.groups for k, streams in enumerate(dealt[g.name]))
    return Plan(spec, num_streams, tuple(counts) if counts else None, workers)


def check_extract(spec: FleetSpec) -> ExtractConfig:
    """Every key of `extract` is a `harvest extract` setting with a valid value (checked as the CLI would)."""
    fields = {f.name for f in dataclasses.fields(ExtractConfig)}
    for key in spec.extract:
        if key not in fields:
            raise FleetError(f"{spec.path}: extract: unknown setting {key!r} (settings are those of "
                             f"`harvest extract --help`, e.g. model, points, format, max_seq_len)")
        if key in PER_WORKER:
            raise FleetError(f"{spec.path}: extract: {key} is set per worker from {PER_WORKER[key]}; remove it")
        if key in REFUSED and spec.extract[key]:
            raise FleetError(f"{spec.path}: extract: {key} is refused in a fleet: {REFUSED[key]}")
    try:
        return config.build(ExtractConfig, None, {**spec.extract, "data": spec.data, "out": "planned"})
    except UserError as e:
        raise FleetError(f"{spec.path}: extract: {e}") from None


def _topology(spec: FleetSpec, group: Group) -> Topology:
    try:
        shape = topology(group.accelerator, group.num_nodes)
    except UserError as e:
        raise FleetError(f"{spec.path}: group {group.name}: {e}") from None
    if group.mesh is not None:
        try:
            mesh_shape(group.mesh, shape.devices, shape.hosts)
        except UserError as e:
            raise FleetError(f"{spec.path}: group {group.name}: mesh {group.mesh} does not fit {shape.accelerator} "
                             f"({shape.describe()}, {shape.devices} devices): {e}") from None
    return shape


def deal(spec: FleetSpec, num_streams: int) -> dict[str, list[list[int]]]:
    """Streams per worker, per group: explicit ranges as given, the rest to `auto` groups in proportion to
    their chips; within a group, contiguous runs as even as they come. Every stream in exactly one worker."""
    owner: dict[int, str] = {}
    given: dict[str, list[int]] = {}
    for g in spec.groups:
        if g.streams == "auto":
            continue
        streams = parse_ranges(g.streams, f"{spec.path}: group {g.name}: streams")
        past = [s for s in streams if s >= num_streams]
        if past:
            raise FleetError(f"{spec.path}: group {g.name}: streams {g.streams} reach past the data's "
                             f"{num_streams} streams (0-{num_streams - 1}): {format_ranges(past)} do not exist")
        clash = sorted(s for s in streams if s in owner)
        if clash:
            other = owner[clash[0]]
            raise FleetError(f"{spec.path}: group {g.name}: streams {format_ranges(clash)} are also in group "
                             f"{other}; each stream must be in exactly one worker")
        owner.update({s: g.name for s in streams})
        given[g.name] = streams
    rest = [s for s in range(num_streams) if s not in owner]
    auto = [g for g in spec.groups if g.streams == "auto"]
    if rest and not auto:
        raise FleetError(f"{spec.path}: streams {format_ranges(rest)} of {num_streams} are in no group: add them "
                         f"to a group's streams, or set one group's streams to auto")
    weights = [g.workers * topology(g.accelerator, g.num_nodes).chips for g in auto]
    for g, share in zip(auto, _split(rest, weights)):
        given[g.name] = share
    dealt = {}
    for g in spec.groups:
        streams = given[g.name]
        if len(streams) < g.workers:
            raise FleetError(f"{spec.path}: group {g.name}: {g.workers} workers but only {len(streams)} "
                             f"stream{'s' * (len(streams) != 1)} for them; use fewer workers or more streams")
        dealt[g.name] = _split(streams, [1] * g.workers)
    return dealt


def _split(items: list[int], weights: list[int]) -> list[list[int]]:
    """Contiguous parts of `items` sized in proportion to `weights` (largest remainders round up)."""
    total = sum(weights)
    exact = [len(items) * w / total for w in weights]
    sizes = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: (sizes[i] - exact[i], i))[:len(items) - sum(sizes)]:
        sizes[i] += 1
    parts, at = [], 0
    for size in sizes:
        parts.append(items[at:at + size])
        at += size
    return parts


# the commands and tasks ----------------------------------------------------------------------------------

def extract_args(worker: Worker, spec: FleetSpec) -> list[str]:
    """`extract` and its flags for one worker: the fleet's settings, then what the plan decides."""
    settings = dict(spec.extract)
    settings.update(data=spec.data, out=worker.group.out, streams=format_ranges(worker.streams),
                    worker_id=worker.worker_id, mesh=worker.group.mesh)
    args = ["extract"]
    for field in dataclasses.fields(ExtractConfig):
        value = settings.get(field.name)
        if value is None or value is False:
            continue
        args += [config.flag(field.name)] if value is True else [config.flag(field.name), str(value)]
    return args


def _multi_node_flags() -> str:
    """Process flags derived on each node from the env SkyPilot sets there (node 0 coordinates)."""
    return (f'--coordinator "$(echo "$SKYPILOT_NODE_IPS" | head -n1):{COORDINATOR_PORT}" '
            '--num-processes "$SKYPILOT_NUM_NODES" --process-id "$SKYPILOT_NODE_RANK"')


def _mounts(worker: Worker, spec: FleetSpec) -> dict[str, bool]:
    """The local paths a container must see (only with shared_paths): data and model read-only, out not."""
    paths = {spec.data: True, worker.group.out: False, str(spec.extract.get("model") or ""): True}
    return {path: ro for path, ro in paths.items() if os.path.isabs(path)}


def _task_env_names(spec: FleetSpec) -> list[str]:
    """The variables a task sets on its hosts: the plan's, the fleet's envs, its secrets."""
    return [*PLAN_ENVS, *spec.envs, *spec.secrets]


def run_command(worker: Worker, spec: FleetSpec) -> str:
    """The exact shell command each host of the worker runs. A TPU slice runs it on every host and JAX
    finds its peers; a multi-node GPU (or CPU) group derives the process flags from SkyPilot's env. With an
    image, a TPU host starts the container itself (harvest.fleet.container); elsewhere SkyPilot runs the
    command inside the image it started."""
    args = extract_args(worker, spec)
    if spec.image is not None and worker.topology.kind == "tpu":
        return docker_run(spec.image, args, _task_env_names(spec), _mounts(worker, spec))  # entry point: harvest
    command = "harvest " + " ".join(shlex.quote(a) for a in args)
    if worker.topology.kind != "tpu" and worker.group.num_nodes > 1:
        command += " " + _multi_node_flags()
    return command


def task_config(worker: Worker, spec: FleetSpec) -> dict[str, Any]:
    """One SkyPilot task (as its YAML holds it) for one worker: a managed job that recovers on preemption
    and on harvest's retryable exits, in any of the group's regions."""
    g, shape = worker.group, worker.topology
    resources: dict[str, Any] = {
        "use_spot": g.spot,
        "any_of": [{"region": r} for r in g.regions],
        "job_recovery": {"strategy": JOB_RECOVERY, "max_restarts_on_errors": MAX_RESTARTS_ON_ERRORS,
                         "recover_on_exit_codes": list(RETRYABLE_EXIT_CODES)},
    }
    if shape.kind == "cpu":
        resources["cpus"] = "4+"
    else:
        resources["accelerators"] = shape.accelerator
    if spec.image is not None and shape.kind != "tpu":
        resources["image_id"] = f"docker:{spec.image}"
    task: dict[str, Any] = {"name": worker.job_name, "resources": resources}
    if g.num_nodes > 1:
        task["num_nodes"] = g.num_nodes
    plan_envs = (spec.name, g.name, worker.worker_id)
    task["envs"] = {**dict(zip(PLAN_ENVS, plan_envs, strict=True)), **spec.envs}
    if spec.secrets:
        task["secrets"] = dict.fromkeys(spec.secrets)  # values: `fleet up` (harvest.fleet.launch), or --secret
    if spec.install is not None:
        task["setup"] = spec.install
    elif shape.kind == "tpu":
        task["setup"] = f"docker pull {shlex.quote(spec.image)}"
    task["run"] = run_command(worker, spec)
    return task


def emit(plan: Plan, directory: str | Path) -> list[Path]:
    """Write one task YAML per worker, named after its job."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for w in plan.workers:
        path = out / f"{w.job_name}.yaml"
        path.write_text(yaml.dump(task_config(w, plan.spec), Dumper=_TaskDumper, sort_keys=False, width=10_000))
        paths.append(path)
    return paths


class _TaskDumper(yaml.SafeDumper):
    """Multi-line strings (a docker command) as literal blocks: the file shows the command as bash reads it."""


_TaskDumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def plan_table(plan: Plan) -> Table:
    table = Table(title=f"fleet {plan.spec.name}: {len(plan.workers)} workers, {plan.num_streams} streams of "
                        f"{plan.spec.data}", title_justify="left")
    for name in ("group", "worker", "accelerator", "hosts x chips", "mesh", "streams", "out"):
        table.add_column(name, justify="right" if name in ("worker", "streams") else "left")
    for w in plan.workers:
        table.add_row(w.group.name, str(w.index), w.topology.accelerator + (" (spot)" if w.group.spot else ""),
                      f"{w.topology.hosts} x {w.topology.chips_per_host}", w.group.mesh or "data (all)",
                      format_ranges(w.streams), w.group.out)
    return table
