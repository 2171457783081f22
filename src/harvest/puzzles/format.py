"""The on-storage format of a puzzle dataset (what `harvest puzzles build` writes and the TRM trainer reads):
train/test.safetensors (tokens and CSR offsets of puzzles and groups), ARC's identifiers.safetensors and
tasks.json, and dataset.json written last as the commit marker: a dataset without it was cut short and is
never read. The arrays, one by one: docs/trm.md."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from harvest.errors import UserError
from harvest.storage import Storage, StorageNotFoundError
from harvest.store.records import Record

FORMAT_VERSION = 1
MARKER = "dataset.json"
SPLITS = ("train", "test")
SPLIT_ARRAYS = ("inputs", "labels", "puzzle_identifiers", "puzzle_indices", "group_indices")
_SPLIT_KEYS = ("examples", "puzzles", "groups")


class DatasetError(UserError):
    """A puzzle dataset that is missing, incomplete, damaged, or already there."""


@dataclasses.dataclass(frozen=True)
class DatasetInfo(Record):
    """`dataset.json`: what the trainer needs to build the model and batches, and how the data was made.

    `tokens`: the meaning of token ids (e.g. {"pad": 0, "blank": 1, "digit 1": 2}); `splits`: per split
    {"examples", "puzzles", "groups"}; `files`: per file {"bytes", "sha256"}; `skipped`: bad inputs by
    reason; `skipped_examples`: the first few, each {"source", "row", "reason"}; `settings`: the build's.
    """

    format_version: int
    kind: str
    seq_len: int
    grid: tuple
    vocab_size: int
    pad_id: int
    ignore_label_id: int | None
    blank_identifier_id: int
    num_puzzle_identifiers: int
    tokens: dict
    splits: dict
    files: dict
    source: str
    settings: dict
    skipped: dict
    skipped_examples: list
    harvest_version: str

    @classmethod
    def from_json(cls, obj: Any) -> DatasetInfo:
        info = super().from_json(obj)
        for name, split in info.splits.items():
            if not isinstance(split, dict) or any(not isinstance(split.get(k), int) for k in _SPLIT_KEYS):
                raise ValueError(f"field 'splits': {name!r} needs integer {', '.join(_SPLIT_KEYS)}")
        for name, entry in info.files.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int) \
                    or not isinstance(entry.get("sha256"), str):
                raise ValueError(f"field 'files': {name!r} needs integer bytes and a sha256 string")
        return info

    def mean_puzzle_examples(self, split: str) -> float:
        s = self.splits[split]
        return s["examples"] / max(1, s["puzzles"])


class SplitBuilder:
    """Collects one split's puzzles group by group into the CSR arrays above."""

    def __init__(self, seq_len: int):
        self.seq_len = seq_len
        self.inputs: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []
        self.extra: dict[str, list[np.ndarray]] = {}
        self.identifiers: list[int] = []
        self.puzzle_indices = [0]
        self.group_indices = [0]

    def add_puzzle(self, inputs: np.ndarray, labels: np.ndarray, identifier: int, **extra: np.ndarray) -> None:
        """One puzzle's examples ([k, seq_len] tokens each) under one identifier; extras are per example."""
        assert inputs.shape == labels.shape and inputs.shape[1:] == (self.seq_len,), (inputs.shape, labels.shape)
        self.inputs.append(inputs.astype(np.uint8))
        self.labels.append(labels.astype(np.uint8))
        for name, value in extra.items():
            self.extra.setdefault(name, []).append(value)
        self.identifiers.append(identifier)
        self.puzzle_indices.append(self.puzzle_indices[-1] + len(inputs))

    def end_group(self) -> None:
        if len(self.identifiers) > self.group_indices[-1]:
            self.group_indices.append(len(self.identifiers))

    def arrays(self) -> dict[str, np.ndarray]:
        empty = np.zeros((0, self.seq_len), np.uint8)
        out = {"inputs": np.concatenate(self.inputs) if self.inputs else empty,
               "labels": np.concatenate(self.labels) if self.labels else empty,
               "puzzle_identifiers": np.array(self.identifiers, np.int32),
               "puzzle_indices": np.array(self.puzzle_indices, np.int32),
               "group_indices": np.array(self.group_indices, np.int32)}
        for name, parts in self.extra.items():
            out[name] = np.concatenate(parts)
        return out

    def counts(self) -> dict[str, int]:
        return {"examples": self.puzzle_indices[-1], "puzzles": len(self.identifiers),
                "groups": len(self.group_indices) - 1}


@dataclasses.dataclass
class Built:
    """A dataset made in memory, ready to be written: what a builder returns."""

    kind: str
    grid: tuple[int, int]
    vocab_size: int
    tokens: dict
    splits: dict[str, SplitBuilder]
    source: str
    ignore_label_id: int | None = 0
    num_puzzle_identifiers: int = 1
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)  # extra files (ARC)


def tensors_bytes(arrays: dict[str, np.ndarray]) -> bytes:
    """safetensors bytes with the tensors in name order and no metadata: equal arrays, equal bytes."""
    return save_tensors({k: np.ascontiguousarray(arrays[k]) for k in sorted(arrays)})


def check_absent(out: str, overwrite: bool) -> Storage:
    """The output Storage; a DatasetError when a complete dataset is there and `overwrite` is off."""
    storage = Storage(out)
    if not overwrite and storage.exists(MARKER):
        raise DatasetError(f"{storage.url}: a complete puzzle dataset is already there ({MARKER}); "
                           "pass --overwrite to replace it")
    return storage


def write_dataset(out: str, built: Built, *, settings: dict, skipped: dict, skipped_examples: list,
                  overwrite: bool) -> DatasetInfo:
    """Write every file, then the marker. With `overwrite`, the old marker goes first, so no reader ever
    pairs it with new arrays; files the old dataset named and this one does not are deleted."""
    from harvest.version import harvest_version

    storage = check_absent(out, overwrite)
    old_files: set[str] = set()
    if overwrite and storage.exists(MARKER):
        try:
            old_files = set(DatasetInfo.from_bytes(storage.read_bytes(MARKER)).files)
        except ValueError:
            old_files = set()
        storage.delete(MARKER)
    payloads = {f"{name}.safetensors": tensors_bytes(split.arrays()) for name, split in built.splits.items()}
    payloads.update(built.files)
    files = {}
    for name in sorted(payloads):
        storage.write_bytes(name, payloads[name])
        files[name] = {"bytes": len(payloads[name]), "sha256": hashlib.sha256(payloads[name]).hexdigest()}
    storage.delete_many(sorted(old_files - set(files)))
    seq_len = built.grid[0] * built.grid[1]
    info = DatasetInfo(
        format_version=FORMAT_VERSION, kind=built.kind, seq_len=seq_len, grid=tuple(built.grid),
        vocab_size=built.vocab_size, pad_id=0, ignore_label_id=built.ignore_label_id, blank_identifier_id=0,
        num_puzzle_identifiers=built.num_puzzle_identifiers, tokens=built.tokens,
        splits={name: split.counts() for name, split in built.splits.items()}, files=files, source=built.source,
        settings=settings, skipped=skipped, skipped_examples=skipped_examples,
        harvest_version=harvest_version())
    if not storage.create_exclusive(MARKER, info.to_bytes()):
        raise DatasetError(f"{storage.url}: another build committed a dataset there while this one ran; "
                           "pass --overwrite to replace it")
    return info


class PuzzleDataset:
    """A committed dataset, opened from its URL: `info` (the marker) and each split's arrays, verified."""

    def __init__(self, url: str):
        self.storage = Storage(url)
        self.url = self.storage.url
        try:
            data = self.storage.read_bytes(MARKER)
        except StorageNotFoundError:
            raise DatasetError(f"{self.url}: no complete puzzle dataset there (no {MARKER}: never built, or a build "
                               "still running or cut short); run `harvest puzzles build` first") from None
        try:
            self.info = DatasetInfo.from_bytes(data)
        except ValueError as e:
            raise DatasetError(f"{self.storage.url_of(MARKER)}: not a puzzle dataset record ({e})") from None
        if self.info.format_version != FORMAT_VERSION:
            raise DatasetError(f"{self.url}: puzzle dataset format {self.info.format_version}; this harvest reads "
                               f"{FORMAT_VERSION}: rebuild it with this version")

    def read_file(self, name: str) -> bytes:
        """A file the marker names, checked against its size and sha256."""
        entry = self.info.files.get(name)
        if entry is None:
            raise DatasetError(f"{self.url}: the dataset has no {name} (it holds {', '.join(sorted(self.info.files))})")
        data = self.storage.read_bytes(name)
        if len(data) != entry["bytes"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise DatasetError(f"{self.storage.url_of(name)}: damaged (size or sha256 differs from {MARKER}); "
                               "rebuild the dataset with --overwrite")
        return data

    def arrays(self, name: str) -> dict[str, np.ndarray]:
        """The tensors of a safetensors file the marker names."""
        return load_tensors(self.read_file(f"{name}.safetensors"))

    def split(self, split: str) -> dict[str, np.ndarray]:
        """A split's arrays (see the module docstring), after checking their shapes agree with the marker."""
        if split not in self.info.splits:
            raise DatasetError(f"{self.url}: no split {split!r} (it has {', '.join(self.info.splits)})")
        arrays = self.arrays(split)
        counts = self.info.splits[split]
        shapes = {"inputs": (counts["examples"], self.info.seq_len), "labels": (counts["examples"], self.info.seq_len),
                  "puzzle_identifiers": (counts["puzzles"],), "puzzle_indices": (counts["puzzles"] + 1,),
                  "group_indices": (counts["groups"] + 1,)}
        for key, shape in shapes.items():
            if key not in arrays or arrays[key].shape != shape:
                got = arrays[key].shape if key in arrays else "missing"
                raise DatasetError(f"{self.url}: {split}.{key} is {got}, {MARKER} says {shape}")
        return arrays


def open_puzzles(url: str) -> PuzzleDataset:
    """Open a built dataset for reading (the trainer and the evaluator start here)."""
    return PuzzleDataset(url)
