"""Run configs: dataclasses filled from a YAML file, then from flags (flags win), validated with one-line
errors, with a stable hash over the settings that decide what a run writes."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import yaml

from harvest.errors import UserError

FORMATS = ("text", "chat", "arc")
LONG_POLICIES = ("truncate", "skip", "chunk")
STORE_DTYPES = ("bfloat16", "float16", "float32")
COMPUTE_DTYPES = ("float32", "bfloat16")
ARC_ENCODERS = ("compact", "rows")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConfigError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class ExtractConfig:
    model: str
    data: str
    out: str
    points: str = "resid_post:all"
    format: str = "text"
    text_field: str = "text"
    streams: str | None = None  # e.g. "0-7,9"; None = every stream
    max_seq_len: int = 2048
    batch_size: int = 8  # packed rows per data slot
    long: str = "truncate"
    dtype: str = "bfloat16"
    compute_dtype: str | None = None  # None: float32 on CPU, bfloat16 on accelerators
    shard_size: str = "1GB"
    seed: int = 0
    max_samples: int | None = None  # per stream: records read
    overwrite: bool = False
    strict: bool = False
    mesh: str | None = None  # None: every device on the data axis
    arc_encoder: str = "compact"
    arc_augment: int = 0
    arc_include_answer: bool = False
    arc_template: str | None = None
    worker_id: str | None = None
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    peer_timeout: int = 60  # seconds before a silent process counts as dead and the others stop

    # Settings that decide the bytes written: a resumed run must agree on all of them.
    OUTPUT_FIELDS = ("points", "format", "text_field", "max_seq_len", "long", "dtype", "shard_size", "seed",
                     "max_samples", "arc_encoder", "arc_augment", "arc_include_answer", "arc_template")

    @property
    def shard_bytes(self) -> int:
        return parse_size(self.shard_size, "--shard-size")

    def output_settings(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.OUTPUT_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> ExtractConfig:
        for name, value, allowed in (("--format", self.format, FORMATS), ("--long", self.long, LONG_POLICIES),
                                     ("--dtype", self.dtype, STORE_DTYPES),
                                     ("--arc-encoder", self.arc_encoder, ARC_ENCODERS)):
            if value not in allowed:
                raise ConfigError(f"{name} {value!r}: choose one of {', '.join(allowed)}")
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ConfigError(f"--compute-dtype {self.compute_dtype!r}: choose one of {', '.join(COMPUTE_DTYPES)}")
        for name, value, low in (("--max-seq-len", self.max_seq_len, 2), ("--batch-size", self.batch_size, 1),
                                 ("--arc-augment", self.arc_augment, 0)):
            if value < low:
                raise ConfigError(f"{name} {value}: must be at least {low}")
        if self.max_samples is not None and self.max_samples < 1:
            raise ConfigError(f"--max-samples {self.max_samples}: must be at least 1")
        self.shard_bytes  # noqa: B018  (raises on a bad size)
        return self


def parse_size(text: str | int, flag: str) -> int:
    """'64KB' -> 64000, '1GiB' -> 2**30; decimal units are powers of 1000, binary ones of 1024."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ConfigError(f"{flag} {text!r}: expected a size like 64KB, 512MB, 1GB")
    size = int(float(match.group(1)) * _UNITS[(match.group(2) or "b").lower()])
    if size < 1:
        raise ConfigError(f"{flag} {text!r}: must be positive")
    return size


def parse_ranges(text: str, flag: str) -> list[int]:
    """'0-7,9' -> [0..7, 9] (sorted, unique)."""
    chosen: set[int] = set()
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
        if not match:
            raise ConfigError(f"{flag} {text!r}: expected numbers and ranges like 0-7,9")
        lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
        if hi < lo:
            raise ConfigError(f"{flag} {text!r}: range {item.strip()} runs backwards")
        chosen.update(range(lo, hi + 1))
    return sorted(chosen)


def format_ranges(values, sep: str = ",", limit: int | None = None) -> str:
    """The inverse of parse_ranges: [0, 1, 2, 5, 7, 8] -> '0-2,5,7-8' (at most `limit` runs, then a count)."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    shown = runs if limit is None else runs[:limit]
    text = sep.join(str(a) if a == b else f"{a}-{b}" for a, b in shown)
    return text + (f"{sep}... ({len(runs) - len(shown)} more ranges)" if len(shown) < len(runs) else "")


def load_yaml(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    try:
        loaded = yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"--config {path}: expected a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in loaded.items()}


def build(cls: type, yaml_path: str | None, flags: dict[str, Any]):
    """cls from YAML settings overridden by the flags the user gave (None = not given)."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    settings = load_yaml(yaml_path)
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise ConfigError(f"--config {yaml_path}: unknown settings {', '.join(unknown)}")
    settings.update({k: v for k, v in flags.items() if v is not None and k in fields})
    missing = [f"--{name.replace('_', '-')}" for name, f in fields.items()
               if f.default is dataclasses.MISSING and name not in settings]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)} (as a flag or in --config)")
    settings = {name: _coerce(name, value, str(fields[name].type), yaml_path) for name, value in settings.items()}
    return cls(**settings).validate()


_TYPES = {"int": int, "str": str, "bool": bool, "float": float, "dict": dict}


def _coerce(name: str, value: Any, annotation: str, source: str | None) -> Any:
    """YAML values must have the field's type (flags already do): a string where an int belongs is an error."""
    kind = annotation.replace(" | None", "")
    if value is None and "None" in annotation:
        return value
    if kind == "str" and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # e.g. `streams: 3` or `shard_size: 1000000`
    if kind == "float" and not isinstance(value, bool) and isinstance(value, (int, str)):
        try:  # `grad_clip: 1`, and `lr: 3e-4`, which YAML 1.1 reads as a string (no dot)
            return float(value)
        except ValueError:
            pass
    if not isinstance(value, _TYPES[kind]) or (kind == "int" and isinstance(value, bool)):
        raise ConfigError(f"{'--config ' + source if source else 'setting'}: {name} must be {kind}, got {value!r}")
    return value


def stable_hash(obj: Any) -> str:
    """sha256 of canonical JSON: the same settings hash the same on every host and Python version."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
