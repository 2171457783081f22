"""The console every table and live view prints on: a terminal's own width, 200 columns on a pipe or in a log.

rich takes 80 columns where stdout is not a terminal and folds every cell (URLs, tensor names, counts) to fit:
a log of `harvest status --watch` or of the demo would read "resid_…".
"""

from __future__ import annotations

import sys

from rich.console import Console

LOG_WIDTH = 200


def table_console(**kwargs) -> Console:
    return Console(width=None if sys.stdout.isatty() else LOG_WIDTH, **kwargs)
