"""What reading a run can refuse, each a one-line UserError."""

from __future__ import annotations

from harvest.errors import UserError


class UnknownTensorError(UserError, KeyError):
    """A tensor name the run does not hold (a KeyError too, for dict-like callers)."""

    def __str__(self) -> str:
        return str(self.args[0])


class CorruptShardError(UserError):
    """A committed shard whose bytes do not match its sidecar."""


class StateError(UserError):
    """A saved reader state, or a snapshot, that does not belong to this run or these settings."""
