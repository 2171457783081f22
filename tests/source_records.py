"""A JSON-lines source with bad lines (malformed JSON, bad UTF-8, not an object, blank), and records as
comparable tuples: what the data tests read (tests/data/test_sources.py, tests/data/test_streams.py)."""

JSONL = b'{"text": "a"}\n{"text": "b",}\n\xff\xfe oops\n[1, 2]\n\n{"text": "c"}\n'


def values(records):
    return [(r.sample_id, r.location, r.value, r.error) for r in records]
