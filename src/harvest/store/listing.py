"""A run's files on storage as status, verify and the reader list them: run.json, stream directories, sidecars.

Only committed shards exist: a shard is there when its sidecar (`shard_NNNNNN.json`) is, whatever else
lies in the stream directory; the sidecar names the data object it commits.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from harvest.errors import UserError
from harvest.storage import Storage
from harvest.store import format as fmt
from harvest.store.records import RunInfo, Sidecar

STREAM_DIR = re.compile(r"^stream_(\d{5})$")
SIDECAR = re.compile(r"^shard_(\d{6})\.json$")
SHARD_ARRAYS = ("tokens", "offsets", "sample_ids", "variants")  # the non-activation tensors of a shard
_IO_THREADS = 16


def dtype_name(arr: np.ndarray) -> str:
    """The run.json name of an array's dtype ("bfloat16", "int8", ...), else numpy's name."""
    for name, dtype in fmt.STORED_DTYPES.items():
        if arr.dtype == np.dtype(dtype):
            return name
    return arr.dtype.name


def covered_streams(info: RunInfo) -> list[int]:
    """The streams a run covers, from run.json's data section (`streams` if listed, else all num_streams)."""
    data = info.data
    if data.get("streams") is not None:
        return sorted(int(s) for s in data["streams"])
    return list(range(int(data.get("num_streams") or 1)))


def stream_count(info: RunInfo, stream: int) -> int | None:
    """Records in a stream per run.json (None when the source's length is unknown)."""
    counts = info.data.get("counts")
    if counts is None:
        return None
    if isinstance(counts, dict):
        value = counts.get(str(stream), counts.get(stream))
        return None if value is None else int(value)
    return int(counts[stream]) if stream < len(counts) else None


def list_sidecars(storage: Storage, stream: int) -> list[str]:
    """Sidecar file names of a stream, in shard order."""
    return [n for n in storage.listdir(fmt.stream_dir(stream)) if SIDECAR.match(n)]


def list_stream_dirs(storage: Storage) -> list[int]:
    return sorted(int(m.group(1)) for m in map(STREAM_DIR.match, storage.listdir("")) if m)


def read_run_info(storage: Storage) -> RunInfo:
    if not storage.exists("run.json"):
        raise UserError(f"{storage.url}: no run.json here, so not a harvest run; check the URL "
                        f"(a run writes run.json before its first shard)")
    try:
        info = RunInfo.from_bytes(storage.read_bytes("run.json"))
    except UserError as e:  # StorageError names the file already
        raise UserError(f"{e}; the run's metadata is damaged") from None
    except ValueError as e:
        raise UserError(f"{storage.url}/run.json: not a harvest run.json ({e})") from None
    if info.format_version > fmt.FORMAT_VERSION:
        raise UserError(f"{storage.url}/run.json: format_version {info.format_version} is newer than this "
                        f"harvest reads ({fmt.FORMAT_VERSION}); upgrade harvest")
    return info


def read_sidecars(storage: Storage) -> list[Sidecar]:
    """Every committed shard's sidecar, read in parallel; one line naming the file for one that is damaged."""
    paths = [f"{fmt.stream_dir(s)}/{name}" for s in list_stream_dirs(storage) for name in list_sidecars(storage, s)]

    def read(rel: str) -> Sidecar:
        try:
            return Sidecar.from_bytes(storage.read_bytes(rel))
        except UserError as e:  # StorageError names the file already
            raise UserError(f"{e}; run `harvest verify {storage.url}`") from None
        except ValueError as e:
            raise UserError(f"{storage.url}/{rel}: not a shard sidecar ({e}); "
                            f"run `harvest verify {storage.url}`") from None

    if len(paths) <= 1:
        return [read(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(_IO_THREADS, len(paths))) as pool:
        return list(pool.map(read, paths))
