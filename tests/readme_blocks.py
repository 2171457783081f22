"""The fenced code blocks of the README and of the docs pages, as the examples tests read them: every example is
run or planned, wherever it is written.

A block is (path, line, lang, text): `line` is the 1-based line of its opening fence in `path`, `lang` the
fence's info string ("bash", "yaml", "python", "text", or "" when none), `text` what lies between the fences.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))  # the README first: its fleet is "the first fleet"
_FENCE = re.compile(r"^(\s*)```(\S*)\s*$")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    text: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} ({self.lang or 'no language'})"


def blocks(lang: str | None = None, pages: tuple[Path, ...] = PAGES) -> list[Block]:
    """Every fenced block of the pages (indented fences too, as in list items), or those of one language."""
    return [b for path in pages for b in _blocks(path) if lang is None or b.lang == lang]


def _blocks(path: Path) -> list[Block]:
    found: list[Block] = []
    opened: tuple[int, str, str] | None = None
    body: list[str] = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = _FENCE.match(line)
        if opened is None:
            if fence:
                opened, body = (number, fence.group(2), fence.group(1)), []
        elif fence and fence.group(2) == "":
            start, info, indent = opened
            found.append(Block(path, start, info, "\n".join(b[len(indent):] if b.startswith(indent) else b for b in body)))
            opened = None
        else:
            body.append(line)
    if opened is not None:
        raise ValueError(f"{path}:{opened[0]}: a fence that never closes")
    return found


def shell_commands(block: Block) -> list[list[str]]:
    """A shell block's commands as argument lists, as a POSIX shell splits them: `\\`-newline continuations
    joined, a quoted string may span lines (e.g. `gcloud ... --command="harvest ..."`), comments dropped."""
    import shlex

    out: list[list[str]] = []
    pending = ""
    for raw in block.text.splitlines():
        pending += raw[:-1] + " " if raw.endswith("\\") else raw + "\n"
        if raw.endswith("\\"):
            continue
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        if argv:
            out.append(argv)
        pending = ""
    if pending.strip():
        raise ValueError(f"{block.where()}: a command that never ends: {pending!r}")
    return out
