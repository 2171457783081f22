"""Number ranges as users write them (`0-7,9`): streams, layers. A bottom module: anything may use it."""

from __future__ import annotations

import re

from harvest.errors import UserError


def parse_ranges(text: str, flag: str) -> list[int]:
    """'0-7,9' -> [0..7, 9] (sorted, unique)."""
    chosen: set[int] = set()
    for item in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
        if not match:
            raise UserError(f"{flag} {text!r}: expected numbers and ranges like 0-7,9")
        lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
        if hi < lo:
            raise UserError(f"{flag} {text!r}: range {item.strip()} runs backwards")
        chosen.update(range(lo, hi + 1))
    return sorted(chosen)


def format_ranges(values, sep: str = ",", limit: int | None = None) -> str:
    """The inverse of parse_ranges: [0, 1, 2, 5, 7, 8] -> '0-2,5,7-8' (at most `limit` runs, then a count)."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][1] + 1:
            runs[-1][1] = v
        else:
            runs.append([v, v])
    shown = runs if limit is None else runs[:limit]
    text = sep.join(str(a) if a == b else f"{a}-{b}" for a, b in shown)
    return text + (f"{sep}... ({len(runs) - len(shown)} more ranges)" if len(shown) < len(runs) else "")
