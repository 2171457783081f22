"""harvest's version as run.json and --version record it."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

FROM_SOURCE = "0+source"  # harvest run from a checkout's src/ on PYTHONPATH, not installed (an accelerator host)


def harvest_version() -> str:
    try:
        return version("harvest-activations")  # the distribution's name (pyproject.toml)
    except PackageNotFoundError:
        return FROM_SOURCE
