"""The output format: every name and pattern of a run's files (made and parsed here only), the dtypes a run
may store, and run.json. A shard file's bytes and checksums are encoded in harvest.store.encoding, its stats in
harvest.store.stats; the sidecar, progress, lease and generation records are typed in harvest.store.records.
Every number has one name: streams 5 digits, shards 6, zero-padded, and as many as they need beyond. The
layout of a run and run.json's keys: docs/storage.md."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

from harvest.store import quant

FORMAT_VERSION = 1
DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}  # values as they are
STORED_DTYPES = {**DTYPES, **quant.CODES}  # what a run may store: values, or 8-bit codes with per-token scales


RUN_JSON = "run.json"
PROGRESS = "progress.json"
LEASE = "lease.json"
GENERATION = "generation.json"
STREAM_FILES = {PROGRESS, LEASE, GENERATION}  # in a stream directory besides data objects and sidecars

# Numbers are written zero-padded to 5 (streams) and 6 (shards) digits and wider as they grow (stream 100000,
# shard 1000000): a pattern takes exactly what `stream_dir`/`shard_stem` write, the padded width or more digits
# without a leading zero, so every number has one name and every name one number.
_STREAM_NUMBER = r"(\d{5}|[1-9]\d{5,})"
_SHARD_NUMBER = r"(\d{6}|[1-9]\d{6,})"
_STREAM_DIR = re.compile(rf"^stream_{_STREAM_NUMBER}$")
_SIDECAR = re.compile(rf"^shard_{_SHARD_NUMBER}\.json$")
_DATA_FILE = re.compile(rf"^shard_{_SHARD_NUMBER}(?:-([0-9a-f]{{8,32}}))?\.safetensors$")
_GENERATION = re.compile(r"^[0-9a-f]{16}$")
_GENERATION_DIR = re.compile(r"^gen_([0-9a-f]{16})$")


def stream_dir(stream: int) -> str:
    return f"stream_{stream:05d}"


def dir_stream(name: str) -> int | None:
    """The stream number of a stream directory's name (as `stream_dir` makes them), None for any other name."""
    m = _STREAM_DIR.match(name)
    return int(m.group(1)) if m else None


def shard_stem(shard: int) -> str:
    return f"shard_{shard:06d}"


def sidecar_name(shard: int) -> str:
    return f"{shard_stem(shard)}.json"


def sidecar_shard(name: str) -> int | None:
    """The shard number of a sidecar's name (as `sidecar_name` makes them), None for any other name."""
    m = _SIDECAR.match(name)
    return int(m.group(1)) if m else None


def is_generation(generation: str) -> bool:
    """Whether `generation` names a stream's generation: "" (the stream directory itself: never wiped, or
    written before generations existed) or 16 hex digits (harvest.store.commit.wipe)."""
    return generation == "" or bool(_GENERATION.match(generation))


def shard_dir(stream: int, generation: str = "") -> str:
    """Where a stream's sidecars and data objects of `generation` lie, relative to the run."""
    return f"{stream_dir(stream)}/gen_{generation}" if generation else stream_dir(stream)


def dir_generation(name: str) -> str | None:
    """The generation of a generation directory's name (as `shard_dir` makes them), None for any other name."""
    m = _GENERATION_DIR.match(name)
    return m.group(1) if m else None


def sidecar_path(stream: int, shard: int, generation: str = "") -> str:
    """A shard's sidecar, relative to the run."""
    return f"{shard_dir(stream, generation)}/{sidecar_name(shard)}"


def data_path(stream: int, file: str, generation: str = "") -> str:
    """A data object of a stream (`file` as a sidecar names it), relative to the run."""
    return f"{shard_dir(stream, generation)}/{file}"


def progress_path(stream: int) -> str:
    return f"{stream_dir(stream)}/{PROGRESS}"


def lease_path(stream: int) -> str:
    return f"{stream_dir(stream)}/{LEASE}"


def generation_path(stream: int) -> str:
    return f"{stream_dir(stream)}/{GENERATION}"


def shard_file(shard: int, writer: str) -> str:
    """The data object of `shard` as the writer with id `writer` writes it: no two writers ever write the same
    object (shards of runs before writer ids existed are named without one)."""
    return f"{shard_stem(shard)}-{writer}.safetensors" if writer else f"{shard_stem(shard)}.safetensors"


def data_file_shard(name: str) -> int | None:
    """The shard number of a data object's name (as `shard_file` makes them), None for any other name."""
    m = _DATA_FILE.match(name)
    return int(m.group(1)) if m else None


def tensor_name(point: str, layer: int) -> str:
    return f"{point}.{layer}"


Position = tuple[int, int]  # a piece's place in its stream: (index of its record, variant); the one meaning of Position
