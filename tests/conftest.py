"""Test session setup: 8 fake CPU devices, no hub access, one shared HF cache and one harvest cache (the demo
checkpoint, compiled programs, checkpoint staging) in temp dirs.

These variables must be set before jax or huggingface_hub is imported anywhere.
"""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="harvest-hub-")
os.environ["HARVEST_CACHE"] = tempfile.mkdtemp(prefix="harvest-cache-")
# Keep every compiled program, however quick to compile (JAX keeps those over 1 s): a test's later processes
# (resumes, restarts, the other host) load them as a user's rerun does, and the suite runs that path throughout.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["storage_servers"]
