"""harvest.data streams: a source split into streams round-trips its records, refuses an overwrite and damage,
seeks by line offsets (local and gs://) and writes to object storage."""

import hashlib
import json

import pytest
from source_records import JSONL

from harvest.data import streams as streamslib
from harvest.data.sources import iter_records
from harvest.data.streams import StreamSet, create_streams, open_data
from harvest.errors import UserError


def test_streams_round_trip(jsonl, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_bytes(JSONL)  # 6 records, incl. malformed, bad UTF-8, non-object, empty
    pq.write_table(pa.table({"text": [f"p{i}" for i in range(5)]}), src / "b.parquet", row_group_size=2)
    (src / "c.txt").write_text("t0\nt1\n")
    spec = str(src)
    direct = list(iter_records(spec))
    assert len(direct) == 13
    out = tmp_path / "streams"
    ss = create_streams(spec, 4, str(out))
    assert (ss.num_streams, ss.total, ss.counts) == (4, 13, [4, 3, 3, 3])
    meta = json.loads((out / "streams.json").read_text())
    assert meta["format_version"] == 1 and meta["mapping"] == "round_robin" and meta["source"] == spec
    assert [f["records"] for f in meta["files"]["files"]] == [6, 5, 2]
    for s in range(4):
        data = (out / f"stream_{s:05d}.jsonl").read_bytes()
        assert hashlib.sha256(data).hexdigest() == meta["sha256"][s]
        assert data.count(b"\n") == ss.counts[s]
    # jsonl lines are carried verbatim; the bad UTF-8 one as an error object with its location
    lines = (out / "stream_00001.jsonl").read_text().splitlines()
    assert lines[0] == '{"text": "b",}'
    carried = json.loads((out / "stream_00002.jsonl").read_text().splitlines()[0])
    assert carried == {"__harvest_error__": "not valid UTF-8 (byte 0xff at col 1)",
                       "__harvest_location__": f"{src / 'a.jsonl'}:3"}
    # reading the streams gives the same records (ids, locations, values, errors) as the source
    seen = []
    for s in range(4):
        got = list(ss.records(s))
        assert [r.sample_id for r in got] == [ss.sample_id(s, i) for i in range(ss.counts[s])]
        assert [ss.locate(r.sample_id) for r in got] == [(s, i) for i in range(ss.counts[s])]
        seen += got
        for start in range(ss.counts[s] + 1):
            assert list(ss.records(s, start)) == got[start:]
    assert sorted(seen, key=lambda r: r.sample_id) == direct  # disjoint and covering
    assert ss.verify() == []
    assert StreamSet.open(str(out / "streams.json")).total == 13
    # open_data: a streams directory, or a plain source as one stream
    assert isinstance(open_data(str(out)), StreamSet)
    plain = open_data(spec)
    assert (plain.num_streams, plain.counts, plain.total) == (1, [None], None)
    assert list(plain.records(0, 2)) == direct[2:] and plain.sample_id(0, 7) == 7
    with pytest.raises(UserError, match="out of range"):
        ss.records(4)
    with pytest.raises(UserError, match="one stream"):
        plain.records(1)


def test_streams_refuse_overwrite_and_damage(jsonl, tmp_path):
    out = tmp_path / "s"
    create_streams(str(jsonl), 3, str(out))
    with pytest.raises(UserError, match="--overwrite"):
        create_streams(str(jsonl), 2, str(out))
    ss = create_streams(str(jsonl), 2, str(out), overwrite=True)
    assert ss.counts == [3, 3] and not (out / "stream_00002.jsonl").exists()  # stale stream removed
    (out / "stream_00001.jsonl").write_text('{"text": "x"}\n')
    assert len(ss.verify()) == 2  # line count and hash
    with pytest.raises(UserError, match="damaged"):
        list(ss.records(1))
    meta = json.loads((out / "streams.json").read_text())
    meta["counts"] = [5, 1]
    (out / "streams.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match="round robin"):
        StreamSet.open(str(out))
    (out / "streams.json").write_text("{")
    with pytest.raises(UserError, match="not valid JSON"):
        open_data(str(out))
    with pytest.raises(UserError, match="no streams.json"):
        StreamSet.open(str(tmp_path / "nowhere"))
    with pytest.raises(UserError, match="positive integer"):
        create_streams(str(jsonl), 0, str(tmp_path / "t"))


@pytest.mark.parametrize("where", ["local", "gs"])
def test_streams_seek_by_line_offsets(tmp_path, monkeypatch, where, request):
    monkeypatch.setattr(streamslib, "INDEX_EVERY", 4)
    src = tmp_path / "big.txt"
    src.write_text("".join(f"line {i}\n" for i in range(50)))
    out = str(tmp_path / "s") if where == "local" else request.getfixturevalue("gcs_url") + "/s"
    ss = create_streams(str(src), 3, out, buffer_bytes=64)
    assert ss.meta["index_every"] == 4 and len(ss.meta["line_offsets"][0]) == 5
    for s in range(3):
        full = list(ss.records(s))
        assert [r.value["text"] for r in full] == [f"line {i}" for i in range(s, 50, 3)]
        for start in range(len(full) + 1):
            assert list(ss.records(s, start)) == full[start:]
    assert ss.verify() == []


def test_streams_to_object_storage(jsonl, s3_url):
    """Streams on s3:// (moto on 127.0.0.1): written, listed and read back through the same code as local."""
    ss = create_streams(str(jsonl), 2, s3_url + "/streams")
    assert ss.total == 6 and ss.verify() == []
    again = open_data(s3_url + "/streams")
    assert [r.sample_id for r in again.records(1)] == [1, 3, 5]
