"""Local disk (or any mounted filesystem): atomic writes by temp file, fsync and rename; conditional
creates by link(2), or where a filesystem has no hard links (some FUSE/SMB mounts) by rename-if-absent
(Linux renameat2 RENAME_NOREPLACE), else by a rename under the directory flock; compare-and-swap under that
flock. Every write completes its temp file first: no name is ever seen with partial content, and a write
that fails (ENOSPC, a kill) leaves at most a hidden temp file, removed at once or by the next holder."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import hashlib
import os
import shutil
import uuid
from typing import Any

from harvest.clock import Clock
from harvest.storage.backend import Backend, Buffer, Upload, Versioned
from harvest.storage.errors import BlockedPath, PreconditionFailed

TMP_MARK = ".harvest-tmp-"  # local temp files carry this; listdir hides them


class LocalBackend(Backend):
    """Files under a local directory. `clock` times the wait for the directory lock of `replace`."""

    lock_wait_s = 5.0  # the holder's critical section is a read and a rename: longer means it is stopped

    def __init__(self, clock: Clock):
        self.clock = clock

    def read(self, path: str) -> bytes:
        with _open_to_read(path) as f:
            return f.read()

    def read_range(self, path: str, start: int, end: int) -> bytes:
        with _open_to_read(path) as f:
            f.seek(start)
            return f.read(end - start)

    def read_versioned(self, path: str) -> Versioned:
        data = self.read(path)
        return Versioned(data, hashlib.sha256(data).hexdigest())

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def listdir(self, path: str) -> list[str]:
        try:
            return [n for n in os.listdir(path) if TMP_MARK not in n]
        except (FileNotFoundError, NotADirectoryError):
            return []

    def find(self, path: str) -> list[str]:
        if not os.path.isdir(path):
            return [path] if os.path.lexists(path) else []
        return [os.path.join(d, n) for d, _, names in os.walk(path) for n in names]

    def open_read(self, path: str, pos: int) -> Any:
        f = open(path, "rb")  # noqa: SIM115 - the caller closes it
        if pos:
            f.seek(pos)
        return f

    def write(self, path: str, parts: list[Buffer]) -> None:
        d = os.path.dirname(path)
        _makedirs(d)
        tmp = _tmp_name(path)
        try:
            _write_synced(tmp, parts)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        _fsync_dir(d)

    def open_write(self, path: str) -> Upload:
        _makedirs(os.path.dirname(path))
        return _LocalUpload(path)

    def create(self, path: str, data: bytes) -> None:
        d = os.path.dirname(path)
        _makedirs(d)
        if os.path.lexists(path):
            raise PreconditionFailed(path)
        tmp = _tmp_name(path)
        try:
            _write_synced(tmp, [data])  # complete and synced before its final name exists
            if not _link_if_absent(tmp, path) and not _rename_if_absent(tmp, path):
                self._rename_under_lock(tmp, path)
        except FileNotFoundError:
            if os.path.lexists(path):  # our temp was cleared as stale: `path` exists (remove_stale_temps's `of`)
                raise PreconditionFailed(path) from None
            raise
        finally:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        _fsync_dir(d)

    def _rename_under_lock(self, tmp: str, path: str) -> None:
        """Create-if-absent where the filesystem has neither hard links nor rename-if-absent: the check and
        the rename under the directory flock, which compare-and-swaps (`replace`) take too."""
        fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            self._flock(fd)
            if os.path.lexists(path):
                raise PreconditionFailed(path)
            os.replace(tmp, path)
        finally:
            os.close(fd)

    def replace(self, path: str, data: bytes, token: str) -> None:
        """The new bytes are written and synced first; the lock covers only the compare and the rename, so a
        process stopped at a random moment (SIGSTOP, a suspended VM) almost never stops holding it."""
        d = os.path.dirname(path)
        if not os.path.isdir(d):
            raise PreconditionFailed(path)
        tmp: str | None = _tmp_name(path)
        try:
            _write_synced(tmp, [data])
            fd = os.open(d, os.O_RDONLY)
            try:
                self._flock(fd)
                try:
                    current = self.read(path)
                except FileNotFoundError:
                    raise PreconditionFailed(path) from None
                if hashlib.sha256(current).hexdigest() != token:
                    raise PreconditionFailed(path)
                os.replace(tmp, path)
                tmp = None
            finally:
                os.close(fd)  # releases the lock
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
        _fsync_dir(d)

    def _flock(self, fd: int) -> None:
        """An exclusive flock on `fd`, waiting at most `lock_wait_s` on the clock; then TimeoutError (a
        transient error: Storage retries)."""
        deadline = self.clock.monotonic() + self.lock_wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if self.clock.monotonic() > deadline:
                    raise TimeoutError("the directory lock is held by another process") from None
                self.clock.sleep(0.002)

    def delete(self, paths: list[str]) -> None:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def delete_tree(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)

    def remove_stale_temps(self, path: str, of: str | None = None) -> list[str]:
        """This process's own writes in flight are spared."""
        ours = f"{TMP_MARK}{os.getpid()}-"
        if of is not None and not os.path.lexists(os.path.join(path, of)):
            return []
        try:
            names = [n for n in os.listdir(path) if TMP_MARK in n and ours not in n
                     and (of is None or n.startswith(f".{of}{TMP_MARK}"))]
        except (FileNotFoundError, NotADirectoryError):
            return []
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(path, name))
        return names


class _LocalUpload(Upload):
    """A temp file beside the target, synced and renamed over it at commit."""

    def __init__(self, path: str):
        self._path, self._tmp = path, _tmp_name(path)
        self._f = open(self._tmp, "xb")  # noqa: SIM115 - closed at commit or discard

    def write(self, data: Buffer) -> int:
        return self._f.write(data)

    def commit(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self._tmp, self._path)
        _fsync_dir(os.path.dirname(self._path))

    def discard(self) -> None:
        self._f.close()
        with contextlib.suppress(OSError):
            os.remove(self._tmp)


_NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS)  # a filesystem without them
_RENAME_NOREPLACE = 1  # linux/fs.h
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)  # glibc >= 2.28


def _link_if_absent(tmp: str, path: str) -> bool:
    """Give `tmp`'s complete content the name `path` only if absent (PreconditionFailed if present); False
    where the filesystem has no hard links."""
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        raise PreconditionFailed(path) from None
    except OSError as e:
        if e.errno not in _NO_LINKS:
            raise
        return False


def _rename_if_absent(tmp: str, path: str) -> bool:
    """Rename `tmp` to `path` only if absent (renameat2 RENAME_NOREPLACE; PreconditionFailed if present);
    False where neither the C library nor the filesystem offers it."""
    if _renameat2 is None:
        return False
    at_cwd = -100  # AT_FDCWD
    if _renameat2(at_cwd, os.fsencode(tmp), at_cwd, os.fsencode(path), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        raise PreconditionFailed(path)
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), path)


def _open_to_read(path: str):
    """open(path, "rb"); a file sitting where a directory of the path should be means the file is not there
    (FileNotFoundError, as for any missing name: a lease or run.json not yet written), not a read error."""
    try:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    except NotADirectoryError as e:
        raise FileNotFoundError(errno.ENOENT, f"not found ({e.strerror}: a file sits on the path)", path) from None


def _makedirs(d: str) -> None:
    """os.makedirs, and when a file sits on the way, a BlockedPath naming it."""
    try:
        os.makedirs(d, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as e:
        p = d
        while p and p != os.path.dirname(p):
            if os.path.exists(p):
                if not os.path.isdir(p):
                    raise BlockedPath(f"{p} is a file, not a directory") from e
                break
            p = os.path.dirname(p)
        raise


def _tmp_name(path: str) -> str:
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:12]}")


def _write_synced(path: str, parts: list[Buffer]) -> None:
    """A new file (none may be there) holding `parts` back to back, synced to the device."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        _write_all(fd, parts)
        os.fsync(fd)
    finally:
        os.close(fd)


_IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16


def _write_all(fd: int, parts: list[Buffer]) -> None:
    """Every part's bytes in order, straight from its buffer: up to IOV_MAX parts a writev(2) call (a shard of
    8-bit codes has a thousand parts, its scales' small pieces among them), each call resumed where the kernel
    stopped (it may write fewer bytes than asked)."""
    views = [view for view in (memoryview(part).cast("B") for part in parts) if view.nbytes]
    at = 0
    while at < len(views):
        written = os.writev(fd, views[at : at + _IOV_MAX])
        while at < len(views) and written >= views[at].nbytes:
            written -= views[at].nbytes
            at += 1
        if written:
            views[at] = views[at][written:]


def _fsync_dir(d: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
