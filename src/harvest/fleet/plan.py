"""`harvest fleet plan`: deal the streams to workers (or place a training job on its slice, or number a
features pass's ranks), check everything a launch could trip on, and write one SkyPilot task per worker.
Needs no cloud: only the data's own records are read (streams.json; a TRM's dataset.json).

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

from harvest.data.streams import StreamSet
from harvest.errors import RetryLater, UserError
from harvest.fleet import carry
from harvest.fleet.container import docker_run
from harvest.fleet.jobs import (COMMAND, INPUT, TrainingShape, check_features, check_job, config_class, flag_args,
                                training_shape, world)
from harvest.fleet.puzzles import BUILD_CPUS, BUILD_NAME, PuzzlesBuild, check_puzzles
from harvest.fleet.spec import PLAN_ENVS, FleetError, FleetSpec, Group
from harvest.fleet.topology import Topology, topology
from harvest.ranges import format_ranges, parse_ranges
from harvest.runtime.mesh import mesh_shape

RETRYABLE_EXIT_CODES = (RetryLater.exit_code,)  # storage unreachable, or a trainer stopped on SIGTERM: a rerun resumes
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
    rank: int = 0  # a features: worker's rank of the pass (of the plan's workers)

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
    training: TrainingShape | None = None  # a train: or sae: job's mesh and batch on its one group
    build: PuzzlesBuild | None = None  # a TRM fleet's dataset, built once before its trainers start

    def group_workers(self, group: str) -> list[Worker]:
        return [w for w in self.workers if w.group.name == group]


def make_plan(spec: FleetSpec) -> Plan:
    """Check the fleet against its data and deal the streams (extraction), or place the one training job on
    its group (train:, sae:), or give each worker its rank (features:)."""
    if spec.job == "features":
        return _features_plan(spec)
    if spec.job != "extract":
        return _training_plan(spec)
    streams = StreamSet.open(spec.data)
    num_streams, counts = streams.num_streams, streams.meta.get("counts")
    check_job(spec)
    shapes = {g.name: _topology(spec, g) for g in spec.groups}
    for g in spec.groups:
        _check_mesh(spec, g, shapes[g.name])
    dealt = deal(spec, num_streams)
    workers = tuple(Worker(spec.name, g, k, tuple(streams), shapes[g.name])
                    for g in spec.groups for k, streams in enumerate(dealt[g.name]))
    return Plan(spec, num_streams, tuple(counts) if counts else None, workers)


def _training_plan(spec: FleetSpec) -> Plan:
    if len(spec.groups) != 1:
        raise FleetError(f"{spec.path}: a {spec.job}: job runs on one group (one pod slice or GPU group), got "
                         f"{len(spec.groups)}: {', '.join(g.name for g in spec.groups)}")
    group = spec.groups[0]
    cfg = check_job(spec)
    shape = _topology(spec, group)
    training = training_shape(spec, group, shape, cfg)
    build = check_puzzles(spec, training.trainer, group)
    return Plan(spec, 0, None, (Worker(spec.name, group, 0, (), shape),), training, build)


def _features_plan(spec: FleetSpec) -> Plan:
    """Every worker of every group one rank, in the groups' order."""
    check_job(spec)
    shapes = {g.name: _topology(spec, g) for g in spec.groups}
    check_features(spec, shapes)
    placed = [(g, k) for g in spec.groups for k in range(g.workers)]
    workers = tuple(Worker(spec.name, g, k, (), shapes[g.name], rank) for rank, (g, k) in enumerate(placed))
    return Plan(spec, 0, None, workers)


def _topology(spec: FleetSpec, group: Group) -> Topology:
    try:
        return topology(group.accelerator, group.num_nodes)
    except UserError as e:
        raise FleetError(f"{spec.path}: group {group.name}: {e}") from None


def _check_mesh(spec: FleetSpec, group: Group, shape: Topology) -> None:
    if group.mesh is not None:
        try:
            mesh_shape(group.mesh, shape.devices, shape.hosts)
        except UserError as e:
            raise FleetError(f"{spec.path}: group {group.name}: mesh {group.mesh} does not fit {shape.accelerator} "
                             f"({shape.describe()}, {shape.devices} devices): {e}") from None


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

def job_args(worker: Worker, spec: FleetSpec) -> list[str]:
    """The harvest command and its flags for one worker: the fleet's settings, then what the plan decides."""
    settings = dict(spec.settings)
    g = worker.group
    if spec.job == "extract":
        settings.update(data=spec.data, out=g.out, streams=format_ranges(worker.streams),
                        worker_id=worker.worker_id, mesh=g.mesh)
    elif spec.job == "features":
        settings.update(out=g.out, rank=worker.rank, world=world(spec))
        return [*COMMAND[spec.job], spec.data, *flag_args(config_class(spec), settings)]
    else:
        settings.update({INPUT[spec.job]: spec.data, "out": g.out, "mesh": g.mesh or settings.get("mesh")})
    return [*COMMAND[spec.job], *flag_args(config_class(spec), settings)]


def _multi_node_flags() -> str:
    """Process flags derived on each host from the env SkyPilot sets there; the first IP is rank 0's.

    SkyPilot runs a multi-node task's `run` on every node and sets SKYPILOT_NODE_IPS (the nodes' IPs, one a
    line, in rank order), SKYPILOT_NUM_NODES and SKYPILOT_NODE_RANK on each
    (https://docs.skypilot.co/en/stable/running-jobs/environment-variables.html, "SkyPilot environment
    variables"; https://docs.skypilot.co/en/stable/running-jobs/distributed-jobs.html). A TPU pod slice is
    one node of several hosts: SkyPilot runs setup and run on every host of the pod, one rank per host
    (https://docs.skypilot.co/en/latest/reference/tpu.html, "Multi-Host TPU Pods": its log shows head rank=0,
    worker1 rank=1, ...). In 0.14.1's code, sky/backends/cloud_vm_ray_backend.py runs `num_nodes *
    num_ips_per_node` (the slice's host IPs) ranks, and sky/backends/task_codegen.py sets the three
    variables for each of them."""
    return (f'--coordinator "$(echo "$SKYPILOT_NODE_IPS" | head -n1):{COORDINATOR_PORT}" '
            '--num-processes "$SKYPILOT_NUM_NODES" --process-id "$SKYPILOT_NODE_RANK"')


def _mounts(worker: Worker, spec: FleetSpec) -> dict[str, bool]:
    """The local paths a container must see (only with shared_paths): data and model read-only, out not."""
    read = [*spec.data.split(","), str(spec.settings.get("model") or ""),
            *str(spec.settings.get("run") or "").split(",")]  # run: a features job's, where given
    paths = {**dict.fromkeys(read, True), worker.group.out: False}
    return {path: ro for path, ro in paths.items() if os.path.isabs(path)}


def _task_env_names(spec: FleetSpec) -> list[str]:
    """The variables a task sets on its hosts: the plan's, the fleet's envs, its secrets."""
    return [*PLAN_ENVS, *spec.envs, *spec.secrets]


def _process_flags(worker: Worker, spec: FleetSpec) -> bool:
    """A job on several hosts takes its process layout from SkyPilot's env, except an extraction on one TPU
    slice, where JAX finds its peers itself (from the TPU's metadata)."""
    return worker.topology.hosts > 1 and not (spec.job == "extract" and worker.topology.kind == "tpu")


def run_command(worker: Worker, spec: FleetSpec) -> str:
    """The exact shell command each host of the worker runs (SkyPilot runs it on every host). With an image,
    a TPU host starts the container itself (harvest.fleet.container); elsewhere SkyPilot runs the command
    inside the image it started."""
    args = job_args(worker, spec)
    flags = " " + _multi_node_flags() if _process_flags(worker, spec) else ""
    if spec.image is not None and worker.topology.kind == "tpu":  # entry point: harvest; the flags' $VARs expand
        return docker_run(spec.image, args, _task_env_names(spec), _mounts(worker, spec)) + flags  # on the host
    return "harvest " + " ".join(shlex.quote(a) for a in args) + flags


def task_config(worker: Worker, spec: FleetSpec, wheel: Path | None = None) -> dict[str, Any]:
    """One SkyPilot task (as its YAML holds it) for one worker: a managed job that recovers on preemption
    and on harvest's retryable exits, in any of the group's regions. `wheel`: the checkout's, which a fleet
    with neither install nor image carries (harvest.fleet.carry)."""
    g, shape = worker.group, worker.topology
    task = _task(worker.job_name, g, spec, (spec.name, g.name, worker.worker_id), run_command(worker, spec),
                 accelerator=shape.accelerator if shape.kind != "cpu" else None, kind=shape.kind, wheel=wheel)
    if g.num_nodes > 1:
        task["num_nodes"] = g.num_nodes
    return task


def build_task(build: PuzzlesBuild, spec: FleetSpec, wheel: Path | None = None) -> dict[str, Any]:
    """The puzzles build's task: `harvest puzzles build` once, on a CPU VM in the trainers' regions."""
    command = "harvest " + " ".join(shlex.quote(a) for a in build.args())
    return _task(build.job_name, build.group, spec, (spec.name, build.group.name, f"{spec.name}/{BUILD_NAME}"),
                 command, cpus=BUILD_CPUS, wheel=wheel)


def _task(name: str, g: Group, spec: FleetSpec, plan_envs: tuple[str, str, str], run: str, *,
          accelerator: str | None = None, cpus: str = "4+", kind: str = "cpu",
          wheel: Path | None = None) -> dict[str, Any]:
    resources: dict[str, Any] = {
        "use_spot": g.spot,
        "any_of": [{"region": r} for r in g.regions],
        "job_recovery": {"strategy": JOB_RECOVERY, "max_restarts_on_errors": MAX_RESTARTS_ON_ERRORS,
                         "recover_on_exit_codes": list(RETRYABLE_EXIT_CODES)},
    }
    if accelerator is None:
        resources["cpus"] = cpus
    else:
        resources["accelerators"] = accelerator
    if spec.image is not None and kind != "tpu":
        resources["image_id"] = f"docker:{spec.image}"
    task: dict[str, Any] = {"name": name, "resources": resources}
    task["envs"] = {**dict(zip(PLAN_ENVS, plan_envs, strict=True)), **spec.envs}
    if spec.secrets:
        task["secrets"] = dict.fromkeys(spec.secrets)  # values: `fleet up` (harvest.fleet.launch), or --secret
    if spec.install is not None:
        task["setup"] = spec.install
    elif spec.image is None:
        if wheel is None:
            raise ValueError(f"{name}: the fleet carries this checkout: give its wheel (harvest.fleet.carry)")
        task["file_mounts"] = {carry.remote_path(wheel): str(wheel.absolute())}
        task["setup"] = carry.setup_command(wheel, carry.extras(spec, kind))
    elif kind == "tpu":
        task["setup"] = f"docker pull {shlex.quote(spec.image)}"
    task["run"] = run
    return task


def tasks(plan: Plan, wheel: Path | None = None) -> dict[str, dict[str, Any]]:
    """Every task of the plan by job name: the puzzles build first, when there is one, then the workers."""
    out = {plan.build.job_name: build_task(plan.build, plan.spec, wheel)} if plan.build else {}
    return out | {w.job_name: task_config(w, plan.spec, wheel) for w in plan.workers}


def emit(plan: Plan, directory: str | Path) -> list[Path]:
    """Write one task YAML per job, named after it, beside the checkout's wheel where the fleet carries it."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    wheel = carry.build_wheel(out) if plan.spec.carries_checkout else None
    paths = []
    for name, task in tasks(plan, wheel).items():
        path = out / f"{name}.yaml"
        path.write_text(yaml.dump(task, Dumper=_TaskDumper, sort_keys=False, width=10_000))
        paths.append(path)
    return paths


class _TaskDumper(yaml.SafeDumper):
    """Multi-line strings (a docker command) as literal blocks: the file shows the command as bash reads it."""


_TaskDumper.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def plan_table(plan: Plan) -> Table:
    if plan.training is not None:
        return _training_table(plan)
    features = plan.spec.job == "features"
    table = Table(title=f"fleet {plan.spec.name}: " + (
        f"features of {plan.spec.data}, {len(plan.workers)} ranks (a worker each)" if features else
        f"{len(plan.workers)} workers, {plan.num_streams} streams of {plan.spec.data}"), title_justify="left")
    middle = ("rank",) if features else ("mesh", "streams")
    for name in ("group", "worker", "accelerator", "hosts x chips", *middle, "out"):
        table.add_column(name, justify="right" if name in ("worker", "streams", "rank") else "left")
    for w in plan.workers:
        cells = (f"{w.rank} of {len(plan.workers)}",) if features else \
            (w.group.mesh or "data (all)", format_ranges(w.streams))
        table.add_row(w.group.name, str(w.index), w.topology.accelerator + (" (spot)" if w.group.spot else ""),
                      f"{w.topology.hosts} x {w.topology.chips_per_host}", *cells, w.group.out)
    return table


_TRAINERS = {"decoder": "decoder training", "trm": "TRM training", "sae": "SAE training"}


def _training_table(plan: Plan) -> Table:
    """One row: the training job on its slice, its mesh and batch split; the puzzles build above it."""
    spec, shape, (w,) = plan.spec, plan.training, plan.workers
    table = Table(title=f"fleet {spec.name}: {_TRAINERS[shape.trainer]} on {w.topology.accelerator}, "
                        f"from {spec.data}", title_justify="left")
    for name in ("job", "accelerator", "hosts x chips", "devices", "mesh", "batch", "out"):
        table.add_column(name, justify="right" if name == "devices" else "left")
    if plan.build is not None:
        b = plan.build
        table.add_row(b.job_name, f"cpus {BUILD_CPUS}", "1 (cpu)", "-", "-",
                      f"puzzles build {b.kind}" + (" (done: dataset present)" if b.present else " (once, first)"),
                      b.out)
    table.add_row(w.job_name, w.topology.accelerator + (" (spot)" if w.group.spot else ""),
                  f"{w.topology.hosts} x {w.topology.chips_per_host}", str(w.topology.devices), shape.mesh_text,
                  shape.batch, w.group.out)
    return table
