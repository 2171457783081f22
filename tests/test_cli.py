"""The `harvest` command as a user runs it: the demo works offline, bad flags give one line and exit 2."""

import os
import subprocess
import sys

import numpy as np

from harvest.data.batching import pack_rows


def harvest(*args, tmp_path):
    env = {**os.environ, "HARVEST_CACHE": str(tmp_path), "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    return subprocess.run([sys.executable, "-m", "harvest", *args], capture_output=True, text=True, env=env, timeout=300)


def test_demo_runs_offline_and_prints_captures(tmp_path):
    result = harvest("demo", "--samples", "12", "--points", "resid_post:0-1,mlp_hidden:1", tmp_path=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "mesh   data=2 x fsdp=1 x model=1" in result.stdout
    for row in ("mlp_hidden │     1", "resid_post │     0", "resid_post │     1"):
        assert row in result.stdout
    assert (tmp_path / "demo-qwen2" / "model.safetensors").exists()


def test_demo_checkpoint_is_the_same_bytes_every_time(tmp_path):
    from harvest.demo import demo_checkpoint

    a = (demo_checkpoint(tmp_path / "a") / "model.safetensors").read_bytes()
    b = (demo_checkpoint(tmp_path / "b") / "model.safetensors").read_bytes()
    assert a == b


def test_bad_flag_values_end_in_one_line_exit_2(tmp_path):
    for args, expected in (
        (("demo", "--points", "resid_post:7"), "layer 7 does not exist; the model has layers 0-3"),
        (("demo", "--mesh", "model=3"), "= 3 devices, but there are 2"),
    ):
        result = harvest(*args, tmp_path=tmp_path)
        assert result.returncode == 2
        assert result.stderr.strip().count("\n") == 0 and expected in result.stderr, result.stderr
        assert "Traceback" not in result.stderr


def test_help_names_the_commands(tmp_path):
    result = harvest("--help", tmp_path=tmp_path)
    assert result.returncode == 0 and "demo" in result.stdout


def test_pack_rows_fills_greedily_in_order():
    samples = [np.full(n, i + 1) for i, n in enumerate([5, 4, 6, 3, 8])]
    tokens, segments, placements = pack_rows(samples, seq_len=10)
    assert [(p.row, p.start) for p in placements] == [(0, 0), (0, 5), (1, 0), (1, 6), (2, 0)]
    assert segments.tolist()[1] == [1] * 6 + [2] * 3 + [0]
    assert tokens.tolist()[1] == [3] * 6 + [4] * 3 + [0]
