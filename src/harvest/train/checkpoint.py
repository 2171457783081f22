"""Orbax checkpoints of a training run under RUN/checkpoints/<step>/: the sharded state (params,
optimizer moments, step) written by every process for the shards it holds, plus the data position
as JSON. Saves are asynchronous (training goes on while they land), every `checkpoint_every` steps or
when forced (SIGTERM, the end), keeping the newest `keep`.

A local run URL is orbax's directory itself. A gs:// or s3:// run (hosts that share no filesystem) is
mirrored: orbax saves into a local staging directory of each process, and once orbax has finished step S
each process uploads, in a background thread, the files it wrote for S as its part of the step, through
harvest.storage.Storage, then its marker (store/step_parts.py: a step exists when every process's marker
does; nobody waits for anybody). At most one upload is in flight: the next save waits for it, and so do
SIGTERM and the end of a run. Process 0 then prunes complete steps beyond `keep`. A restore (a fresh
machine) downloads the newest complete step, every part of it, checked against the markers, into staging
and lets orbax read it there.

What orbax 0.12.8 writes per step when every process is primary and ocdbt is off (as mirrored runs save):
every process: _CHECKPOINT_METADATA, commit_success.txt (here, in state/ and in data/), state/_METADATA,
data/metadata, state/array_metadatas/process_N and the zarr chunk files of its shards; process 0 alone:
state/_sharding and each array's .zarray. Orbax's defaults cannot be mirrored: with ocdbt, process 0
merges every process's ocdbt.process_N into one root manifest and other processes wait for directories
process 0 creates, both of which need a shared filesystem. (Nor is orbax ever given a bucket URL: 0.12.8
turns s3:// into a local path, and its tensorstore ignores the GCS emulator.)
"""

from __future__ import annotations

import hashlib
import logging
import re
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from harvest.runtime import cache
from harvest.store import step_parts
from harvest.storage import Storage

CHECKPOINTS = "checkpoints"


class _MirroredSaveNoise(logging.Filter):
    """Orbax warns on every save of a mirrored run about what it was asked for (every process primary, no
    ocdbt): not news to a user watching the terminal."""

    NOISE = ("Global object size logging disabled for `primary_host=None`", "Skipping merge of OCDBT checkpoints")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.NOISE)


logging.getLogger("absl").addFilter(_MirroredSaveNoise())


class Checkpoints:
    """A run's checkpoints at `url`: orbax's directory (local) or a staging directory mirrored into the bucket."""

    def __init__(self, url: str, *, every: int, keep: int, read_only: bool = False):
        storage = Storage(url)
        self.url = storage.url
        self._keep = keep
        self._remote = None if storage.is_local else storage
        if self._remote is None:
            self._staging = Path(self.url)
            self._complete: list[int] = []
        else:
            self._staging = _staging_dir(self.url, read_only)
            self._complete = step_parts.complete_steps(self._remote)
        self._manager = _manager(self._staging, every, keep, read_only, mirrored=self._remote is not None)
        self._saved: list[int] = []
        self._upload: threading.Thread | None = None
        self._upload_error: BaseException | None = None

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def steps(self) -> list[int]:
        """Local: orbax's steps. Mirrored: the complete steps in storage at the start, and those saved since."""
        if self._remote is None:
            return sorted(self._manager.all_steps())
        return sorted(set(self._complete) | set(self._saved))

    def save(self, step: int, state: dict, data: dict[str, Any], *, force: bool = False) -> bool:
        """Start saving (when the interval says so, or `force`); returns whether a save began. Mirrored: the
        upload of the previous save finishes first."""
        self._finish_upload()
        started = self._manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                                                    data=ocp.args.JsonSave(data)), force=force)
        if started and self._remote is not None:
            self._saved.append(step)
            self._upload = threading.Thread(target=self._upload_step, args=(step,), name=f"upload-step-{step}",
                                            daemon=True)
            self._upload.start()
        return started

    def restore(self, step: int, abstract_state: dict) -> tuple[dict, dict[str, Any]]:
        """(state placed as `abstract_state`'s shardings say, data position) of `step`."""
        self._fetch(step)
        restored = self._manager.restore(step, args=ocp.args.Composite(state=_restore(abstract_state),
                                                                        data=ocp.args.JsonRestore()))
        return restored["state"], restored["data"]

    def restore_params(self, step: int) -> dict:
        """Only the params of `step`, onto this process's first device (export and tests; no optimizer state)."""
        self._fetch(step)
        saved = self._manager.item_metadata(step)["state"].tree["params"]
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        item = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)}
        restored = self._manager.restore(step, args=ocp.args.Composite(state=_restore(item, partial=True)))
        return restored["state"]["params"]

    def wait(self) -> None:
        """Until the saves started so far have landed (mirrored: uploaded, markers included)."""
        self._finish_upload()
        self._manager.wait_until_finished()

    def close(self) -> None:
        self.wait()
        self._manager.close()
        if self._remote is not None:
            shutil.rmtree(self._staging, ignore_errors=True)

    def _fetch(self, step: int) -> None:
        """Mirrored: bring `step` from storage into staging, once."""
        if self._remote is None or (self._staging / str(step)).exists():
            return
        step_parts.fetch_step(self._remote, step, self._staging / str(step))
        self._manager.reload()

    def _upload_step(self, step: int) -> None:
        try:
            self._manager.wait_until_finished()
            step_parts.upload_part(self._remote, step, jax.process_index(), jax.process_count(),
                                   self._staging / str(step))
            if jax.process_index() == 0:
                step_parts.prune(self._remote, self._keep)
        except BaseException as e:  # raised in the training thread, at the next save or wait
            self._upload_error = e

    def _finish_upload(self) -> None:
        if self._upload is not None:
            self._upload.join()
            self._upload = None
        if self._upload_error is not None:
            error, self._upload_error = self._upload_error, None
            raise error


def _manager(directory: Path, every: int, keep: int, read_only: bool, *, mirrored: bool) -> ocp.CheckpointManager:
    """Orbax's defaults for a local run; for a mirrored one, every process primary and no ocdbt (see above)."""
    processes = ocp.options.MultiprocessingOptions(primary_host=None if mirrored else 0)
    options = ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=keep, create=not read_only,
                                           enable_async_checkpointing=not read_only, read_only=read_only,
                                           multiprocessing_options=processes)
    state = ocp.PyTreeCheckpointHandler(use_ocdbt=not mirrored, multiprocessing_options=processes)
    return ocp.CheckpointManager(str(directory), options=options, item_handlers={
        "state": state, "data": ocp.JsonCheckpointHandler(multiprocessing_options=processes)})


def _staging_dir(url: str, read_only: bool) -> Path:
    """This process's local copy of a mirrored run's checkpoints: a training run's is named from the URL and
    the process, and emptied at the start (only storage is trusted); a reader's is a fresh directory."""
    root = cache.root() / "checkpoint-staging"
    root.mkdir(parents=True, exist_ok=True)
    slug = f"{re.sub(r'[^A-Za-z0-9._-]+', '_', url)[-80:]}-{hashlib.sha256(url.encode()).hexdigest()[:8]}"
    if read_only:
        return Path(tempfile.mkdtemp(prefix=f"{slug}-read-", dir=root))
    staging = root / slug / f"process_{jax.process_index():05d}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _restore(item: Any, partial: bool = False) -> ocp.args.PyTreeRestore:
    return ocp.args.PyTreeRestore(item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
                                  partial_restore=partial)


def abstract(tree: Any, shardings: Any) -> Any:
    """ShapeDtypeStructs with shardings: what a restore places the saved arrays into."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
