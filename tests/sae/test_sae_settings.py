"""`harvest sae train`'s settings: run and tensors as YAML lists or comma-separated flags; bad input is one
line, exit 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sae_helpers import TENSOR


def test_run_and_tensors_are_yaml_lists_or_comma_separated_flags(tmp_path):
    """`run` and `tensors` as YAML lists give the config their comma-separated flags give (flags win), whose
    run settings survive run.json's JSON (a rerun resumes); anything but strings is a one-line error."""
    from harvest.config import ConfigError, build
    from harvest.sae.config import SaeConfig

    listed = tmp_path / "sae.yaml"
    listed.write_text("run: [gs://b/run1, s3://b/run2]\ntensors:\n  - resid_post.1\n  - resid_post.2\nout: o\n")
    from_yaml = build(SaeConfig, str(listed), {})
    from_flags = build(SaeConfig, None, {"run": "gs://b/run1,s3://b/run2", "tensors": "resid_post.1, resid_post.2",
                                         "out": "o"})
    assert from_yaml == from_flags and from_yaml.tensor_names == ("resid_post.1", "resid_post.2")
    assert json.loads(json.dumps(from_yaml.run_settings())) == from_flags.run_settings()
    assert build(SaeConfig, str(listed), {"tensors": "resid_post.2"}).tensors == ["resid_post.2"]
    listed.write_text("run: [gs://b/run1, {a: 1}]\ntensors: resid_post.1\nout: o\n")
    with pytest.raises(ConfigError, match="run must be a list of strings or a comma-separated string"):
        build(SaeConfig, str(listed), {})


def test_bad_input_is_one_line_exit_2_and_nothing_written(sae_source, tmp_path, capsys):
    from reader_helpers import RunWriter

    from harvest.cli import main
    from harvest.storage import Storage

    empty = tmp_path / "empty"
    Storage(str(empty)).write_bytes("run.json", Path(sae_source["run"], "run.json").read_bytes())
    narrow = RunWriter(str(tmp_path / "narrow"), tensors={TENSOR: 32})
    narrow.shard(0, [10, 12])
    out = tmp_path / "out"
    base = ["sae", "train", "--out", str(out), "--tokens", "640", "--batch-tokens", "64", "--tensors", TENSOR]
    cases = [
        (["--run", sae_source["run"], "--tensors", "resid_post.9"], "holds no resid_post.9"),
        (["--run", sae_source["run"], "--latents", "64", "--k", "64"], "--k 64 must be smaller than the 64 latents"),
        (["--run", str(empty)], "has no committed shards"),
        (["--run", sae_source["run"], "--batch-tokens", "12"], "not a multiple of the mesh's 8 data slots"),
        (["--run", f"{sae_source['run']},{tmp_path / 'narrow'}"], "is 64 wide in"),
        (["--run", sae_source["run"], "--architecture", "gated"], "--architecture 'gated': choose one of"),
        (["--run", sae_source["run"], "--eval-every", "5"], "--eval-every needs held-out streams"),
    ]
    for args, message in cases:
        assert main(base + args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("harvest: error:") and message in err[0], (args, err)
        assert not out.exists(), args
