"""Where a token reader stands: the settings its order depends on, and a cursor in that order. A saved
state (harvest.read.batches.TokenBatches.state_dict) applies only to the same run under the same Order."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from harvest.store.records import RunInfo

STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class Order:
    """Everything the token order depends on: a saved cursor applies only under the same Order."""

    seed: int
    shuffle: bool
    buffer: int  # pieces mixed per group
    piece_tokens: int
    rank: int
    world: int
    worker: int
    workers: int
    exclude: tuple[int, ...]  # token ids left out
    streams: tuple[int, ...] | None
    skip_first: int = 0  # each sample's first tokens left out (attention sinks)
    follow: bool = False  # the first epoch read in rounds while the run grows
    max_norm: tuple[tuple[str, float], ...] = ()  # (tensor, L2 norm): tokens above it at any tensor left out

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["exclude"] = list(self.exclude)
        out["streams"] = None if self.streams is None else list(self.streams)
        out["max_norm"] = [[name, limit] for name, limit in self.max_norm]
        return out

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Order:
        return cls(**{**obj, "exclude": tuple(obj["exclude"]),
                      "streams": None if obj["streams"] is None else tuple(obj["streams"]),
                      "max_norm": tuple((str(n), float(v)) for n, v in obj.get("max_norm", ()))})


@dataclasses.dataclass(frozen=True)
class Cursor:
    """The next row to serve: row `row` (in permuted order) of group `group` of epoch `epoch`."""

    epoch: int
    group: int
    row: int


def run_fingerprint(info: RunInfo) -> str:
    return hashlib.sha256(info.to_bytes()).hexdigest()[:16]
