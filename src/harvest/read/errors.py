"""What reading a run can refuse, each a one-line UserError."""

from __future__ import annotations

from harvest.errors import UserError
from harvest.store.listing import CorruptShardError  # raised by the store's reads of committed shards too
from harvest.store.snapshot import StartedOverError  # a stream read was started over (a new generation)

__all__ = ["CorruptShardError", "StartedOverError", "StateError", "UnknownTensorError"]


class UnknownTensorError(UserError, KeyError):
    """A tensor name the run does not hold (a KeyError too, for dict-like callers)."""

    def __str__(self) -> str:
        return str(self.args[0])


class StateError(UserError):
    """A saved reader state, or a snapshot, that does not belong to this run or these settings."""
