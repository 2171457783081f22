"""The benches' one way to print a table: rich where installed, plain columns otherwise."""

from __future__ import annotations

import os
import sys


def show(title: str, header: list[str], rows: list[list[str]], footer: str, columns: int = 100) -> None:
    """`columns`: the width when stdout is a file or a pipe and COLUMNS is unset (rich would wrap at 80 there)."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        print(title)
        for r in [header, *rows]:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        print(footer)
        return
    table = Table(title=title, caption=footer, caption_justify="left")
    for i, h in enumerate(header):
        table.add_column(h, justify="left" if i < 3 else "right")
    for r in rows:
        table.add_row(*r)
    width = Console().width if sys.stdout.isatty() or "COLUMNS" in os.environ else columns
    Console(width=max(100, width)).print(table)
