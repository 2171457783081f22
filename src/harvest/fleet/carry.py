"""A fleet with neither `install` nor `image` carries this checkout: `fleet plan --emit` and `fleet up` build a
wheel of the working tree (uncommitted changes included), each task's file_mounts put it on every host, and
the task's setup installs it with the extras that host needs: its accelerator's jax (tpu, cuda), the storage
its URLs name (gcs, s3), the trainers' optax and orbax (train, also for features, which restores an SAE's
checkpoint), a hub dataset's reader (hub), a logger (logging).

The distribution is `harvest-activations` (harvest.version.DISTRIBUTION): the package index's `harvest` is
another project, so no task ever installs harvest by name. The wheel is built from a copy of the checkout's
pyproject.toml, README.md and src/harvest, so the build writes nothing into the working tree.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from harvest.fleet.spec import FleetError, FleetSpec
from harvest.version import DISTRIBUTION

WHEEL_DIR = "~/.harvest/dist"  # where a task's file_mounts put the wheel on each host
_KIND_EXTRA = {"tpu": "tpu", "gpu": "cuda", "cpu": None}
_URL_EXTRA = {"gs://": "gcs", "s3://": "s3", "hf://": "hub"}


def checkout() -> Path:
    """The working tree harvest runs from, or one line saying there is none to carry."""
    root = Path(__file__).resolve().parents[3]
    if not (root / "pyproject.toml").is_file() or not (root / "src" / "harvest").is_dir():
        raise FleetError(f"harvest runs from an installed package ({Path(__file__).parents[1]}), not a checkout, so "
                         f"there is no working tree to carry: give fleet.yaml an install: line installing "
                         f"{DISTRIBUTION} from an index that holds it, or an image:")
    return root


def build_wheel(out_dir: str | Path) -> Path:
    """A wheel of the checkout in out_dir (harvest's own files only: --no-deps)."""
    root, out = checkout(), Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="harvest-wheel-") as tmp:
        shutil.copy(root / "pyproject.toml", tmp)
        shutil.copy(root / "README.md", tmp)
        shutil.copytree(root / "src" / "harvest", Path(tmp) / "src" / "harvest",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
        done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "--quiet",
                               "--disable-pip-version-check", "--wheel-dir", tmp + "/dist", tmp],
                              capture_output=True, text=True)
        wheels = sorted(Path(tmp, "dist").glob("*.whl"))
        if done.returncode != 0 or len(wheels) != 1:
            last = (done.stderr.strip().splitlines() or ["no wheel written"])[-1]
            raise FleetError(f"building the wheel of {root} to carry failed: {last}")
        return Path(shutil.copy(wheels[0], out))


def extras(spec: FleetSpec, kind: str) -> list[str]:
    """The extras a host of this kind ("tpu", "gpu", "cpu") needs for the fleet's job."""
    urls = [*spec.data.split(","), *(g.out for g in spec.groups), *_strings(spec.settings),
            *_strings(spec.puzzles or {})]
    found = {_KIND_EXTRA[kind]} | {extra for url in urls for prefix, extra in _URL_EXTRA.items()
                                    if url.startswith(prefix)}
    if spec.job in ("train", "sae", "features"):  # features: the SAE's checkpoint is orbax's
        found.add("train")
    if any(logger in str(spec.settings.get("log_to") or "") for logger in ("wandb", "tensorboard")):
        found.add("logging")
    return sorted(extra for extra in found if extra)


def _strings(value: Any) -> list[str]:
    """Every string in a settings value (comma-separated parts apart)."""
    if isinstance(value, str):
        return [part.strip() for part in value.split(",")]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return []


def remote_path(wheel: Path) -> str:
    return f"{WHEEL_DIR}/{wheel.name}"


def setup_command(wheel: Path, wanted: list[str]) -> str:
    """Install the carried wheel, with its extras, into the host's Python (the one `harvest` then runs from)."""
    target = remote_path(wheel).removeprefix("~/") + (f"[{','.join(wanted)}]" if wanted else "")
    return f'pip install "$HOME/{target}"'
