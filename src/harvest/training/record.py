"""A training run's record (run.json): what made it, typed per kind, and the refusal to continue a run made
with other settings. The JSON is the one runs were always written with: old runs resume."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, ClassVar, Union

import jax

from harvest.errors import UserError
from harvest.storage import Storage
from harvest.version import harvest_version

RUN_JSON = "run.json"

FORMAT_VERSION = 1  # of run.json; records written before it carry none (0) and no run_id


class RunMismatch(UserError):
    pass


class _Details:
    """What a kind adds to run.json, stored as top-level keys before the named fields."""

    kind: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclasses.dataclass(frozen=True)
class DecoderDetails(_Details):
    kind: ClassVar[str] = "train"
    hf_config: dict[str, Any] = dataclasses.field(default_factory=dict)  # the config.json the model came from
    tokenizer: str | None = None
    model_type: str | None = None
    num_params: int = 0


@dataclasses.dataclass(frozen=True)
class SaeDetails(_Details):
    kind: ClassVar[str] = "sae"
    saes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # tensor -> its SAE's spec and norms


@dataclasses.dataclass(frozen=True)
class TrmDetails(_Details):
    kind: ClassVar[str] = "trm"
    steps: int | None = None
    trm: dict[str, Any] = dataclasses.field(default_factory=dict)  # {"model": TrmConfig, "optim": TrmOptim}
    dataset: str | None = None
    num_params: int = 0


Details = Union[DecoderDetails, SaeDetails, TrmDetails]
DETAILS: dict[str, type] = {d.kind: d for d in (DecoderDetails, SaeDetails, TrmDetails)}


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """A training run's run.json: what made it (all settings, those a resumed run must keep, the mesh, the
    attention kernel, the compute dtype) and what its kind adds (`details`: the HF config of a decoder, the SAEs'
    specs, the TRM's model, ...), stored beside the named fields as top-level keys. `run_id` names the run to
    curve loggers (the W&B run a resumed run continues)."""

    kind: str
    config: dict[str, Any]
    run_settings: dict[str, Any]
    mesh: str
    config_sha256: str
    compute_dtype: str | None = None
    kernel: str | None = None
    details: Details | None = None
    harvest_version: str = dataclasses.field(default_factory=harvest_version)
    run_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:16])
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        named = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "details"}
        return {**(self.details.to_json() if self.details else {}), **named}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunRecord:
        names = {f.name for f in dataclasses.fields(cls)} - {"details"}
        named = {k: v for k, v in data.items() if k in names}
        # Before format 1: no run_id, no version, the decoder's kernel under "attention".
        return cls(**{"run_id": "", "format_version": 0, "kernel": data.get("attention"), **named},
                   details=DETAILS[data["kind"]].from_json(data))


def read_run(out: Storage, kind: str | None = None, what: str = "a harvest training run") -> RunRecord | None:
    """The run's record, None where there is none yet; with `kind`, a record of another kind is refused in one
    line (`what` names the kind wanted, "a training run")."""
    if not out.exists(RUN_JSON):
        return None
    data = out.read_json(RUN_JSON)
    if not isinstance(data, dict) or "kind" not in data:
        raise RunMismatch(f"{out.url}: its run.json is not {what}'s; use another --out")
    if data["kind"] not in DETAILS or kind is not None and data["kind"] != kind:
        raise RunMismatch(f"{out.url} holds something other than {what} (a run of kind {data['kind']!r}); "
                          "use another --out")
    return RunRecord.from_json(data)


def check_run(out: Storage, record: RunRecord, what: str) -> RunRecord:
    """Refuse to continue a run of another kind, or one made with other run settings, showing the difference;
    returns the record in force: the stored one when the run exists (its run_id kept), else `record`."""
    old = read_run(out, record.kind, what)
    if old is None:
        return record
    before, now = old.run_settings or {}, record.run_settings
    differ = [f"{k}: {before.get(k)!r} -> {now[k]!r}" for k in now if before.get(k) != now[k]]
    if differ:
        raise RunMismatch(f"{out.url} holds {what} made with other settings ({'; '.join(differ)}); use another --out")
    return old


def write_run(out: Storage, record: RunRecord) -> None:
    """Process 0 writes the record once, when the run starts; a resumed run keeps the first."""
    if jax.process_index() == 0 and not out.exists(RUN_JSON):
        out.write_json(RUN_JSON, record.to_json())
