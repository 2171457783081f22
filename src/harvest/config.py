"""Run configs: dataclasses filled from a YAML file, then from flags (flags win), validated with one-line
errors, with a stable hash over the settings that decide what a run writes."""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import yaml

from harvest.errors import UserError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|TB|KiB|MiB|GiB|TiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class ConfigError(UserError):
    pass


ATTENTION_KINDS = ("auto", "dense", "blocks", "splash", "pallas-gpu")  # harvest.model.attention's implementations
ATTENTION_HELP = ("attention implementation. auto: splash on TPU, pallas-gpu on GPU, {cpu} (and dense where the "
                  "kernel cannot serve the model's sliding window). dense is the reference: it computes every score "
                  "of a [seq, seq] mask, seq^2 memory per head and row. blocks, splash and pallas-gpu are "
                  "flash-style: memory grows with seq, and blocks and splash skip the scores between packed samples. "
                  "splash and pallas-gpu run in Pallas interpret mode (slow) off their own backend")


def setting(help: str, default: Any = dataclasses.MISSING, *, choices: tuple = (), minimum: int | None = None):
    """A config field described once: its flag, its YAML key, its --help line and its checks come from here."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "minimum": minimum})


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def help_line(field: dataclasses.Field) -> str:
    """The field's help with its choices and default, as --help shows it."""
    meta = field.metadata
    extra = [" | ".join(meta["choices"])] if meta.get("choices") else []
    if field.default not in (dataclasses.MISSING, None, False):
        extra.append(f"default: {field.default}")
    return meta["help"] + (f" ({'; '.join(extra)})" if extra else "")


def add_flags(parser: argparse.ArgumentParser, cls: type, prefix: str = "") -> None:
    """One flag per config field, from its description (harvest.config.setting); defaults are None so YAML
    values show through unless a flag is given. `prefix` keeps the fields' names apart from the parser's
    own (e.g. `run`, the handler, and `harvest sae --run`)."""
    parser.add_argument("--config", help="YAML file with any of these settings (flags win)")
    for field in _own_fields_first(cls):
        kind = str(field.type).replace(" | None", "")
        if kind == "bool":
            parser.add_argument(flag(field.name), dest=prefix + field.name, action="store_true", default=None,
                                help=help_line(field))
        else:
            parser.add_argument(flag(field.name), dest=prefix + field.name, type=_FLAG_TYPES.get(kind, str),
                                default=None, metavar=field.name.upper(), help=help_line(field))


def _own_fields_first(cls: type) -> list[dataclasses.Field]:
    """A config's fields, its own before those it inherits (a trainer's settings before the runtime's), so a
    command's --help starts with what it is about."""
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    fields = dataclasses.fields(cls)
    return [f for f in fields if f.name not in inherited] + [f for f in fields if f.name in inherited]


def _json_object(text: str) -> dict:
    """A dict-valued flag: a JSON object inline, or the path of a JSON file holding one (e.g. a config.json)."""
    try:
        value = json.loads(Path(text).read_text() if not text.lstrip().startswith("{") else text)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object or a JSON file ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


_FLAG_TYPES = {"int": int, "float": float, "dict": _json_object}


def str_list(value: str | list | tuple | None) -> list[str]:
    """A list-of-str setting (annotated `list[str]`) from a YAML list or a comma-separated string (a flag)."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else value
    return [str(v).strip() for v in items if str(v).strip()]


class RunSettings:
    """What a run's config dataclass tells the runtime: all its settings (run.json), those a resumed run must keep
    (RUN_FIELDS) and those every process must agree on (all but LOCAL_FIELDS)."""

    RUN_FIELDS: tuple[str, ...] = ()
    LOCAL_FIELDS: tuple[str, ...] = ("process_id",)  # settings of one process only: never compared across processes

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def run_settings(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.RUN_FIELDS}

    def shared_settings(self) -> dict[str, Any]:
        return {k: v for k, v in self.to_dict().items() if k not in self.LOCAL_FIELDS}


def check_settings(config: Any) -> None:
    """The choices and minimums the fields declare, as one-line errors naming the flag."""
    for field in dataclasses.fields(config):
        value, meta = getattr(config, field.name), field.metadata
        if value is None:
            continue
        for item in value if isinstance(value, list) else [value]:
            if meta.get("choices") and item not in meta["choices"]:
                raise ConfigError(f"{flag(field.name)} {item!r}: choose one of {', '.join(meta['choices'])}")
        if meta.get("minimum") is not None and value < meta["minimum"]:
            raise ConfigError(f"{flag(field.name)} {value}: must be at least {meta['minimum']}")


@dataclasses.dataclass(frozen=True)
class ExtractConfig:
    model: str = setting("HF checkpoint directory, hub id (e.g. Qwen/Qwen2.5-0.5B) or GGUF (a .gguf file or "
                         "gs://, s3://, https:// URL, or a directory holding one; dequantized once into "
                         "$HARVEST_CACHE/gguf/)")
    data: str = setting("a streams directory (holding streams.json) or a source: file, glob, gs://, s3://, "
                        "hf://name[:config]:split")
    out: str = setting("output URL: a local directory, gs://bucket/path or s3://bucket/path")
    points: str = setting("capture points, e.g. resid_post:20-27,mlp_out:12,attn_out:0,3,5, or TransformerLens hook "
                          "names among them: blocks.12.hook_resid_post,blocks.3.mlp.hook_post", "resid_post:all")
    format: str = setting("how records become prompts", "text", choices=("text", "chat", "arc"))
    text_field: str = setting("field holding the text for --format text", "text")
    streams: str | None = setting("streams this worker writes, e.g. 0-7 (default: all)", None)
    max_seq_len: int = setting("tokens per packed row, the longest sample", 2048, minimum=2)
    batch_size: int = setting("packed rows per data slot per step", 8, minimum=1)
    long: str = setting("samples longer than --max-seq-len, always counted", "truncate",
                        choices=("truncate", "skip", "chunk"))
    dtype: str = setting("stored dtype; int8 and float8_e4m3fn store 8-bit codes with a float32 scale per token "
                         "(absmax over the hidden dimension), read back as values", "bfloat16",
                         choices=("bfloat16", "float16", "float32", "int8", "float8_e4m3fn"))
    compute_dtype: str | None = setting("compute dtype; unset: float32 on CPU, bfloat16 on accelerators", None,
                                        choices=("float32", "bfloat16"))
    shard_size: str = setting("shard size, e.g. 64KB, 512MB, 1GB", "1GB")
    seed: int = setting("seed for ARC augmentation", 0, minimum=0)
    max_samples: int | None = setting("read at most this many records per stream", None, minimum=1)
    overwrite: bool = setting("delete this worker's streams and run.json first, instead of resuming", False)
    strict: bool = setting("stop at the first bad input instead of skipping and recording it", False)
    mesh: str | None = setting("1d | 2d | 3d | data=..,fsdp=..,model=.. (default: every device on data; on a CPU "
                               "host, one slot whose batches run on the cores in turn)", None)
    attention: str = setting(ATTENTION_HELP.format(cpu="blocks on a one-device CPU, else dense"), "auto",
                             choices=ATTENTION_KINDS)
    arc_encoder: str = setting("ARC grid encoding", "compact", choices=("compact", "rows"))
    arc_augment: int = setting("extra augmented variants per ARC task (dihedral, colours, pair order)", 0,
                               minimum=0)
    arc_include_answer: bool = setting("append the test output to ARC prompts", False)
    arc_template: str | None = setting("ARC prompt template with {examples} and {test_input}", None)
    worker_id: str | None = setting("this worker's name in stream leases; a restart under the same name takes its "
                                    "leases back at once where the old process is provably gone (default: "
                                    "hostname:process index)", None)
    coordinator: str | None = setting("multi-host: HOST:PORT of process 0 (else $JAX_COORDINATOR_ADDRESS or "
                                      "auto-detected)", None)
    num_processes: int | None = setting("multi-host: number of processes (else $JAX_PROCESS_COUNT)", None,
                                        minimum=1)
    process_id: int | None = setting("multi-host: this process's index (else $JAX_PROCESS_INDEX)", None, minimum=0)
    peer_timeout: int = setting("multi-host: seconds before a silent process counts as dead and the others exit",
                                60, minimum=1)
    no_compile_cache: bool = setting("compile on every run instead of keeping compiled programs in $HARVEST_CACHE/jax "
                                     "(default ~/.cache/harvest/jax), where a repeated or resumed run finds them",
                                     False)
    lease_ttl: int = setting("seconds this worker's leases may go without a heartbeat; recorded in each lease, so "
                             "another worker takes one over only after watching it unchanged this long (on its own "
                             "clock); a worker that cannot refresh its lease for half of this stops writing",
                             300, minimum=2)

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
        check_settings(self)
        if not self.text_field:
            raise ConfigError("--text-field: must name a field")
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


def read_yaml(path: str | Path, label: str) -> Any:
    """The parsed YAML file (safe_load: no objects built from tags), or a one-line error naming `label`."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"{label}: no such file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{label}: not valid YAML ({str(e).splitlines()[0]})") from None


def load_yaml(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    loaded = read_yaml(path, f"--config {path}")
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
    settings = {name: coerce(name, value, str(fields[name].type), yaml_path) for name, value in settings.items()}
    return cls(**settings).validate()


_TYPES = {"int": int, "str": str, "bool": bool, "float": float, "dict": dict}


def coerce(name: str, value: Any, annotation: str, source: str | None) -> Any:
    """YAML values must have the field's type (flags already do): a string where an int belongs is an error.
    A `list[str]` takes a YAML list of strings or one comma-separated string (as its flag gives it)."""
    kind = annotation.replace(" | None", "")
    if value is None and "None" in annotation:
        return value
    if kind == "list[str]":
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, (str, int)) for v in value)):
            return str_list(value)
        raise ConfigError(f"{'--config ' + source if source else 'setting'}: {name} must be a list of strings or "
                          f"a comma-separated string, got {value!r}")
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
