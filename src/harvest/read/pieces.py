"""Reading a piece (rows [lo, hi) of one shard) for token batches: from object storage as one ranged read per
tensor asked for, from local disk as views of the memory-mapped file; and the rows to leave out (special
tokens). Every consumer checks a shard's header and index arrays before its first piece; bytes are checked
against the sidecar's chunk digests (older sidecars: per-tensor or whole-file digests, by one consumer per
shard). `verify` and `on_corrupt`, and which sidecar gets which rule: docs/reading.md."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import numpy as np

from harvest.errors import UserError
from harvest.read.errors import CorruptShardError
from harvest.read.gather import Part
from harvest.read.layout import (checked_layout, checked_offsets, checked_rows, prefault, read_rows, rows_of,
                                 verify_bytes, verify_fetched)
from harvest.read.shuffle import Piece
from harvest.storage import Storage
from harvest.store import quant
from harvest.store.listing import stream_generation
from harvest.store.records import Sidecar
from harvest.read.shardfile import ShardLayout, map_file
from harvest.store.snapshot import Snapshot, shard_path, started_over

log = logging.getLogger(__name__)

VERIFY = ("auto", "sha256", "header")
ON_CORRUPT = ("stop", "skip")


class PieceReader:
    """Reads pieces of one run's shards for one consumer; safe to call from many reading threads."""

    def __init__(self, storage: Storage, view: Snapshot, names: list[str], stored: np.dtype, *, verify: str,
                 on_corrupt: str):
        self.storage, self.names, self.stored = storage, names, stored
        scales = [quant.scale_name(n) for n in names] if quant.is_quantized(view.dtype) else []
        self.keys = ["tokens", *names, *scales]
        self.raw = {"tokens": ((), np.dtype(np.int32)),  # gathered as unsigned ints: the same bits, a fast copy
                    **{n: ((view.tensors[n],), np.dtype(f"u{stored.itemsize}")) for n in names},
                    **{n: ((), np.dtype(np.uint32)) for n in scales}}
        self.widths, self.dtype_name, self.url = {n: view.tensors[n] for n in names}, view.dtype, view.url
        per_row = 4 if scales else 0
        asked = sum(view.tensors[n] * stored.itemsize + per_row for n in names) + 4
        every = sum(w * stored.itemsize + per_row for w in view.tensors.values()) + 4
        self.verify, self.on_corrupt, self._whole_file_pays = verify, on_corrupt, 2 * asked >= every
        self.to_verify: set[tuple[int, int]] = set()  # shards this consumer checks the bytes of (set per epoch)
        self._layouts: dict[str, Future] = {}  # shard -> its checked ShardLayout, once per reader
        self._verify_fetched: set[str] = set()  # shards read as one piece, checked by the bytes fetched
        self._lock = threading.Lock()
        self.skipped_shards: set[str] = set()
        self.verified_shards: set[str] = set()
        self.bytes_hashed = 0

    def read(self, piece: Piece, sc: Sidecar, exclude: tuple[int, ...], skip_first: int = 0,
             max_norm: tuple[tuple[str, float], ...] = ()) -> Part:
        """A piece's rows (views of mapped or fetched bytes, as unsigned ints of the stored width) and which
        of them to serve (not the tokens `exclude` names, nor a sample's first `skip_first`, nor a token whose
        L2 norm exceeds its limit in `max_norm` at any of those tensors): runs in the reading threads."""
        rel = shard_path(sc)
        try:
            cols = self._ranged(rel, sc, piece)
            later = self._later(rel, sc, piece, skip_first) if skip_first else None
        except (ValueError, FileNotFoundError) as e:
            if self._ended(sc):  # not damage: the stream was started over, and its old objects deleted
                raise started_over(self.url, [sc.stream]) from None
            if self.on_corrupt == "stop":
                raise CorruptShardError(f"{self.url}/{rel}: {e}; run `harvest verify {self.url}`, or read "
                                        f"past it with on_corrupt='skip'") from None
            log.warning("%s/%s: %s; skipped", self.url, rel, e)
            with self._lock:
                self.skipped_shards.add(rel)
            return Part({k: np.empty((0, *shape), dtype) for k, (shape, dtype) in self.raw.items()}, None)
        cols = {k: v.view(self.raw[k][1]) for k, v in cols.items()}
        mask = later
        if exclude:
            mask = ~np.isin(cols["tokens"], exclude) if mask is None else mask & ~np.isin(cols["tokens"], exclude)
        massive = 0
        if max_norm:
            below = self.below(cols, max_norm)
            massive = int(np.count_nonzero(~below if mask is None else mask & ~below))
            mask = below if mask is None else mask & below
        keep = None if mask is None or mask.all() else np.flatnonzero(mask)
        return Part(cols, keep, massive)

    def below(self, cols: dict[str, np.ndarray], max_norm: tuple[tuple[str, float], ...]) -> np.ndarray:
        """Which rows have an L2 norm at or below the limit at every tensor `max_norm` names (the values as
        served in float32: 8-bit codes times their scales), summed in float64."""
        ok = np.ones(len(cols["tokens"]), bool)
        coded = quant.is_quantized(self.dtype_name)
        for name, limit in max_norm:
            scale = cols[quant.scale_name(name)].view(np.float32) if coded else None
            ok &= squared_norms(cols[name].view(self.stored), scale) <= float(limit) ** 2
        return ok

    def _later(self, rel: str, sc: Sidecar, piece: Piece, skip_first: int) -> np.ndarray:
        """Which rows of the piece lie at position `skip_first` or later within their sample (from the shard's
        offsets, checked with its header)."""
        offsets = self._layout(rel, sc, whole=False)[1]
        rows = np.arange(piece.lo, piece.hi)
        starts = offsets[np.searchsorted(offsets, rows, side="right") - 1]
        return rows - starts >= skip_first

    def _ranged(self, rel: str, sc: Sidecar, piece: Piece) -> dict[str, np.ndarray]:
        layout = self._layout(rel, sc, whole=piece.lo == 0 and piece.hi == sc.tokens)[0]
        # locally the page cache, copied once: where a batch gathers its rows
        buf = map_file(self.storage.path(rel)) if self.storage.is_local else None
        if self._chunked(sc):
            fetched = {k: checked_rows(self.storage, rel, layout.tensors[k], piece.lo, piece.hi, sc, k, buf)
                       for k in self.keys}
            self._record(rel, sum(hashed for _, hashed in fetched.values()))
            return {k: rows for k, (rows, _) in fetched.items()}
        if buf is None:
            cols = {k: read_rows(self.storage, rel, layout.tensors[k], piece.lo, piece.hi) for k in self.keys}
        else:
            cols = {k: rows_of(buf, layout.tensors[k], piece.lo, piece.hi) for k in self.keys}
            for v in cols.values():
                prefault(v)
        if rel in self._verify_fetched:
            self._record(rel, verify_fetched(cols, sc))
            self._verify_fetched.discard(rel)
        return cols

    def _layout(self, rel: str, sc: Sidecar, whole: bool) -> tuple[ShardLayout, np.ndarray]:
        """A shard's header and offsets, read and checked once per reader (and its bytes when this consumer
        verifies them by the older rule), whichever reading thread gets there first; the others wait for it."""
        with self._lock:
            known = self._layouts.get(rel)
            mine = known is None
            if mine:
                known = self._layouts[rel] = Future()
        if mine:
            try:
                known.set_result(self._check(rel, sc, whole))
            except BaseException as e:
                known.set_exception(e)
        return known.result()

    def _check(self, rel: str, sc: Sidecar, whole: bool) -> tuple[ShardLayout, np.ndarray]:
        """The header and the small tensors checked (returns the offsets); by the older rule the bytes too
        when this consumer verifies the shard: now, or, for a shard read whole with per-tensor checksums, by
        the bytes its one piece fetches (before they are served)."""
        layout = checked_layout(self.storage, rel, sc, self.widths, self.stored, self.dtype_name)
        offsets = checked_offsets(self.storage, rel, layout, sc, self.verify != "header")
        if not self._chunked(sc) and (sc.stream, sc.shard) in self.to_verify and self._hashes(sc):
            if whole and sc.tensor_digests is not None:
                self._verify_fetched.add(rel)
            else:
                self._record(rel, verify_bytes(self.storage, rel, layout, sc, self.keys))
        return layout, offsets

    def _record(self, rel: str, hashed: int) -> None:
        with self._lock:
            self.verified_shards.add(rel)
            self.bytes_hashed += hashed

    def _ended(self, sc: Sidecar) -> bool:
        """Whether the shard's generation has ended (its stream started over since it was listed)."""
        try:
            return stream_generation(self.storage, sc.stream) != sc.generation
        except UserError:
            return False  # a damaged lease: the shard is judged as it reads

    def _chunked(self, sc: Sidecar) -> bool:
        """Whether this consumer checks the chunks it fetches of the shard (the sidecar has their digests)."""
        return sc.chunk_digests is not None and self.verify != "header"

    def _hashes(self, sc: Sidecar) -> bool:
        if self.verify == "header":
            return False
        return self.verify == "sha256" or sc.tensor_digests is not None or self._whole_file_pays


def squared_norms(x: np.ndarray, scale: np.ndarray | None = None, rows: int = 4096) -> np.ndarray:
    """Each row's squared L2 norm in float64, from its values as served (bf16 widened exactly; 8-bit codes times
    their `scale`, in float32 as the reader dequantizes them), a block of rows at a time: the same numbers
    wherever the rows are (harvest.read.batches.median_norms uses it too)."""
    out = np.empty(len(x), np.float64)
    for lo in range(0, len(x), rows):
        block = x[lo:lo + rows] if scale is None else quant.dequantize(x[lo:lo + rows], scale[lo:lo + rows])
        block = np.asarray(block).astype(np.float64)
        out[lo:lo + rows] = np.einsum("ij,ij->i", block, block)
    return out
