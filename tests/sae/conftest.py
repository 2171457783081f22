"""The SAE tests' straight run, trained once for the files that compare with it."""

import pytest
from extract_helpers import run_harvest
from sae_helpers import train_args


@pytest.fixture(scope="session")
def straight(sae_source) -> str:
    """STEPS steps straight, on 2 devices (a subprocess, as every run it is compared with), evaluating on the
    held-out stream every 4 steps (which leaves the params alone)."""
    out = str(sae_source["root"] / "straight")
    done = run_harvest(*train_args(sae_source, out), "--eval-every", "4", env=sae_source["env"])
    assert done.returncode == 0, done.stderr[-3000:]
    return out
