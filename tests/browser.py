"""A real browser for the tests: Debian's chromium and chromedriver driven by selenium (FACTS.md: no browser can
be downloaded here, so selenium's own driver manager and Playwright are out). Missing pieces skip the browser
tests, saying which, unless HARVEST_BROWSER=required (CI: .ci/run), where they fail."""

from __future__ import annotations

import importlib.util
import os

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


def missing() -> str | None:
    """What the browser tests lack, in words; None when all is there."""
    lacking = [what for what, there in ((CHROMIUM, os.access(CHROMIUM, os.X_OK)),
                                        (CHROMEDRIVER, os.access(CHROMEDRIVER, os.X_OK)),
                                        ("selenium", importlib.util.find_spec("selenium") is not None)) if not there]
    if not lacking:
        return None
    return f"no {', '.join(lacking)}: `make browser` installs chromium and chromium-driver (as root), `make test` selenium"


def require() -> None:
    """Skip (or, with HARVEST_BROWSER=required, fail) when the browser is not there."""
    reason = missing()
    if reason is None:
        return
    if os.environ.get("HARVEST_BROWSER") == "required":
        pytest.fail(f"HARVEST_BROWSER=required but {reason}")
    pytest.skip(reason)


def chrome(width: int = 1280, height: int = 1400):
    """A headless chromium under selenium (quit it when done)."""
    require()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
