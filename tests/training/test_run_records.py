"""run.json as the trainers wrote it before the records were typed (fcb1c09): read back as each kind's typed
record and written again key for key, so runs started before resume; one written before format 1 still reads."""

import pytest

from harvest.storage import Storage
from harvest.training.record import DecoderDetails, RunMismatch, RunRecord, SaeDetails, TrmDetails, read_run

COMMON = {"compute_dtype": "float32", "config_sha256": "ab" * 32, "format_version": 1, "harvest_version": "0.1.0",
          "kernel": None, "mesh": "data=1 x fsdp=2 x model=1", "run_id": "0123456789abcdef"}
OLD = {
    "train": {**COMMON, "kind": "train", "kernel": "dense", "config": {"steps": 4, "seq_len": 32},
              "run_settings": {"seq_len": 32, "seed": 0}, "hf_config": {"model_type": "llama", "vocab_size": 320},
              "tokenizer": "/tmp/demo", "model_type": "llama", "num_params": 39104},
    "sae": {**COMMON, "kind": "sae", "config": {"tokens": 512, "batch_tokens": 64},
            "run_settings": {"run": ["/tmp/run"], "mesh": "data=2", "processes": 1},
            "saes": {"resid_post.1": {"architecture": "topk", "width": 64, "latents": 256, "scale": 1.0,
                                      "max_norm": 10.0, "median_norm": [3.5], "norm_limit": [35.0]}}},
    "trm": {**COMMON, "kind": "trm", "compute_dtype": None, "config": {"batch_size": 16},
            "run_settings": {"data": "/tmp/sudoku4", "seed": 0}, "steps": 8, "dataset": "sudoku",
            "trm": {"model": {"hidden": 16}, "optim": {"lr": 0.003}}, "num_params": 5280},
}


@pytest.mark.parametrize("kind,details", [("train", DecoderDetails), ("sae", SaeDetails), ("trm", TrmDetails)])
def test_an_old_run_json_reads_typed_and_writes_back_key_for_key(tmp_path, kind, details):
    out = Storage(str(tmp_path))
    out.write_json("run.json", OLD[kind])
    record = read_run(out, kind, "a run")
    assert isinstance(record.details, details)
    assert record.to_json() == OLD[kind]
    assert list(record.to_json()) == list(RunRecord.from_json(record.to_json()).to_json())


def test_a_record_before_format_1_and_a_foreign_kind(tmp_path):
    out = Storage(str(tmp_path))
    old = {k: v for k, v in OLD["train"].items() if k not in ("run_id", "format_version", "kernel")}
    out.write_json("run.json", {**old, "attention": "dense"})
    record = read_run(out, "train", "a training run")
    assert (record.run_id, record.format_version, record.kernel) == ("", 0, "dense")
    assert record.details.num_params == 39104 and record.details.hf_config["vocab_size"] == 320
    with pytest.raises(RunMismatch, match="a run of kind 'train'"):
        read_run(out, "sae", "an SAE run")
    out.write_json("run.json", {**old, "kind": "extract"})
    with pytest.raises(RunMismatch, match="kind 'extract'"):
        read_run(out)
