"""Test session setup: 8 fake CPU devices, no hub access, one shared HF cache and one harvest cache (the demo
checkpoint, compiled programs, checkpoint staging) in temp dirs.

These variables must be set before jax or huggingface_hub is imported anywhere.
"""

import os
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="harvest-hub-")
os.environ["HARVEST_CACHE"] = tempfile.mkdtemp(prefix="harvest-cache-")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["storage_servers", "flaky_proxy"]


@pytest.fixture(scope="session")
def fault_reference(tmp_path_factory):
    """tests/store/test_fencing.py's and test_store_holes.py's common ground (extract_helpers.fault_reference),
    built once."""
    from extract_helpers import fault_reference

    return fault_reference(tmp_path_factory.mktemp("fault-reference"))


@pytest.fixture(scope="session")
def sae_source(tmp_path_factory) -> dict:
    """The run SAEs train on (sae_helpers.extracted_source), for tests/sae and tests/training alike."""
    from sae_helpers import extracted_source

    return extracted_source(tmp_path_factory.mktemp("sae-source"))


@pytest.fixture(scope="session")
def sudokus(tmp_path_factory) -> dict:
    """The TRM tests' 4x4 sudokus (trm_helpers.small_sudokus), for tests/trm and tests/training alike."""
    from trm_helpers import small_sudokus

    return small_sudokus(tmp_path_factory.mktemp("trm-source"))
