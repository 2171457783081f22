"""harvest.data sources of each kind: JSON lines, JSON arrays and objects of tasks, parquet, text, gzip, zstd,
globs, fsspec URLs, object storage and hub datasets; bad records kept with their ids, locations and reasons."""

import gzip
import json
import sys

import pytest
from source_records import values

from harvest.data.source_files import describe
from harvest.data.sources import Record, iter_records
from harvest.errors import UserError


def test_jsonl_keeps_bad_lines_with_ids_and_locations(jsonl):
    got = list(iter_records(str(jsonl)))
    p = str(jsonl)
    assert values(got) == [
        (0, f"{p}:1", {"text": "a"}, None),
        (1, f"{p}:2", None, "malformed JSON: Expecting property name enclosed in double quotes (col 14)"),
        (2, f"{p}:3", None, "not valid UTF-8 (byte 0xff at col 1)"),
        (3, f"{p}:4", None, "not a JSON object (got array)"),
        (4, f"{p}:5", None, "empty line"),
        (5, f"{p}:6", {"text": "c"}, None),
    ]
    assert isinstance(got[0], Record)
    with pytest.raises(Exception):
        got[0].sample_id = 3  # frozen


def test_malformed_json_names_the_column(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"a": 1 "b": 2}\n')
    (rec,) = iter_records(str(tmp_path / "x.jsonl"))
    assert rec.error == "malformed JSON: Expecting ',' delimiter (col 9)"


def test_start_offsets(jsonl, tmp_path):
    (tmp_path / "b.jsonl").write_text('{"text": "d"}\n{"text": "e"}\n')
    spec = str(tmp_path / "*.jsonl")
    full = values(iter_records(spec))
    assert len(full) == 8
    for start in (0, 1, 5, 6, 7, 8, 20):
        assert values(iter_records(spec, start)) == full[start:]


def test_json_array_and_object_of_tasks(tmp_path):
    (tmp_path / "arr.json").write_text(json.dumps([{"text": "x"}, 7, {"text": "y"}]))
    got = values(iter_records(str(tmp_path / "arr.json")))
    p = str(tmp_path / "arr.json")
    assert got == [(0, f"{p}[0]", {"text": "x"}, None), (1, f"{p}[1]", None, "not a JSON object (got number)"),
                   (2, f"{p}[2]", {"text": "y"}, None)]
    tasks = {"t1": {"train": [], "test": []}, "t2": {"id": "other", "train": [1]}}
    (tmp_path / "tasks.json").write_text(json.dumps(tasks))
    got = list(iter_records(str(tmp_path / "tasks.json"), 1))
    assert [(r.sample_id, r.value) for r in got] == [(1, {"id": "t2", "train": [1]})]
    # one ARC task per file (the ARC-AGI repository layout): one record, id from the file name
    (tmp_path / "007bbfb7.json").write_text(json.dumps({"train": [{"input": [[1]]}], "test": []}))
    (rec,) = iter_records(str(tmp_path / "007bbfb7.json"))
    assert rec.value["id"] == "007bbfb7" and rec.value["train"] == [{"input": [[1]]}]


def test_parquet_row_groups_and_start(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"text": [f"t{i}" for i in range(10)], "n": list(range(10))})
    path = tmp_path / "d.parquet"
    pq.write_table(table, path, row_group_size=3)
    got = list(iter_records(str(path)))
    assert [r.value for r in got] == [{"text": f"t{i}", "n": i} for i in range(10)]
    assert got[5].location == f"{path}#row 5"
    for start in (0, 3, 4, 9, 10, 11):
        assert [r.sample_id for r in iter_records(str(path), start)] == list(range(start, 10))
    # a parquet file before a jsonl file: skipped by metadata, ids continue after it
    (tmp_path / "e.jsonl").write_text('{"text": "z"}\n')
    got = list(iter_records(str(tmp_path / "*"), 10))
    assert values(got) == [(10, str(tmp_path / "e.jsonl") + ":1", {"text": "z"}, None)]


def test_text_and_gzip(tmp_path):
    (tmp_path / "a.txt").write_text("first\n\nthird line\r\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wb") as f:
        f.write(b'{"text": "zipped"}\n{"text": "again"}\n')
    got = values(iter_records(str(tmp_path)))  # a directory: its data files, sorted
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl.gz")
    assert got == [(0, f"{a}:1", {"text": "first"}, None), (1, f"{a}:2", {"text": ""}, None),
                   (2, f"{a}:3", {"text": "third line"}, None), (3, f"{b}:1", {"text": "zipped"}, None),
                   (4, f"{b}:2", {"text": "again"}, None)]
    assert values(iter_records(str(tmp_path), 4)) == got[4:]
    info = describe(str(tmp_path))
    assert [(f["path"], f["format"], f.get("compression")) for f in info["files"]] == [
        (a, "text", None), (b, "jsonl", "gzip")]


def test_glob_reads_files_in_sorted_order_and_numbers_over_them(tmp_path):
    (tmp_path / "b.jsonl").write_text('{"k": "b0"}\n{"k": "b1"}\n')
    (tmp_path / "a.jsonl").write_text('{"k": "a0"}\n')
    (tmp_path / "c.txt").write_text("not matched\n")
    got = list(iter_records(str(tmp_path / "*.jsonl")))
    assert [(r.sample_id, r.value["k"]) for r in got] == [(0, "a0"), (1, "b0"), (2, "b1")]
    assert [f["path"] for f in describe(str(tmp_path / "*.jsonl"))["files"]] == [
        str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")]


def test_zstd(tmp_path):
    zstandard = pytest.importorskip("zstandard")
    (tmp_path / "a.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(b'{"text": "z0"}\n{"text": "z1"}\n'))
    assert [r.value["text"] for r in iter_records(str(tmp_path / "a.jsonl.zst"))] == ["z0", "z1"]


def test_fsspec_url(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/harvest-test/x/a.jsonl", b'{"text": "m0"}\n{"text": "m1"}\n')
    got = values(iter_records("memory://harvest-test/x/*.jsonl", 1))
    assert got == [(1, "memory:///harvest-test/x/a.jsonl:2", {"text": "m1"}, None)]
    fs.rm("/harvest-test", recursive=True)


def test_sources_on_object_storage_read_through_storage(tmp_path, s3_url):
    """gzip'd jsonl and parquet (footer read by seeking from the end) on s3:// (moto), read from an offset."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from harvest.storage import Storage

    st = Storage(s3_url)
    st.write_bytes("src/a.jsonl.gz", gzip.compress(b'{"text": "g0"}\n{"text": "g1"}\n'))
    pq.write_table(pa.table({"text": [f"p{i}" for i in range(7)]}), tmp_path / "b.parquet", row_group_size=2)
    st.write_bytes("src/b.parquet", (tmp_path / "b.parquet").read_bytes())
    got = [(r.sample_id, r.value["text"]) for r in iter_records(f"{s3_url}/src/*", 1)]
    assert got == [(1, "g1")] + [(2 + i, f"p{i}") for i in range(7)]


def test_source_errors_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="no such file"):
        list(iter_records(str(tmp_path / "missing.jsonl")))
    with pytest.raises(UserError, match="no file matches"):
        list(iter_records(str(tmp_path / "*.jsonl")))
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="unknown file type"):
        list(iter_records(str(tmp_path / "d.csv")))
    (tmp_path / "bad.json").write_text("[{]")
    with pytest.raises(UserError, match="malformed JSON"):
        list(iter_records(str(tmp_path / "bad.json")))
    assert describe("hf://org/set:cfg:train")["hub"] == {"name": "org/set", "config": "cfg", "split": "train"}
    (tmp_path / "empty.json").write_text("{}")
    assert list(iter_records(str(tmp_path / "empty.json"))) == []
    with pytest.raises(UserError, match="hf://NAME"):
        list(iter_records("hf://just-a-name"))


def test_hub_dataset_without_datasets_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(UserError, match=r"pip install -e '\.\[hub\]' in harvest's checkout"):
        list(iter_records("hf://HuggingFaceFW/fineweb-edu:sample-10BT:train"))


def test_hub_dataset_from_local_directory(tmp_path):
    pytest.importorskip("datasets")
    (tmp_path / "data.jsonl").write_text('{"text": "h0"}\n{"text": "h1"}\n')
    got = values(iter_records(f"hf://{tmp_path}:train", 1))
    assert got == [(1, f"hf://{tmp_path}:train#row 1", {"text": "h1"}, None)]
