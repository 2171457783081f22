"""A stream's content pin: a running xxh3_128 over the bytes of the records read (a line as read from its file,
a parsed row's repr: harvest.data.sources.raw_bytes; no JSON parsing), so that a resume proves it reads the input
the run's committed shards were made from.

Every sidecar carries the digest of its stream's records 0..n-1 (harvest.extract.shards.pinned_records: every
record its shards hold a piece or a skip of). A resume re-reads that prefix, hashes it and compares (`read_pin`),
so any edit to what was consumed is caught, in place or by a file added, removed or reordered before it; the
hasher's state at the resume's first record carries on into the records the resume reads. The cost: one
sequential read of the stream's consumed prefix per resume (hashing runs at memory speed: the read is the
cost, far below the extraction that consumed it), and about a microsecond per record while extracting.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import xxhash


class SourcePin:
    """The running digest of a stream's records from record `count` on (`hasher`: the state after the records
    before it). `add` runs on the thread that reads the records; `digest` and `forget` on the one closing shards."""

    def __init__(self, hasher=None, count: int = 0):
        self._hasher = hasher if hasher is not None else xxhash.xxh3_128()
        self._base = count  # the record count _digests[0] is the digest after
        self._digests = [self._hasher.intdigest()]
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        """Records hashed so far (from the stream's first)."""
        with self._lock:
            return self._count()

    def add(self, raw: bytes) -> None:
        with self._lock:
            self._hasher.update(raw)
            self._digests.append(self._hasher.intdigest())

    def digest(self, n: int) -> str:
        """The digest of the stream's records 0..n-1 (n read already, and not forgotten)."""
        with self._lock:
            if not 0 <= n - self._base < len(self._digests):
                raise ValueError(f"digest after {n} records: the pin holds {self._base}..{self._count()}")
            return f"{self._digests[n - self._base]:032x}"

    def forget(self, n: int) -> None:
        """Digests before record count `n` are no longer asked for (a shard closed there)."""
        with self._lock:
            drop = min(max(0, n - self._base), len(self._digests) - 1)
            del self._digests[:drop]
            self._base += drop

    def _count(self) -> int:
        return self._base + len(self._digests) - 1


def read_pin(raw: Iterable[bytes], start: int, n: int) -> tuple[SourcePin, str | None]:
    """(a pin at record `start`, the digest of records 0..n-1, None where the source holds fewer than n) from the
    bytes of a stream's records from its first (`raw`), read only as far as needed: start <= n."""
    hasher, at_start, count = xxhash.xxh3_128(), None, 0
    records = iter(raw)
    while True:
        if count == start:
            at_start = SourcePin(hasher.copy(), start)
        if count == n:
            return at_start, f"{hasher.intdigest():032x}"
        chunk = next(records, None)
        if chunk is None:
            return at_start or SourcePin(hasher.copy(), count), None
        hasher.update(chunk)
        count += 1
