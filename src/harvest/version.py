"""harvest's distribution: its name, its version as run.json and --version record it, how to add an extra."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# The distribution's name (pyproject.toml): the package index's `harvest` is an unrelated project (a 2014 tool),
# and harvest-activations is on no index: it is installed from a checkout, or carried by a fleet's tasks.
DISTRIBUTION = "harvest-activations"
FROM_SOURCE = "0+source"  # harvest run from a checkout's src/ on PYTHONPATH, not installed (an accelerator host)


def harvest_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return FROM_SOURCE


def install_extra(extra: str) -> str:
    """How a user adds an optional extra (what a missing library's error says)."""
    return f"pip install -e '.[{extra}]' in harvest's checkout (the {DISTRIBUTION} distribution's {extra} extra)"
