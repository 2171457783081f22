"""The data tests' JSON-lines source (source_records.JSONL) in a file."""

import pytest
from source_records import JSONL


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(JSONL)
    return path
