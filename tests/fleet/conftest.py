"""The fleet tests' inputs: 32 streams in a GCS bucket (fake-gcs-server), this checkout's wheel, the users'
four-region fleet over those streams."""

import json
import os
from pathlib import Path

import pytest
from fleet_helpers import FOUR_REGIONS, built_wheel, write_fleet
from storage_servers import create_gcs_bucket

from harvest.data.streams import create_streams


@pytest.fixture(scope="session")
def streams32(tmp_path_factory, gcs_server) -> str:
    """32 streams in a bucket, where a cloud fleet's data lives (plan reads their streams.json there)."""
    root = tmp_path_factory.mktemp("streams32")
    source = root / "tasks.jsonl"
    source.write_text("".join(json.dumps({"text": f"task {i}"}) + "\n" for i in range(64)))
    bucket = f"fleet-streams-{os.getpid()}"
    create_gcs_bucket(gcs_server, bucket)
    create_streams(str(source), 32, f"gs://{bucket}/arc-streams")
    return f"gs://{bucket}/arc-streams"


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """The checkout's wheel, which the fleets here (neither install nor image) carry."""
    return built_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture
def users_fleet(tmp_path, streams32) -> Path:
    return write_fleet(tmp_path / "fleet.yaml", {**FOUR_REGIONS, "data": streams32})
