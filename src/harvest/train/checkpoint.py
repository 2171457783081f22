"""Orbax checkpoints of a training run under RUN/checkpoints/<step>/: the sharded state (params,
optimizer moments, step) written by every process for the shards it holds, plus the data position
as JSON. Saves are asynchronous (training goes on while they land), every `checkpoint_every` steps or
when forced (SIGTERM, the end), keeping the newest `keep`.

Known gap: orbax 0.12.8 turns `s3://...` into a local path, and tensorstore ignores the GCS emulator, so
on this machine checkpoints are tested on a local path only; a pod without a shared filesystem needs
them in object storage (next step: save locally and mirror through harvest.store.fs.Storage)."""

from __future__ import annotations

from typing import Any

import jax
import orbax.checkpoint as ocp

CHECKPOINTS = "checkpoints"


class Checkpoints:
    def __init__(self, url: str, *, every: int, keep: int, read_only: bool = False):
        options = ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=keep, create=not read_only,
                                               enable_async_checkpointing=not read_only, read_only=read_only)
        self.url = url
        self._manager = ocp.CheckpointManager(url, options=options, item_handlers={
            "state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler()})

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, state: dict, data: dict[str, Any], *, force: bool = False) -> bool:
        """Start saving (when the interval says so, or `force`); returns whether a save began."""
        return self._manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                                                 data=ocp.args.JsonSave(data)), force=force)

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict[str, Any]]:
        """(state placed as `abstract_state`'s shardings say, data position) of `step`."""
        restored = self._manager.restore(step, args=ocp.args.Composite(state=_restore(abstract_state),
                                                                        data=ocp.args.JsonRestore()))
        return restored["state"], restored["data"]

    def restore_params(self, step: int) -> dict:
        """Only the params of `step`, onto this process's first device (export and tests; no optimizer state)."""
        saved = self._manager.item_metadata(step)["state"].tree["params"]
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        item = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)}
        restored = self._manager.restore(step, args=ocp.args.Composite(state=_restore(item, partial=True)))
        return restored["state"]["params"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.close()


def _restore(item: Any, partial: bool = False) -> ocp.args.PyTreeRestore:
    return ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                  partial_restore=partial)


def abstract(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs with shardings: what a restore places the saved arrays into."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
