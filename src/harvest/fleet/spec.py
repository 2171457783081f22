"""fleet.yaml as typed records: one run (`name`, `data`, one job's settings, how harvest gets onto the workers,
the workers' environment) and groups of identical workers. Every problem is one line naming the file and the key.

The job is one of JOBS: `extract:` (`harvest extract` settings; many workers, streams dealt between them),
`train:` (`harvest train` settings: a decoder or a TRM) or `sae:` (`harvest sae train` settings), the
last two on one pod slice or multi-node GPU group, or `features:` (`harvest sae features` settings; many
one-host workers, each a rank of the pass). `data` is what the job reads: the streams for extraction, the
training data (a puzzle dataset for a TRM), the extraction run(s) for SAEs, the SAE run for features. A TRM fleet
may add `puzzles:` (`harvest puzzles build` settings and the `kind`): the dataset at `data` is then built
once, by one job, before the trainers start.

The workers are cloud VMs: they see object storage and the hub, not the planning machine's files. So `data`
and each group's `out` must be gs:// or s3:// URLs and `model` a hub id, unless `shared_paths: true` says
every worker sees the same paths (one machine, or a filesystem every VM mounts at the same place)."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from pathlib import Path
from typing import Any

from harvest.config import read_yaml
from harvest.errors import UserError
from harvest.training import kinds
from harvest.version import DISTRIBUTION

# Job names join names with dots (harvest.fleet.plan.Worker.job_name): a name holds none, so no two
# (fleet, group) pairs give one job name; a leading letter and single dashes keep it a SkyPilot task name.
_NAME = re.compile(r"(?=.{1,40}$)[a-z][a-z0-9]*(?:-[a-z0-9]+)*")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
PLAN_ENVS = ("HARVEST_FLEET", "HARVEST_GROUP", "HARVEST_WORKER_ID")  # set by the plan on every worker
_REMOTE = ("gs://", "s3://")
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # as harvest.model.weights.resolve_checkpoint reads --model
JOBS = ("extract", "train", "sae", "features")  # the sections naming the fleet's job; exactly one is given
_TOP_KEYS = {"name", "data", *JOBS, "puzzles", "install", "image", "groups", "envs", "secrets", "shared_paths"}
_GROUP_KEYS = {"name", "accelerator", "regions", "workers", "spot", "streams", "out", "mesh", "num_nodes"}


class FleetError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class Group:
    name: str
    accelerator: str  # SkyPilot's name, e.g. tpu-v5litepod-8 or H100:8
    regions: tuple[str, ...]  # a recovered worker may come back in any of them
    workers: int
    out: str  # the group's output URL, shared by its workers
    streams: str = "auto"  # "0-7,9" or "auto" (in proportion to chips)
    spot: bool = True
    mesh: str | None = None  # as `harvest extract --mesh`
    num_nodes: int = 1  # GPU nodes per worker (a TPU slice is one node, however many hosts)


@dataclasses.dataclass(frozen=True)
class FleetSpec:
    path: str  # where it was read from, for messages
    name: str
    data: str  # what the job reads: a streams directory, a training source or puzzle dataset, SAE input runs
    job: str  # one of JOBS
    settings: dict[str, Any]  # the job's settings (`harvest extract`, `train` or `sae train`), as in --config
    groups: tuple[Group, ...]
    puzzles: dict[str, Any] | None = None  # `harvest puzzles build` settings and `kind`, built once into data
    install: str | None = None  # a setup command installing harvest-activations from the user's own index
    image: str | None = None  # or a docker image holding harvest; with neither, tasks carry this checkout
    envs: dict[str, str] = dataclasses.field(default_factory=dict)  # set on every worker (in the task YAML)
    secrets: tuple[str, ...] = ()  # names whose values `fleet up` takes from its own env (never in a file)
    shared_paths: bool = False  # every worker sees this machine's paths: local data/out/model allowed

    @property
    def carries_checkout(self) -> bool:
        """Neither install nor image: each task carries a wheel of this checkout (harvest.fleet.carry)."""
        return self.install is None and self.image is None


def load_fleet(path: str | Path) -> FleetSpec:
    """Read and check fleet.yaml (its shape; the plan checks streams, meshes and settings)."""
    return parse_fleet(read_yaml(path, str(path)), str(path))


def parse_fleet(raw: Any, where: str) -> FleetSpec:
    top = _mapping(raw, where, "the file", _TOP_KEYS)
    name = _name(_required(top, where, "name", str), where, "name")
    data = _required(top, where, "data", str)
    given = [job for job in JOBS if top.get(job) is not None]
    if len(given) != 1:
        raise FleetError(f"{where}: give exactly one job section, {', '.join(JOBS)} (its settings), "
                         f"got {', '.join(given) or 'none'}")
    job = given[0]
    settings = {str(k).replace("-", "_"): v for k, v in _required(top, where, job, dict).items()}
    puzzles = _optional(top, where, "puzzles", dict, None)
    if puzzles is not None and job != "train":
        raise FleetError(f"{where}: puzzles: builds a TRM's dataset; it goes with a train: job, not {job}:")
    install, image = _optional(top, where, "install", str), _optional(top, where, "image", str)
    if install is not None and image is not None:
        raise FleetError(f"{where}: give at most one of install (a setup command) or image (a docker image); "
                         f"with neither, each task carries this checkout and installs it")
    if install is not None:
        check_install(install, where)
    groups_raw = _required(top, where, "groups", list)
    if not groups_raw:
        raise FleetError(f"{where}: groups is empty; declare at least one group of workers")
    shared = _optional(top, where, "shared_paths", bool, False)
    groups = tuple(_group(g, where, i, shared) for i, g in enumerate(groups_raw))
    seen: set[str] = set()
    for g in groups:
        if g.name in seen:
            raise FleetError(f"{where}: two groups are named {g.name!r}; group names must be unique")
        seen.add(g.name)
    envs, secrets = _envs(top, where)
    for key in ("model", "tokenizer"):
        if isinstance(settings.get(key), str) and not settings[key].lstrip().startswith("{"):
            settings[key] = _model(settings[key], where, shared, f"{job}: {key}")
    if job == "features" and isinstance(settings.get("run"), str):  # the run read, where not the SAE's own
        settings["run"] = _urls(settings["run"], where, f"{job}: run", shared)
    data = _urls(data, where, "data", shared) if job == "sae" else _url(data, where, "data", shared)
    return FleetSpec(where, name, data, job, settings, groups, puzzles, install, image, envs, secrets, shared)


_PIP_INSTALL = re.compile(r"(?:^|[\s;&|(])(?:uv\s+)?(?:pip3?|python3?\s+-m\s+pip)\s+install\s+([^;&|]*)")
_REQUIREMENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(?=$|[\[=<>!~;@\s])")


def check_install(install: str, where: str) -> None:
    """Refuse, in one line, an install command that would take the package index's `harvest`."""
    for args in _PIP_INSTALL.findall(install):
        try:
            words = shlex.split(args)
        except ValueError:
            words = args.split()
        for word in words:
            name = _REQUIREMENT.match(word)
            if name and re.sub(r"[-_.]+", "-", name.group(0).lower()) == "harvest":
                raise FleetError(f"{where}: install: {word!r} is the package index's harvest, an unrelated "
                                 f"project; this one is {DISTRIBUTION} (e.g. pip install "
                                 f"'{DISTRIBUTION}[tpu,gcs]' from an index that holds it), or remove install "
                                 f"(and image) and each task carries this checkout")


def _urls(specs: str, where: str, key: str, shared: bool) -> str:
    """Comma-separated URLs (the buckets of one run), each as _url takes it."""
    return ",".join(_url(spec.strip(), where, key, shared) for spec in specs.split(","))


def _url(spec: str, where: str, key: str, shared: bool) -> str:
    """gs:// or s3://; a local path only when the workers share this machine's paths, made absolute so that
    every worker's command names the same place whatever its directory."""
    if spec.startswith(_REMOTE):
        return spec
    if not shared:
        raise FleetError(f"{where}: {key} {spec!r} is not in object storage, and the fleet's workers (cloud VMs) "
                         f"cannot see this machine's files: give a gs:// or s3:// URL, or set shared_paths: true "
                         f"if every worker sees this path")
    return spec if "://" in spec else os.path.abspath(spec)


_GGUF_URL = re.compile(r"(gs|s3|https?)://\S+\.gguf", re.IGNORECASE)


def _model(model: str, where: str, shared: bool, key: str) -> str:
    """A hub id every worker downloads, a .gguf URL every worker reads (gs://, s3://, http(s)://), or a TRM
    preset's name; a local path (made absolute) only with shared paths."""
    if _GGUF_URL.fullmatch(model):
        return model
    local = Path(model).expanduser()
    if local.exists():
        if shared:
            return str(local.absolute())
        raise FleetError(f"{where}: {key} {model!r} is a path on this machine, which the fleet's workers "
                         f"(cloud VMs) cannot see: give a hub id such as Qwen/Qwen2.5-0.5B, or set shared_paths: "
                         f"true if every worker sees this path")
    if model in kinds.trm_presets():
        return model
    if not shared and not (_HUB_ID.fullmatch(model) and model.split("/")[0] not in (".", "..")):
        raise FleetError(f"{where}: {key} {model!r} is not a hub id (owner/name), and the fleet's workers "
                         f"(cloud VMs) see no path of this machine: give a hub id such as Qwen/Qwen2.5-0.5B, or "
                         f"set shared_paths: true if every worker sees this path")
    return model


def _envs(top: dict, where: str) -> tuple[dict[str, str], tuple[str, ...]]:
    """`envs` (NAME: value, written into every task) and `secrets` (NAMEs, values from `fleet up`'s env)."""
    envs = _optional(top, where, "envs", dict, {})
    secrets = _optional(top, where, "secrets", list, [])
    for key, names in (("envs", list(envs)), ("secrets", secrets)):
        for env in names:
            if not isinstance(env, str) or not _ENV_NAME.fullmatch(env):
                raise FleetError(f"{where}: {key}: {env!r} is not an environment variable name")
            if env in PLAN_ENVS:
                raise FleetError(f"{where}: {key}: {env} is set by the plan on every worker; remove it")
    for env, value in envs.items():
        if value is None or isinstance(value, (dict, list)):
            raise FleetError(f"{where}: envs: {env} needs a value; list a secret's name under secrets instead "
                             f"(`fleet up` takes its value from its own environment)")
    twice = sorted(set(envs) & set(secrets) | {env for env in secrets if secrets.count(env) > 1})
    if twice:
        raise FleetError(f"{where}: secrets: {', '.join(twice)} given twice (in envs or secrets); name each once")
    return {k: _env_value(v) for k, v in envs.items()}, tuple(secrets)


def _env_value(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _group(raw: Any, where: str, i: int, shared: bool) -> Group:
    label = f"groups[{i}]"
    g = _mapping(raw, where, label, _GROUP_KEYS)
    name = _name(_required(g, where, "name", str, label), where, f"{label}.name")
    label = f"group {name}"
    regions = _required(g, where, "regions", list, label)
    if not regions or not all(isinstance(r, str) and r for r in regions):
        raise FleetError(f"{where}: {label}: regions must be a non-empty list of region names, got {regions!r}")
    streams = _optional(g, where, "streams", (str, int), "auto", label)
    workers = _required(g, where, "workers", int, label)
    num_nodes = _optional(g, where, "num_nodes", int, 1, label)
    for key, value in (("workers", workers), ("num_nodes", num_nodes)):
        if value < 1:
            raise FleetError(f"{where}: {label}: {key} must be at least 1, got {value}")
    mesh = _optional(g, where, "mesh", str, None, label)
    return Group(name=name, accelerator=str(_required(g, where, "accelerator", (str,), label)),
                 regions=tuple(regions), workers=workers,
                 out=_url(_required(g, where, "out", str, label), where, f"{label}: out", shared),
                 streams=str(streams).strip(), spot=_optional(g, where, "spot", bool, True, label),
                 mesh=mesh, num_nodes=num_nodes)


def _mapping(raw: Any, where: str, what: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise FleetError(f"{where}: {what} must be a mapping of keys, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in keys)
    split = _split_value(raw, keys)
    if split:
        key, strays = split
        raise FleetError(f"{where}: {what}: unknown key{'s' * (len(strays) > 1)} {', '.join(strays)}: a value with "
                         f"commas inside {{...}} needs quotes: {key}: \"{','.join([str(raw[key]), *strays])}\"")
    if unknown:
        raise FleetError(f"{where}: {what}: unknown key{'s' * (len(unknown) > 1)} {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(keys))})")
    return raw


def _split_value(raw: dict, keys: set[str]) -> tuple[str, list[str]] | None:
    """A flow mapping's unquoted value split at its commas (`{mesh: data=16,model=4}` reads as mesh: data=16
    and a key model=4 with no value): the known key and the keys its value's rest became, or None."""
    items = list(raw.items())
    for i in range(1, len(items)):
        key, value = items[i]
        if key in keys or value is not None or items[i - 1][0] not in keys:
            continue
        strays = []
        for key, value in items[i:]:
            if key in keys or value is not None:
                break
            strays.append(str(key))
        return items[i - 1][0], strays
    return None


def _typed(value: Any, kind, where: str, key: str, label: str | None) -> Any:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = " or ".join({"str": "a string", "int": "an integer", "bool": "true/false", "list": "a list",
                             "dict": "a mapping"}[k.__name__] for k in kinds)
        raise FleetError(f"{where}: {label + ': ' if label else ''}{key} must be {names}, got {value!r}")
    return value


def _required(raw: dict, where: str, key: str, kind, label: str | None = None) -> Any:
    if raw.get(key) is None:
        raise FleetError(f"{where}: {label + ': ' if label else ''}missing {key}")
    return _typed(raw[key], kind, where, key, label)


def _optional(raw: dict, where: str, key: str, kind, default: Any = None, label: str | None = None) -> Any:
    return default if raw.get(key) is None else _typed(raw[key], kind, where, key, label)


def _name(value: str, where: str, key: str) -> str:
    if not _NAME.fullmatch(value):
        raise FleetError(f"{where}: {key} {value!r}: use lowercase letters, digits and single dashes, starting "
                         f"with a letter (at most 40), as job names and worker ids derive from it")
    return value
