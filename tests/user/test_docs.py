"""The docs site builds strictly (mkdocs.yml: every warning fails, and a link to a missing page or anchor is a
warning), a broken anchor really fails it, and the README's links into docs/ land on pages and anchors that
exist. `make docs` runs the same build."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(root / "mkdocs.yml"), "--site-dir", str(site)], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    done = build(ROOT, site)
    assert done.returncode == 0, done.stderr
    return site


def test_the_docs_build_strictly(site):
    pages = {p.stem for p in (ROOT / "docs").glob("*.md")}
    assert {"index", "extracting", "fleet", "training", "saes", "trm", "storage", "reading", "reliability",
            "performance", "glossary"} <= pages
    assert all((site / f"{page}.html").is_file() for page in pages)


def test_a_broken_anchor_fails_the_build(tmp_path):
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    page = tmp_path / "docs" / "reading.md"
    page.write_text(page.read_text() + "\nSee [the format](storage.md#no-such-anchor).\n")
    done = build(tmp_path, tmp_path / "site")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "does not contain an anchor '#no-such-anchor'" in output and "Aborted" in output, output


def test_the_readme_links_into_the_docs_land(site):
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(docs/([\w-]+)\.md(?:#([\w-]+))?\)", readme)
    assert len({page for page, _ in links}) >= 10, links
    for page, anchor in links:
        html = (site / f"{page}.html").read_text()
        assert not anchor or f'id="{anchor}"' in html, f"README: docs/{page}.md#{anchor}"


def test_the_files_the_pages_name_exist():
    """A page that names a test, a bench script or a module file names one that is there (files move)."""
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    named = {(page.name, path) for page in pages
             for path in re.findall(r"\b((?:tests|bench|harvest)/[\w/]+\.py)\b", page.read_text())}
    assert named
    missing = [f"{page}: {path}" for page, path in sorted(named)
               if not (ROOT / path).exists() and not (ROOT / "src" / path).exists()]
    assert not missing, missing
