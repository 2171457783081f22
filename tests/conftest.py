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
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).parent))

pytest_plugins = ["storage_servers"]
