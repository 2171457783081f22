"""Records -> samples' tokens (with the long-sample policy) -> packed rows of fixed length.

A stream becomes a sequence of *samples* at positions (index, variant): index is the record's line in
the stream, variant which of the record's samples it is (ARC augmentations, chunks of a long text).
Samples are cut into *blocks* in stream order (a block closes once it holds PACK_ROWS rows' worth of
tokens, or at the stream's end), and each block is packed best-fit decreasing into rows: ~0.97 of the
computed tokens are real on lognormal text where greedy in-order filling gets ~0.78. Rows never span
two streams or two blocks, so packing is a pure function of the stream from any block start: every
row of a block carries that start, a resume re-packs from there, and every sample sits at the same
offset of the same row and rounds the same way as in the first run. A block's last row carries the
block's events in stream order, so that shards can be written in stream order.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Callable, Iterable, Iterator

import numpy as np

from harvest.errors import UserError
from harvest.store.format import Position

log = logging.getLogger(__name__)
BLOCK = 64  # records tokenized together: one call into the Rust tokenizer per block
PACK_ROWS = 32  # rows' worth of tokens packed together: tighter packing, but the host holds a block's captures


@dataclasses.dataclass(frozen=True)
class SampleTokens:
    """One sample's tokens (a record's variant, or a chunk of a long one) at its position in the stream."""

    pos: Position
    sample_id: int
    tokens: np.ndarray  # int32
    long: str | None = None  # "truncated", or "chunked" on a record's first chunk


@dataclasses.dataclass(frozen=True)
class Skip:
    pos: Position
    sample_id: int
    location: str
    reason: str
    long: bool = False  # skipped for length by --long skip, not bad input

    def __post_init__(self):  # both go into a sidecar, whatever the record held: valid UTF-8, bounded
        object.__setattr__(self, "location", _storable(self.location))
        object.__setattr__(self, "reason", _storable(self.reason))


@dataclasses.dataclass(frozen=True)
class StreamEnd:
    records: int  # records the stream held (or that --max-samples let through)


Event = SampleTokens | Skip | StreamEnd


@dataclasses.dataclass
class Row:
    """One packed row: its samples with their offsets (ordered by offset), and the block it belongs to."""

    tokens: np.ndarray
    segments: np.ndarray
    start: Position | None = None  # where the row's block begins (a resume re-packs from there); None: no events
    used: int = 0
    events: list[tuple[SampleTokens, int]] = dataclasses.field(default_factory=list)  # (sample, offset in row)
    block: list[Event] | None = None  # on a block's last row: the block's samples and skips in stream order
    end: StreamEnd | None = None


def stream_pieces(
    records: Iterable,
    render: Callable,
    encode: Callable[[list[str]], list[list[int]]],
    *,
    first_index: int,
    max_seq_len: int,
    long: str,
    strict: bool,
    sample_error: type[Exception],
) -> Iterator[Event]:
    """Samples and skips of a stream, records numbered from `first_index`, ending with StreamEnd."""
    index = first_index
    block: list = []
    for record in records:
        block.append(record)
        if len(block) == BLOCK:
            yield from _block_events(block, index, render, encode, max_seq_len, long, strict, sample_error)
            index += len(block)
            block = []
    yield from _block_events(block, index, render, encode, max_seq_len, long, strict, sample_error)
    yield StreamEnd(index + len(block))


def _tokenize(texts: list[str], owners: list[int], block: list, encode: Callable, failures: dict[int, str]) -> list:
    """Token ids of `texts`, one tokenizer call for the block. Should that call fail, each record's texts
    are tokenized on their own: a record whose texts fail gets a reason in `failures`, the others go on."""
    if not texts:
        return []
    try:
        return encode(texts)
    except Exception:  # last resort: find the record at fault below, and only it is skipped
        pass
    ids: list = []
    for k, group in itertools.groupby(range(len(texts)), key=owners.__getitem__):
        own = [texts[i] for i in group]
        try:
            ids.extend(encode(own))
        except Exception as e:  # last resort, as above: one record's failure, named in its skip
            failures[k] = _unexpected("tokenizing", block[k], e)
            ids.extend([[]] * len(own))
    return ids


def _unexpected(stage: str, record, error: Exception) -> str:
    """The skip reason for an error no check foresaw (a bug to fix: logged with its traceback)."""
    log.warning("%s: unexpected error while %s it; skipped", _storable(record.location), stage,
                exc_info=error)
    return f"unexpected error while {stage} ({type(error).__name__}: {error})"


def _storable(text: str, limit: int = 500) -> str:
    """`text` as a sidecar can hold it: valid UTF-8 (lone surrogates escaped), at most `limit` characters."""
    text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _block_events(block, first, render, encode, max_seq_len, long, strict, sample_error) -> Iterator[Event]:
    texts: list[str] = []
    owners: list[int] = []
    failures: dict[int, str] = {}
    for k, record in enumerate(block):
        reason = record.error
        if reason is None:
            try:
                rendered = list(render(record))
            except sample_error as e:
                reason = getattr(e, "reason", str(e))
            except Exception as e:  # last resort: a renderer bug met by one record skips that record, loudly
                reason = _unexpected("rendering", record, e)
            else:
                texts.extend(rendered)
                owners.extend([k] * len(rendered))
        if reason is not None:
            failures[k] = reason
    ids = _tokenize(texts, owners, block, encode, failures)
    if strict and failures:
        k = min(failures)
        raise UserError(f"{block[k].location}: {failures[k]} (--strict stops at the first bad input)")
    by_record: dict[int, list[list[int]]] = {}
    for owner, tokens in zip(owners, ids):
        by_record.setdefault(owner, []).append(tokens)
    for k, record in enumerate(block):
        index = first + k
        if k in failures:
            yield Skip((index, 0), record.sample_id, record.location, failures[k])
            continue
        variants = by_record.get(k, [])
        if not variants:
            yield Skip((index, 0), record.sample_id, record.location, "no prompts")
            continue
        longest = max((len(t) for t in variants), default=0)
        if long == "skip" and longest > max_seq_len:
            yield Skip((index, 0), record.sample_id, record.location,
                       f"{longest} tokens > --max-seq-len {max_seq_len} (--long skip)", long=True)
            continue
        variant = 0
        for tokens in variants:
            if not tokens:  # the position is used up, so the next sample's differs (resume compares them)
                yield Skip((index, variant), record.sample_id, record.location, "no tokens")
                variant += 1
                continue
            array = np.asarray(tokens, np.int32)
            if len(array) <= max_seq_len:
                chunks = [(array, None)]
            elif long == "truncate":
                chunks = [(array[:max_seq_len], "truncated")]
            else:
                chunks = [(array[i : i + max_seq_len], "chunked" if i == 0 else None)
                          for i in range(0, len(array), max_seq_len)]
            for chunk, note in chunks:
                yield SampleTokens((index, variant), record.sample_id, chunk, note)
                variant += 1


def pack_stream(events: Iterable[Event], seq_len: int, skip_before: Position = (0, 0)) -> Iterator[Row]:
    """Rows of `seq_len`, block by block; the last row carries the StreamEnd.

    Events before `skip_before` (the block start a resume re-packs from) are dropped unseen.
    """
    block: list[Event] = []
    tokens = 0
    packed: list[Row] = []  # a full block's rows, held until the next event shows whether the stream ends there
    for event in events:
        if isinstance(event, StreamEnd):
            rows = packed + (pack_block(block, seq_len) if block or not packed else [])
            rows[-1].end = event
            yield from rows
            return
        if event.pos < skip_before:
            continue
        yield from packed
        packed = []
        block.append(event)
        if isinstance(event, SampleTokens):
            tokens += len(event.tokens)
            if tokens >= PACK_ROWS * seq_len:
                packed = pack_block(block, seq_len)
                block, tokens = [], 0


def pack_block(block: list[Event], seq_len: int) -> list[Row]:
    """Best-fit decreasing: longest sample first (ties in stream order), each into the fullest row it fits.
    At least one row (a block of skips only gets an empty one, to carry them)."""
    samples = sorted((e for e in block if isinstance(e, SampleTokens)), key=lambda p: (-len(p.tokens), p.pos))
    contents: list[list[SampleTokens]] = []
    free: list[int] = []
    for sample in samples:
        n = len(sample.tokens)
        fits = [r for r, room in enumerate(free) if room >= n]
        if fits:
            best = min(fits, key=lambda r: free[r])
            contents[best].append(sample)
            free[best] -= n
        else:
            contents.append([sample])
            free.append(seq_len - n)
    start = block[0].pos if block else None
    rows = [_fill(sorted(chosen, key=lambda p: p.pos), seq_len, start) for chosen in contents or [[]]]
    rows[-1].block = block
    return rows


def _fill(samples: list[SampleTokens], seq_len: int, start: Position | None) -> Row:
    row = Row(np.zeros(seq_len, np.int32), np.zeros(seq_len, np.int32), start)
    for segment, sample in enumerate(samples, 1):
        n = len(sample.tokens)
        row.tokens[row.used : row.used + n] = sample.tokens
        row.segments[row.used : row.used + n] = segment
        row.events.append((sample, row.used))
        row.used += n
    return row
