"""Reader, verify and status/inspect over synthetic runs (tests/fake_runs.py)."""

from __future__ import annotations

import importlib.util

import ml_dtypes
import numpy as np
import pytest
from fake_runs import COUNTS, SKIPPED, TENSORS, FakeRun, fake_run, write_shard

from harvest.errors import UserError
from harvest.store import format as fmt
from harvest.read import open_run
from harvest.store.listing import read_chain
from harvest.store.report import human_bytes, inspect, status_rows, status_table, watch
from harvest.store.verify import verify


@pytest.fixture
def run(tmp_path) -> FakeRun:
    return fake_run(tmp_path)


# reader ----------------------------------------------------------------------------------------------------
def test_open_and_sample_access(run):
    r = open_run(run.url)
    assert r.tensors == TENSORS
    assert r.streams == [0, 1]
    assert [(sc.stream, sc.shard) for sc in r.shards] == [
        (s, k) for s in (0, 1) for k in range(len(run.shards[s]))]
    assert r.num_samples == len(run.pieces)
    assert r.num_tokens == len(run.all_tokens())
    for (sample_id, variant), piece in run.pieces.items():
        sample = r.sample(sample_id, variant)
        assert (sample.sample_id, sample.variant, sample.stream) == (sample_id, variant, sample_id % 2)
        assert sample.tokens.dtype == np.int32
        np.testing.assert_array_equal(sample.tokens, piece.tokens)
        for name in TENSORS:
            assert sample.activations[name].dtype == ml_dtypes.bfloat16
            np.testing.assert_array_equal(sample.activations[name], piece.acts[name])
    with pytest.raises(KeyError, match="skipped by the run: bad"):
        r.sample(3 * 2 + 0)
    with pytest.raises(KeyError, match="not in run"):
        r.sample(1000)
    with pytest.raises(KeyError, match="variant 5 is not in run"):
        r.sample(0, 5)
    seen = [(s.sample_id, s.variant) for s in r.iter_samples()]
    assert sorted(seen) == sorted(run.pieces) and len(seen) == len(set(seen))
    assert [s.sample_id % 2 for s in r.iter_samples(streams=[1])] == [1] * sum(k[0] % 2 for k in run.pieces)


def test_unknown_mapping_falls_back_to_a_scan(run):
    info = run.storage.read_json("run.json")
    info["data"]["mapping"] = "custom"
    run.storage.write_json("run.json", info)
    r = open_run(run.url)
    (sample_id, variant), piece = next(iter(run.pieces.items()))
    np.testing.assert_array_equal(r.sample(sample_id, variant).tokens, piece.tokens)
    with pytest.raises(KeyError, match="skipped"):
        r.sample(3 * 2 + 0)


def test_not_a_run(tmp_path):
    from harvest.errors import UserError

    with pytest.raises(UserError, match="no run.json"):
        open_run(str(tmp_path / "nothing"))


def _epoch(r, **kw):
    return list(r.token_batches(kw.pop("batch_size", 7), **kw))


def test_token_batches_cover_every_token_once(run):
    r = open_run(run.url)
    by_token = {int(t): (p.acts, j) for p in run.pieces.values() for j, t in enumerate(p.tokens)}
    batches = _epoch(r, seed=0, shard_buffer=2)
    tokens = np.concatenate([b["tokens"] for b in batches])
    assert sorted(tokens.tolist()) == sorted(run.all_tokens().tolist())
    assert all(len(b["tokens"]) == 7 for b in batches[:-1]) and 0 < len(batches[-1]["tokens"]) <= 7
    for b in batches:  # rows stay aligned across tensors
        assert set(b) == {"tokens", *TENSORS}
        for row, t in enumerate(b["tokens"].tolist()):
            acts, j = by_token[t]
            for name in TENSORS:
                assert b[name].shape[1] == TENSORS[name] and b[name].dtype == ml_dtypes.bfloat16
                np.testing.assert_array_equal(b[name][row], acts[name][j])
    # deterministic per seed, different across seeds (each still every token once)
    again = np.concatenate([b["tokens"] for b in _epoch(r, seed=0, shard_buffer=2)])
    other = np.concatenate([b["tokens"] for b in _epoch(r, seed=1, shard_buffer=2)])
    np.testing.assert_array_equal(tokens, again)
    assert not np.array_equal(tokens, other) and sorted(other.tolist()) == sorted(tokens.tolist())
    # drop_last and tensor selection
    dropped = _epoch(r, batch_size=5, drop_last=True, tensors="resid_post.1")
    assert all(len(b["tokens"]) == 5 for b in dropped) and set(dropped[0]) == {"tokens", "resid_post.1"}
    assert len(dropped) == len(run.all_tokens()) // 5
    with pytest.raises(KeyError, match="nope"):
        r.token_batches(4, ["nope"])


def test_token_batches_unshuffled_follow_the_shards(run):
    r = open_run(run.url)
    in_order = np.concatenate([b["tokens"] for b in _epoch(r, shuffle=False, shard_buffer=3)])
    expected = [int(t) for sc in r.shards for sample in r.shard_samples(sc) for t in sample.tokens]
    assert in_order.tolist() == expected


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_token_batches_as_torch(run):
    import torch

    r = open_run(run.url)
    plain = _epoch(r, seed=3)
    torched = _epoch(r, seed=3, as_torch=True)
    assert len(plain) == len(torched)
    for a, b in zip(plain, torched):
        assert b["tokens"].dtype == torch.int32 and b["resid_post.1"].dtype == torch.bfloat16
        np.testing.assert_array_equal(b["tokens"].numpy(), a["tokens"])
        np.testing.assert_array_equal(b["resid_post.1"].float().numpy(), a["resid_post.1"].astype(np.float32))


def test_merged_stats_equal_numpy_over_all_tokens(run):
    r = open_run(run.url)
    for name in TENSORS:
        stats = r.stats(name)
        values = run.all_acts(name).astype(np.float64)
        assert stats.count == len(values)
        np.testing.assert_allclose(stats.mean, values.mean(axis=0), rtol=1e-12, atol=0)
        np.testing.assert_allclose(stats.var, values.var(axis=0, ddof=1), rtol=1e-12, atol=0)
    with pytest.raises(KeyError, match="holds"):
        r.stats("resid_post.7")


# verify ----------------------------------------------------------------------------------------------------
def test_verify_clean_run(run):
    report = verify(run.url)
    assert report.ok, report.problems
    assert report.streams == 2 and report.records == sum(COUNTS) and report.skipped == len(SKIPPED)
    assert report.samples == len(run.pieces) and report.tokens == len(run.all_tokens())
    assert report.summary.startswith("OK ")


def _rewrite_with_overlap(run: FakeRun) -> None:
    """Shard 1 of stream 0 starts one piece early: the last piece of shard 0 is written twice."""
    (p0, _, _, _, _, _), (p1, sk1, _, next1, final1, records1) = run.shards[0][:2]
    dup = p0[-1]
    write_shard(run.storage, 0, 1, [dup, *p1], sk1, (dup.index, dup.variant), next1, final1, records1)


def _corrupt(run: FakeRun) -> None:
    rel = "stream_00000/shard_000001.safetensors"
    data = bytearray(run.storage.read_bytes(rel))
    data[-3] ^= 0x40
    run.storage.write_bytes(rel, bytes(data))


def _delete(*rels):
    return lambda run: [run.storage.delete(rel) for rel in rels]


def _last(stream: int, run: FakeRun) -> str:
    return f"stream_{stream:05d}/shard_{len(run.shards[stream]) - 1:06d}"


CASES = {
    "deleted shard file": (_delete("stream_00000/shard_000001.safetensors"),
                           "stream_00000/shard_000001.json", "without its data"),
    "corrupted byte": (_corrupt, "stream_00000/shard_000001.safetensors", "checksum mismatch"),
    "deleted sidecar": (_delete("stream_00001/shard_000000.json"),  # its data object is then a leftover
                        "stream_00001/shard_000001.json", "gap: shard_000000 missing"),
    "gap": (_delete("stream_00000/shard_000001.safetensors", "stream_00000/shard_000001.json"),
            "stream_00000/shard_000002.json", "gap: shard_000001 missing"),
    "overlap": (_rewrite_with_overlap, "stream_00000/shard_000001.safetensors", "duplicate sample"),
    "unknown file": (lambda run: run.storage.write_bytes("stream_00001/notes.txt", b"x"),
                     "stream_00001/notes.txt", "unknown file"),
    "wrong count": (lambda run: run.storage.write_json("run.json", {
        **run.storage.read_json("run.json"),
        "data": {**run.storage.read_json("run.json")["data"], "counts": [9, 9]}}),
        "stream_00001/shard_000003.json", "data.counts says 9"),
}


@pytest.mark.parametrize("case", CASES)
def test_verify_reports_each_problem(tmp_path, case):
    run = fake_run(tmp_path)
    break_it, rel, words = CASES[case]
    assert len(run.shards[0]) == 3 and len(run.shards[1]) == 4  # the cases above name these files
    break_it(run)
    report = verify(run.url)
    assert not report.ok
    hits = [line for line in report.problems if line.startswith(f"{run.url}/{rel}: ") and words in line]
    assert hits, "\n".join(report.problems)
    assert all("\n" not in line for line in report.problems)
    assert len(report.problems) <= 2, "\n".join(report.problems)  # one fault, not a cascade of lines
    assert report.summary.startswith("FAILED ")


def test_uncommitted_data_objects_are_leftovers_not_problems(tmp_path):
    """What a writer that lost its stream, or was killed before its commit, leaves: listed, not failed."""
    run = fake_run(tmp_path)
    names = ["stream_00000/shard_000001-0123456789abcdef.safetensors", "stream_00001/shard_000009-fedcba98.safetensors"]
    for name in names:
        run.storage.write_bytes(name, b"not committed")
    report = verify(run.url)
    assert report.ok, report.problems
    assert report.leftovers == names and "2 uncommitted leftovers" in report.summary
    assert report.lines()[0] == f"{run.url}/{names[0]}: leftover, committed by no sidecar (deleted by the stream's " \
                                "next writer)"


def test_verify_several_runs(tmp_path, capsys):
    from harvest.cli import main

    good, bad = fake_run(tmp_path, "a"), fake_run(tmp_path, "b", seed=1)
    assert main(["verify", good.url]) == 0
    bad.storage.delete("run.json")
    capsys.readouterr()
    assert main(["verify", good.url, bad.url]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"OK {good.url}:")
    assert lines[1] == f"{bad.url}/run.json: missing: not a harvest run, or one that never started"
    assert lines[2].startswith(f"FAILED {bad.url}:")


def test_plain_source_of_unknown_length(tmp_path):
    run = fake_run(tmp_path, counts=[6], known=False)
    report = verify(run.url)
    assert report.ok and report.records == 6, report.problems
    r = open_run(run.url)
    for (sample_id, variant), piece in run.pieces.items():  # sample_id = line index
        np.testing.assert_array_equal(r.sample(sample_id, variant).tokens, piece.tokens)
    assert [row["total"] for row in status_rows(run.url)] == [6]
    _delete(_last(0, run) + ".safetensors", _last(0, run) + ".json")(run)
    assert [row["total"] for row in status_rows(run.url)] == [6]  # from progress.json while running
    report = verify(run.url)
    assert not report.problems and [line.split(": ")[1] for line in report.unfinished] == [
        "no final shard after this one"]
    assert report.summary.startswith(f"INCOMPLETE {run.url}: 1 stream not finished, every committed shard checks")


def test_verify_incomplete_stream_and_stray_stream(run):
    run.storage.write_bytes("stream_00007/shard_000000.json", b"{}")
    report = verify(run.url)
    assert [line.split(": ")[0] for line in report.problems] == [f"{run.url}/stream_00007/"]


# status / inspect ------------------------------------------------------------------------------------------
def _render(renderable) -> str:
    from rich.console import Console

    console = Console(record=True, width=220, color_system=None)
    for r in renderable if isinstance(renderable, list) else [renderable]:
        console.print(r)
    return console.export_text()


def test_status_and_inspect(run):
    rows = status_rows(run.url)
    assert [(r["stream"], r["state"], r["records"], r["total"]) for r in rows] == [
        (0, "done", COUNTS[0], COUNTS[0]), (1, "done", COUNTS[1], COUNTS[1])]
    assert sum(r["samples"] for r in rows) == len(run.pieces)
    text = _render(status_table(run.url))
    assert "2/2 streams done" in text and "w1" in text and "total" in text
    text = _render(inspect(run.url))
    for words in ("resid_post.1", "mlp_out.0", "bfloat16", f"{len(run.all_tokens()):,} tokens", "sample 0 variant 0"):
        assert words in text, text
    from rich.console import Console

    watch(run.url, interval=0.01, console=Console(record=True, width=200))  # returns: every stream is done


def test_status_of_a_run_in_progress(run):
    run.storage.delete(_last(0, run) + ".json")
    run.storage.write_json("stream_00000/progress.json", {
        **run.storage.read_json("stream_00000/progress.json"), "done": False, "tokens_per_s": 1234.0,
        "updated_at": __import__("datetime").datetime.now(__import__("datetime").timezone.utc).isoformat()})
    rows = status_rows(run.url)
    assert rows[0]["state"] == "running" and rows[0]["rate"] == 1234.0
    assert rows[0]["shards"] == len(run.shards[0]) - 1
    # what storage absorbs: the rate at the bytes per token of the stream's committed data objects
    chain = read_chain(run.storage, 0)
    stored = sum(len(run.storage.read_bytes(f"{fmt.stream_dir(0)}/{sidecar.file}")) for sidecar in chain)
    assert rows[0]["bytes"] == stored
    assert rows[0]["byte_rate"] == pytest.approx(1234.0 * stored / sum(sidecar.tokens for sidecar in chain))
    assert rows[1]["byte_rate"] == 0.0  # done: nothing written now
    text = _render(status_table(run.url))
    assert "1.2K" in text and human_bytes(rows[0]["byte_rate"]) in text and human_bytes(stored) in text


def test_a_run_that_has_not_started(tmp_path):
    run = fake_run(tmp_path)
    for s in (0, 1):
        for name in run.storage.listdir(fmt.stream_dir(s)):
            run.storage.delete(f"{fmt.stream_dir(s)}/{name}")
    assert open_run(run.url).num_samples == 0
    assert [r["state"] for r in status_rows(run.url)] == ["pending", "pending"]
    assert "no committed sample yet" in _render(inspect(run.url))
    report = verify(run.url)  # nothing wrong, nothing done: incomplete
    assert not report.problems and report.summary.startswith(f"INCOMPLETE {run.url}: 2 streams not finished")
    assert [line.split(": ")[0] for line in report.unfinished] == [f"{run.url}/stream_00000/",
                                                                   f"{run.url}/stream_00001/"]
    assert list(open_run(run.url).token_batches(4)) == []


def test_an_endless_read_of_less_than_one_batch_is_refused_not_spun(tmp_path):
    """epochs=None with drop_last over streams holding fewer tokens than a batch would loop for ever, starting
    epoch after epoch without a batch (sae train hung so on a tiny demo): one line instead, naming the sizes."""
    run = fake_run(tmp_path)
    r = open_run(run.url)
    total = r.num_tokens
    with pytest.raises(UserError, match=rf"gives {total:,} tokens, fewer than one batch of {total + 1:,} \(drop_last\)"):
        next(iter(r.token_batches(total + 1, list(r.tensors)[0], epochs=None, drop_last=True, exclude=[])))
    endless = iter(r.token_batches(total + 1, list(r.tensors)[0], epochs=None, exclude=[]))  # short batches serve
    assert [len(next(endless)["tokens"]) for _ in range(3)] == [total] * 3
    full = iter(r.token_batches(total, list(r.tensors)[0], epochs=None, drop_last=True, exclude=[]))
    assert [len(next(full)["tokens"]) for _ in range(3)] == [total] * 3
