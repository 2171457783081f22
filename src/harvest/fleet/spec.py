"""fleet.yaml as typed records: one run (`name`, `data`, `extract` settings, how to install harvest) and
groups of identical workers. Every problem is one line naming the file and the key."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

from harvest.config import read_yaml
from harvest.errors import UserError

_NAME = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?")  # job names and worker ids derive from names
_TOP_KEYS = {"name", "data", "extract", "install", "image", "groups"}
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
    data: str  # a streams directory (streams.json)
    extract: dict[str, Any]  # `harvest extract` settings, as in --config run.yaml
    groups: tuple[Group, ...]
    install: str | None = None  # a setup command, e.g. pip install 'harvest[tpu,gcs]==0.2.0'
    image: str | None = None  # or a docker image holding harvest


def load_fleet(path: str | Path) -> FleetSpec:
    """Read and check fleet.yaml (its shape; the plan checks streams, meshes and settings)."""
    return parse_fleet(read_yaml(path, str(path)), str(path))


def parse_fleet(raw: Any, where: str) -> FleetSpec:
    top = _mapping(raw, where, "the file", _TOP_KEYS)
    name = _name(_required(top, where, "name", str), where, "name")
    data = _required(top, where, "data", str)
    extract = _optional(top, where, "extract", dict, {})
    install, image = _optional(top, where, "install", str), _optional(top, where, "image", str)
    if (install is None) == (image is None):
        raise FleetError(f"{where}: give exactly one of install (a setup command) or image (a docker image)")
    groups_raw = _required(top, where, "groups", list)
    if not groups_raw:
        raise FleetError(f"{where}: groups is empty; declare at least one group of workers")
    groups = tuple(_group(g, where, i) for i, g in enumerate(groups_raw))
    seen: set[str] = set()
    for g in groups:
        if g.name in seen:
            raise FleetError(f"{where}: two groups are named {g.name!r}; group names must be unique")
        seen.add(g.name)
    return FleetSpec(where, name, _url(data), {str(k).replace("-", "_"): v for k, v in extract.items()}, groups,
                     install, image)


def _url(spec: str) -> str:
    """A local path made absolute: every worker's command names the same place whatever its directory."""
    return spec if "://" in spec else os.path.abspath(spec)


def _group(raw: Any, where: str, i: int) -> Group:
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
                 regions=tuple(regions), workers=workers, out=_url(_required(g, where, "out", str, label)),
                 streams=str(streams).strip(), spot=_optional(g, where, "spot", bool, True, label),
                 mesh=mesh, num_nodes=num_nodes)


def _mapping(raw: Any, where: str, what: str, keys: set[str]) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise FleetError(f"{where}: {what} must be a mapping of keys, got {type(raw).__name__}")
    unknown = sorted(str(k) for k in raw if k not in keys)
    if unknown:
        raise FleetError(f"{where}: {what}: unknown key{'s' * (len(unknown) > 1)} {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(keys))})")
    return raw


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
        raise FleetError(f"{where}: {key} {value!r}: use lowercase letters, digits and dashes (at most 40), "
                         f"as job names and worker ids derive from it")
    return value
