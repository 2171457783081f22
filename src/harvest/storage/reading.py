"""A streaming reader that survives transient errors by reopening the file where it was."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class ReopeningReader(io.RawIOBase):
    """A raw reader over `opener(pos)` (a binary file positioned at pos). Every open and read goes through
    `retry(op, fn)`; a failed read drops the file, and the retry reopens it at the current offset."""

    def __init__(self, size: Callable[[], int], retry: Callable[[str, Callable[[], Any]], Any],
                 opener: Callable[[int], Any]):
        self._size, self._retry, self._opener = size, retry, opener
        self._pos = 0
        self._f: Any = None
        self._f = retry("open", lambda: opener(0))

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Move to `offset` (from the start, here or the end): the next read reopens there."""
        if whence == io.SEEK_CUR:
            offset += self._pos
        elif whence == io.SEEK_END:
            offset += self._size()
        if offset != self._pos:
            self._drop()
            self._pos = offset
        return self._pos

    def _drop(self) -> None:
        f, self._f = self._f, None
        if f is not None:
            with contextlib.suppress(Exception):
                f.close()

    def readinto(self, b: Any) -> int:
        def read_once() -> int:
            if self._f is None:
                self._f = self._opener(self._pos)
            try:
                return self._f.readinto(b)
            except BaseException:
                self._drop()
                raise
        n = self._retry("read", read_once)
        self._pos += n
        return n

    def close(self) -> None:
        self._drop()
        super().close()
