"""A PNG of one latent's page, taken by the chromium binary itself (`--headless=new --screenshot`): the demo's
picture of what the site shows, with no Python browser driver. `--virtual-time-budget` lets the page's data
scripts load before the shot."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def browser() -> str | None:
    """The chromium (or Chrome) binary on PATH, if any."""
    return next((path for path in map(shutil.which, BROWSERS) if path), None)


def png(site_dir: str | Path, tensor: str, latent: int, out_png: str | Path, *, width: int = 1200,
        height: int = 1500) -> Path | None:
    """Write a PNG of latent `latent` of `tensor` in the local site `site_dir` to `out_png`; None when no
    chromium is installed."""
    binary = browser()
    if binary is None:
        return None
    out = Path(out_png).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    url = f"{(Path(site_dir).resolve() / 'index.html').as_uri()}#/{tensor}/{latent}"
    with tempfile.TemporaryDirectory(prefix="harvest-chromium-") as profile:
        done = subprocess.run(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--hide-scrollbars", "--no-first-run", f"--user-data-dir={profile}", f"--window-size={width},{height}",
             "--virtual-time-budget=10000", f"--screenshot={out}", url],
            capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or not out.is_file():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"{binary} made no screenshot of {url} (exit {done.returncode}): {last}")
    return out
