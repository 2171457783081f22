"""What the store's readers and `harvest verify` check as they read (issue 36, point 10): format versions where
they are read (a newer one refused with one line saying to upgrade, one below 1 refused by the reader and verify
alike), a sidecar that cannot be read named as damage with its data, and every file named by its generation's
path. Runs written shard by shard as the extractor writes them (reader_helpers.RunWriter), on local storage.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from reader_helpers import small_run

import harvest
from harvest.errors import UserError
from harvest.store import format as fmt
from harvest.store.listing import read_chain
from harvest.store.records import GenerationRecord, Sidecar
from harvest.store.verify import verify


@pytest.fixture
def run(tmp_path):
    """3 streams of 2-3 shards, each stream's record count in run.json."""
    written = small_run(str(tmp_path / "run"))
    counts = [read_chain(written.storage, s)[-1].records for s in range(3)]
    _rewrite(written, fmt.RUN_JSON, data={**written.storage.read_json(fmt.RUN_JSON)["data"], "counts": counts})
    assert verify(written.storage.url).ok
    return written


def _rewrite(run, rel: str, **fields) -> None:
    run.storage.write_json(rel, {**run.storage.read_json(rel), **fields})


def test_a_sidecar_of_a_newer_format_is_refused_by_the_reader_resume_and_verify(run):
    _rewrite(run, "stream_00001/shard_000001.json", format_version=fmt.FORMAT_VERSION + 6)
    for read in (lambda: harvest.open(run.storage.url), lambda: read_chain(run.storage, 1)):
        with pytest.raises(UserError) as refused:
            read()
        line = str(refused.value)
        assert "\n" not in line and "shard_000001.json" in line and "upgrade harvest" in line, line
    report = verify(run.storage.url)
    assert not report.ok and any("stream_00001/shard_000001.json" in p and "upgrade harvest" in p
                                 for p in report.problems), report.problems
    assert read_chain(run.storage, 0)  # the current format is read


@pytest.mark.parametrize("version, words", [(0, "no harvest format"), (fmt.FORMAT_VERSION + 1, "upgrade harvest")])
def test_a_run_json_of_another_format_is_refused_alike_by_the_reader_and_verify(run, version, words):
    _rewrite(run, fmt.RUN_JSON, format_version=version)
    with pytest.raises(UserError) as refused:
        harvest.open(run.storage.url)
    assert "\n" not in str(refused.value) and "run.json" in str(refused.value) and words in str(refused.value)
    report = verify(run.storage.url)
    assert not report.ok and len(report.problems) == 1, report.problems
    assert report.problems[0].startswith(f"{run.storage.url}/run.json: ") and words in report.problems[0]


def test_a_truncated_last_sidecar_is_damage_and_its_data_not_a_leftover(run):
    rel = "stream_00002/shard_000001.json"
    data = run.storage.read_json(rel)["file"]
    run.storage.write_bytes(rel, run.storage.read_bytes(rel)[:60])  # cut short
    report = verify(run.storage.url)
    assert not report.ok and not report.leftovers, report.leftovers
    named = [p for p in report.problems if f"stream_00002/{data}: " in p]
    assert named and "damaged" in named[0] and "leftover" not in named[0].split(": ", 1)[1].replace(
        "not a leftover", ""), report.problems
    assert any(f"{rel}: " in p for p in report.problems), report.problems


def _wiped(run, generation: str, ended: list[str]) -> None:
    """Stream 0 as an --overwrite leaves it (harvest.store.commit.wipe): its shards in gen_GENERATION/, named by
    generation.json with the generations wipes ended."""
    root = run.storage
    for name in root.listdir("stream_00000"):
        rel = f"stream_00000/{name}"
        if fmt.sidecar_shard(name) is not None:
            sidecar = dataclasses.replace(Sidecar.from_bytes(root.read_bytes(rel)), generation=generation)
            root.write_bytes(fmt.sidecar_path(0, sidecar.shard, generation), sidecar.to_bytes())
        else:
            root.write_bytes(f"stream_00000/gen_{generation}/{name}", root.read_bytes(rel))
        root.delete(rel)
    root.write_bytes(fmt.generation_path(0), GenerationRecord(generation, ended).to_bytes())


def test_verify_names_the_files_of_a_wiped_stream_by_their_generation(run):
    """verify's lines name the files in gen_GENERATION/, not paths that do not exist."""
    generation, root = "0123456789abcdef", run.storage
    _wiped(run, generation, [""])
    assert verify(root.url).ok
    info = root.read_json(fmt.RUN_JSON)
    counts = info["data"]["counts"]
    root.write_json(fmt.RUN_JSON, {**info, "data": {**info["data"], "counts": [counts[0] + 5, *counts[1:]]}})
    report = verify(root.url)
    lines = [p for p in report.problems if p.startswith(f"{root.url}/stream_00000/")]
    assert lines and all("data.counts says" in p for p in lines), report.problems
    for line in lines:
        path = line[len(root.url) + 1 :].split(": ", 1)[0]
        assert path.startswith(f"stream_00000/gen_{generation}/") and root.exists(path), line
    assert json.loads(root.read_bytes(path))["final"]


def test_verify_tells_ended_generations_by_the_generation_record(run):
    """Ended: the generations generation.json lists as ended (a stalled writer's late files there are read by
    nothing; the next wipe deletes them). A generation neither current nor ended (a wipe stopped between its
    two swaps) is not called ended: the stream is unfinished, and rerunning the extraction settles it."""
    current, ended, started = "0123456789abcdef", "1111111111111111", "2222222222222222"
    _wiped(run, current, ["", ended])
    root = run.storage
    root.write_bytes(f"stream_00000/gen_{ended}/shard_000000.json", b"{}")
    root.write_bytes(f"stream_00000/gen_{started}/shard_000000-00112233.safetensors", b"x")
    report = verify(root.url)
    assert not report.problems, report.problems
    assert report.ended == [f"stream_00000/gen_{ended}/shard_000000.json"]
    assert report.unfinished == [f"{root.url}/stream_00000/gen_{started}/: a generation no reader reads yet, nor "
                                 f"ended (a wipe stopped part-way; generation.json names {current}): rerunning the "
                                 "extraction settles it"]
