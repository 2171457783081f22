"""Orbax checkpoints of a training run under RUN/checkpoints/: the sharded state (params, optimizer
moments, step) written by every process for the shards it holds, plus the data position as JSON. Saves
are asynchronous (training goes on while they land), every `checkpoint_every` steps or when forced
(SIGTERM, the end), keeping the newest `keep`.

Hosts may share no filesystem, so orbax saves into each process's local staging directory and each
process uploads its own files of a step through Storage, then its marker (training/step_parts.py); a
restore downloads the newest complete step, checked as it streams. Why orbax is set up this way:
docs/training.md, Checkpoints and resume.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import secrets
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from harvest.errors import UserError
from harvest.runtime import cache, distributed
from harvest.training import step_parts
from harvest.storage import Storage

CHECKPOINTS = "checkpoints"
log = logging.getLogger(__name__)


class _MirroredSaveNoise(logging.Filter):
    """Orbax warns on every save about what it was asked for (every process primary, no ocdbt), and on every
    read-only open (export, eval) that it is read-only: not news to a user watching the terminal."""

    NOISE = ("Global object size logging disabled for `primary_host=None`", "Skipping merge of OCDBT checkpoints",
             "Given directory is read only", "CheckpointManagerOptions.read_only=True, setting")

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in self.NOISE)


logging.getLogger("absl").addFilter(_MirroredSaveNoise())


class Checkpoints:
    """A run's checkpoints at `url` (a local path or a bucket), written through a staging directory."""

    def __init__(self, url: str, *, every: int, keep: int, read_only: bool = False):
        self._root = Storage(url)
        self.url = self._root.url
        self._keep = keep
        self.attempt = None if read_only else new_attempt()
        self._staging = _staging_dir(self.url, read_only)
        self._copies = step_parts.complete(self._root)  # (step, attempt), newest first
        self._manager = _manager(self._staging, every, read_only)
        self._saved: list[int] = []
        self._upload: threading.Thread | None = None
        self._upload_error: BaseException | None = None

    def steps(self) -> list[int]:
        """The complete steps in storage at the start, and those saved since."""
        return sorted({step for step, _ in self._copies} | set(self._saved))

    def save(self, step: int, state: dict, data: dict[str, Any], *, force: bool = False) -> bool:
        """Start saving (when the interval says so, or `force`); returns whether a save began. The upload of
        the previous save finishes first."""
        self._finish_upload()
        started = self._manager.save(step, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state),
                                                                    data=ocp.args.JsonSave(data)), force=force)
        if started:
            self._saved.append(step)
            self._upload = threading.Thread(target=self._upload_step, args=(step,), name=f"upload-step-{step}",
                                            daemon=True)
            self._upload.start()
        return started

    def restore_latest(self, abstract_state: dict) -> tuple[int, dict, dict[str, Any]] | None:
        """(step, state placed as `abstract_state`'s shardings say, data position) of the newest intact
        checkpoint; None when there is none. A damaged newer one is one warning line; none intact at all
        (but some present) is an error, not a silent start from scratch."""
        self._copies = [(step, attempt) for step, attempt in _process_0s(self._copies)]  # one list for all
        step = self._fetch_intact(self._copies, what="resuming from")
        if step is None:
            return None
        restored = self._manager.restore(step, args=ocp.args.Composite(state=_restore(abstract_state),
                                                                        data=ocp.args.JsonRestore()))
        return step, restored["state"], restored["data"]

    def restore_params(self, step: int) -> dict:
        """Only the params of `step`, onto this process's first device (export and tests; no optimizer state)."""
        if self._fetch_intact([c for c in self._copies if c[0] == step], what="taking") is None:
            raise UserError(f"{self.url}: no checkpoint of step {step}")
        saved = self._manager.item_metadata(step)["state"].tree["params"]
        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        item = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved)}
        restored = self._manager.restore(step, args=ocp.args.Composite(state=_restore(item, partial=True)))
        return restored["state"]["params"]

    def wait(self) -> None:
        """Until the saves started so far have landed (uploaded, markers included)."""
        self._finish_upload()
        self._manager.wait_until_finished()

    def close(self) -> None:
        self.wait()
        self._manager.close()
        shutil.rmtree(self._staging, ignore_errors=True)

    def _fetch_intact(self, copies: list[tuple[int, str]], what: str) -> int | None:
        """Bring the first of `copies` that every process finds intact into staging; its step. Each damaged
        copy before it is a warning line; when all are damaged, the newest one's damage is the error."""
        damaged: list[str] = []
        for step, attempt in copies:
            local = self._staging / str(step)
            shutil.rmtree(local, ignore_errors=True)
            try:
                step_parts.fetch_step(self._root, step, attempt, local)
                mine = None
            except step_parts.CorruptStep as e:
                mine = str(e)
            if distributed.any_true(mine is not None):
                shutil.rmtree(local, ignore_errors=True)
                damaged.append(mine or f"damaged in another process's copy (attempt {attempt})")
                continue
            for (old, _), why in zip(copies, damaged):
                log.warning(f"checkpoint step {old} is damaged, {what} step {step}: {why}")
            self._manager.reload()
            return step
        if damaged:
            steps = ", ".join(str(s) for s in sorted({s for s, _ in copies}))
            raise step_parts.CorruptStep(f"no intact checkpoint among steps {steps}: {damaged[0]}")
        return None

    def _upload_step(self, step: int) -> None:
        try:
            self._manager.wait_until_finished()
            step_parts.upload_part(self._root, step, self.attempt, jax.process_index(), jax.process_count(),
                                   self._staging / str(step))
            if jax.process_index() == 0:
                step_parts.prune(self._root, self._keep)
        except BaseException as e:  # raised in the training thread, at the next save or wait
            self._upload_error = e

    def _finish_upload(self) -> None:
        if self._upload is not None:
            self._upload.join()
            self._upload = None
        if self._upload_error is not None:
            error, self._upload_error = self._upload_error, None
            raise error


def new_attempt() -> str:
    """This start's id, the same on every process: process 0's UTC time (so ids sort by start) and random bits."""
    return _process_0s(f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(4)}")


def _process_0s(value: Any) -> Any:
    """Process 0's `value` (JSON-able) on every process: two small broadcasts, its length and its bytes."""
    if jax.process_count() == 1:
        return value
    from jax.experimental import multihost_utils

    mine = np.frombuffer(json.dumps(value).encode(), np.uint8)
    length = int(multihost_utils.broadcast_one_to_all(np.asarray(len(mine), np.int32)))
    padded = np.zeros(length, np.uint8)
    padded[:min(length, len(mine))] = mine[:length]
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(padded))))


def _manager(directory: Path, every: int, read_only: bool) -> ocp.CheckpointManager:
    """Every process primary and no ocdbt: each process's files are its own (see above). Staging keeps one
    step besides the one being saved: storage holds the `keep` newest. Each process creates its step's
    directories before save returns: orbax's asynchronous creation signals "created" once for all processes,
    so another process's item writes could start before its own directories exist (FileNotFoundError on
    data.orbax-checkpoint-tmp/metadata)."""
    processes = ocp.options.MultiprocessingOptions(primary_host=None)
    options = ocp.CheckpointManagerOptions(save_interval_steps=every, max_to_keep=1, create=not read_only,
                                           enable_async_checkpointing=not read_only, read_only=read_only,
                                           multiprocessing_options=processes,
                                           async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
    state = ocp.PyTreeCheckpointHandler(use_ocdbt=False, multiprocessing_options=processes)
    return ocp.CheckpointManager(str(directory), options=options, item_handlers={
        "state": state, "data": ocp.JsonCheckpointHandler(multiprocessing_options=processes)})


def _staging_dir(url: str, read_only: bool) -> Path:
    """This process's local copy of a run's checkpoints: a training run's is named from the URL and
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
