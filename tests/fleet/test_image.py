"""The fleet's docker image (Dockerfile, `make image`): it runs `harvest demo` offline, as its entry point.

Built by `make image-test` (a Debian base made locally with debootstrap, harvest from a wheelhouse built
here), which sets HARVEST_TEST_IMAGE; the ordinary suite skips this, saying why."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def _docker_problem() -> str | None:
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    info = subprocess.run(["docker", "info"], capture_output=True, text=True)
    if info.returncode != 0:
        return "docker cannot run here (no daemon: `dockerd` not running or not reachable)"
    if not os.environ.get("HARVEST_TEST_IMAGE"):
        return "no image to test: `make image-test` builds one and sets HARVEST_TEST_IMAGE"
    return None


@pytest.fixture(scope="module")
def image() -> str:
    problem = _docker_problem()
    if problem:
        pytest.skip(problem)
    return os.environ["HARVEST_TEST_IMAGE"]


def test_image_runs_the_demo(image):
    done = subprocess.run(["docker", "run", "--rm", "--network=none", image, "demo", "--tasks", "12"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "OK " in done.stdout  # the demo verifies what it wrote


def test_image_entry_point_is_harvest(image):
    done = subprocess.run(["docker", "run", "--rm", image, "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("harvest "), done.stdout + done.stderr
