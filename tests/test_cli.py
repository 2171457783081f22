"""The `harvest` command as a user runs it: the demo works offline, bad flags give one line and exit 2."""

import os
import subprocess
import sys

import numpy as np

from harvest.data import batching
from harvest.data.batching import Piece, Skip, StreamEnd, pack_stream


def harvest(*args, tmp_path):
    env = {**os.environ, "HARVEST_CACHE": str(tmp_path), "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    return subprocess.run([sys.executable, "-m", "harvest", *args], capture_output=True, text=True, env=env, timeout=300)


def test_demo_runs_the_whole_pipeline_offline(tmp_path):
    result = harvest("demo", "--tasks", "6", "--points", "resid_post:0-1,mlp_hidden:1", "--out", str(tmp_path / "run"),
                     tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "2 streams [3, 3]" in result.stdout
    assert "4. verify  OK" in result.stdout
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run.json", "stream_00000", "stream_00001"]
    assert (tmp_path / "demo-qwen2-v2" / "tokenizer.json").exists()


def test_demo_checkpoint_is_the_same_bytes_every_time(tmp_path):
    from harvest.demo import demo_checkpoint

    a = (demo_checkpoint(tmp_path / "a") / "model.safetensors").read_bytes()
    b = (demo_checkpoint(tmp_path / "b") / "model.safetensors").read_bytes()
    assert a == b


def test_bad_flag_values_end_in_one_line_exit_2(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"text": "hello"}\n')
    for args, expected in (
        (("demo", "--tasks", "2", "--points", "resid_post:7"), "layer 7 does not exist; the model has layers 0-3"),
        (("extract", "--model", str(tmp_path), "--data", "x.jsonl"), "missing --out"),
        (("extract", "--model", "/no/model", "--data", "x.jsonl", "--out", str(tmp_path / "o"), "--format", "csv"),
         "--format 'csv': choose one of text, chat, arc"),
        (("extract", "--model", "/no/model", "--data", "x.jsonl", "--out", str(tmp_path / "o")),
         "--model /no/model: no such directory"),
        (("streams", "create", "--data", str(data), "--num-streams", "2", "--out", str(data / "sub")),
         "cannot create the directory (Not a directory)"),
    ):
        result = harvest(*args, tmp_path=tmp_path)
        assert result.returncode == 2
        assert result.stderr.strip().count("\n") == 0 and expected in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_help_names_the_commands(tmp_path):
    result = harvest("--help", tmp_path=tmp_path)
    assert result.returncode == 0 and "demo" in result.stdout


def test_pack_stream_packs_blocks_best_fit_and_resumes_from_a_block_start(monkeypatch):
    monkeypatch.setattr(batching, "PACK_ROWS", 2)  # blocks of >= 20 tokens with rows of 10
    lengths = [5, 4, 6, 3, 8, 2, 9, 7, 1]
    pieces = [Piece((i, 0), i, np.full(n, i + 1, np.int32)) for i, n in enumerate(lengths)]
    skip = Skip((9, 0), 9, "line 10", "bad")
    rows = list(pack_stream([*pieces, skip, StreamEnd(10)], seq_len=10))
    # block 1: pieces 0-3 (18 tokens) + 4 -> 26 >= 20; best-fit decreasing: [8], [6, 4], [5, 3]
    assert [[p.pos[0] for p, _ in r.events] for r in rows] == [[4], [1, 2], [0, 3], [6, 8], [5, 7]]
    assert [r.start for r in rows] == [(0, 0)] * 3 + [(5, 0)] * 2
    assert rows[1].segments.tolist() == [1] * 4 + [2] * 6
    assert rows[1].tokens.tolist() == [2] * 4 + [3] * 6
    assert [r.block is not None for r in rows] == [False, False, True, False, True]
    assert [e.pos[0] for e in rows[2].block] == [0, 1, 2, 3, 4] and rows[-1].block[-1] == skip
    assert rows[-1].end == StreamEnd(10)
    assert sum(r.used for r in rows) / (10 * len(rows)) == sum(lengths) / 50
    resumed = list(pack_stream([*pieces, skip, StreamEnd(10)], seq_len=10, skip_before=(5, 0)))
    assert [r.tokens.tolist() for r in resumed] == [r.tokens.tolist() for r in rows[3:]]